"""DTensor sharding rules for the CPU SDPA kernels, so SDPA on CPU DTensors traces (and runs) at all.

torch 2.11-2.14 register DTensor strategies for the CUDA SDPA kernels (flash, efficient, cuDNN) but not for
`aten._scaled_dot_product_flash_attention_for_cpu(_backward)`: on CPU DTensors SDPA fails with "does not have a
sharding strategy registered" (2.11: the forward; 2.13 and 2.14: the backward), so Dynamo's fake-tensor
propagation of a model with DTensor attention fails before any backend sees the graph. The rules below are the
ones torch uses for the CUDA flash kernel (replicate, or shard batch, or shard heads), so eager DTensor SDPA stays
correct: a sequence-sharded input is redistributed first. cpcompile replaces the node anyway; the rule only lets
tracing through. A rule torch already has is never replaced (on such a torch this is a no-op).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

TORCH_VERSIONS = ("2.11", "2.13", "2.14")
"""The torch releases that lack the rules (tests/unit/test_compat.py checks the installed one's unpatched DTensor
SDPA on CPU against this list)."""

_aten = torch.ops.aten
CPU_OPS = (
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
)
_PLACEMENTS = (Replicate(), Shard(0), Shard(1))  # everything replicated, or batch, or heads sharded


def has_rule(op) -> bool:
    """Whether DTensor's sharding propagator has any strategy or rule for `op`."""
    prop = DTensor._op_dispatcher.sharding_propagator
    names = ("op_strategy_funcs", "op_to_rules", "op_single_dim_strategy_funcs")
    return any(op in getattr(prop, n, {}) for n in names)


def _forward_rule(query, key, value, dropout_p=0.0, is_causal=False, attn_mask=None, scale=None):
    # outputs (out, logsumexp), inputs (q, k, v, dropout_p, is_causal, attn_mask, scale)
    return [([p, p], [p, p, p, None, None, None, None]) for p in _PLACEMENTS]


def _backward_rule(grad, query, key, value, out, lse, dropout_p=0.0, is_causal=False, attn_mask=None, scale=None):
    # outputs (dq, dk, dv), inputs (grad, q, k, v, out, lse, dropout_p, is_causal, attn_mask, scale)
    return [([p, p, p], [p, p, p, p, p, p, None, None, None, None]) for p in _PLACEMENTS]


def register_cpu_sdpa_rules() -> list:
    """Give DTensor a sharding rule for the CPU SDPA kernels where it has none (idempotent); the ops given one."""
    from torch.distributed.tensor.experimental import register_sharding

    registered = []
    for op, rule in zip(CPU_OPS, (_forward_rule, _backward_rule)):
        if not has_rule(op):
            register_sharding(op)(rule)
            registered.append(op)
    return registered
