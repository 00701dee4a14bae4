"""DTensor sharding rules for the CPU SDPA kernels, so Dynamo can trace SDPA on DTensors on CPU.

torch 2.13 registers DTensor strategies for the CUDA SDPA kernels (flash, efficient, cuDNN) but not for
`aten._scaled_dot_product_flash_attention_for_cpu(_backward)`, so Dynamo's fake-tensor propagation of an SDPA
call on CPU DTensors fails before any backend sees the graph. The rules below are the ones torch uses for the
CUDA flash kernel (replicate, or shard batch, or shard heads), so eager DTensor SDPA stays correct: a
sequence-sharded input is redistributed first. cpcompile replaces the node anyway; the rule only lets tracing
through. A rule torch already has is never replaced.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

_aten = torch.ops.aten
_CPU_FWD = _aten._scaled_dot_product_flash_attention_for_cpu.default
_CPU_BWD = _aten._scaled_dot_product_flash_attention_for_cpu_backward.default
_PLACEMENTS = (Replicate(), Shard(0), Shard(1))  # everything replicated, or batch, or heads sharded


def _has_rule(op) -> bool:
    prop = DTensor._op_dispatcher.sharding_propagator
    return any(op in table for table in (prop.op_strategy_funcs, prop.op_to_rules, prop.op_single_dim_strategy_funcs))


def _forward_rule(query, key, value, dropout_p=0.0, is_causal=False, attn_mask=None, scale=None):
    # outputs (out, logsumexp), inputs (q, k, v, dropout_p, is_causal, attn_mask, scale)
    return [([p, p], [p, p, p, None, None, None, None]) for p in _PLACEMENTS]


def _backward_rule(grad, query, key, value, out, lse, dropout_p=0.0, is_causal=False, attn_mask=None, scale=None):
    # outputs (dq, dk, dv), inputs (grad, q, k, v, out, lse, dropout_p, is_causal, attn_mask, scale)
    return [([p, p, p], [p, p, p, p, p, p, None, None, None, None]) for p in _PLACEMENTS]


def register_cpu_sdpa_rules() -> None:
    """Give DTensor a sharding rule for the CPU SDPA kernels where it has none (idempotent)."""
    from torch.distributed.tensor.experimental import register_sharding

    for op, rule in ((_CPU_FWD, _forward_rule), (_CPU_BWD, _backward_rule)):
        if not _has_rule(op):
            register_sharding(op)(rule)
