"""Plan an SDPA site (one unpacked sequence, chunk layouts): check every rule, failing with one clear error."""

from __future__ import annotations

import math

from ...comms.registry import dense_feature_problem, get_comm
from ...errors import CPCompileError, site_error
from ...layouts import THD_LAYOUTS, get_layout
from ...layouts.block import NO_WINDOW
from ...mesh import CPGroup
from ..auto import resolve, site_comms, site_kernels
from ..checks import constant, is_static
from ..cost_shape import site_shape
from ..plans import CPConfig, CPPlan
from ..site import AttentionSite
from .costing import DENSE
from .features import check_token_metadata, sinks_of, softcap_of, window_of
from .mask_hints import mask_fix

SEQ_DIM = 2
"""q (B, H, L, D) holds the tokens on L."""


def plan_dense_site(site: AttentionSite, config: CPConfig, group: CPGroup) -> CPPlan:
    """Validate an SDPA `site` against the rules of CP with this config and return its plan (or raise)."""
    node = site.node
    if config.strategy in THD_LAYOUTS:
        raise site_error(
            node,
            f"strategy={config.strategy!r} lays out packed documents for varlen_attn, but this is "
            "scaled_dot_product_attention over one unpacked sequence",
            "use strategy='flat' or 'zigzag' for SDPA models, or call torch.nn.attention.varlen.varlen_attn",
        )
    if site.attn_mask is not None:
        raise site_error(
            node,
            "an explicit attn_mask tensor cannot be sharded across CP ranks",
            mask_fix(node)
            or "use is_causal=True (or no mask) in scaled_dot_product_attention (sliding windows: "
            "cpcompile.attention); for padded or packed sequences use varlen attention with cu_seqlens",
        )
    dropout = constant(site, "dropout_p", site.dropout_p, (int, float))
    if dropout != 0:
        raise site_error(
            node,
            f"dropout_p={dropout}: attention dropout is not supported in a CP region",
            "set attention dropout to 0 (e.g. attention_dropout=0.0 in the model config; Hugging Face: "
            "attention_dropout, attn_pdrop or attention_probs_dropout_prob=0.0, or model.eval(), which passes 0)",
        )
    causal = bool(constant(site, "is_causal", site.is_causal, (bool, int)))
    for name, shape in (("query", site.q_shape), ("key", site.k_shape), ("value", site.v_shape)):
        if len(shape) != 4:
            raise site_error(
                node,
                f"its {name} has shape {shape}; cpcompile needs 4-D (batch, heads, seq, head_dim) inputs",
                "call scaled_dot_product_attention with 4-D tensors",
            )
        if not is_static(shape[1:]):  # the batch may change (the last batch of an epoch): it is no CP dim
            raise site_error(
                node,
                f"its {name} has a dynamic shape {shape}; the CP blocks are planned for static lengths and heads",
                "compile with dynamic=False (pad batches to a fixed length with cpcompile.pad_to_multiple); "
                "without it, Dynamo makes a length dynamic by itself once a second length is compiled",
            )
    (_, _, sq, d), (_, _, sk, _), (_, _, sv, _) = site.q_shape, site.k_shape, site.v_shape
    if sq == 0:
        raise site_error(
            node,
            "its query has 0 local tokens (an empty sequence); the CPU and GPU attention kernels cannot run on it",
            "feed every rank a non-empty shard (a global sequence of at least one chunk per rank)",
        )
    if sq != sk or sk != sv:
        raise site_error(
            node,
            f"q has {sq} local tokens but k/v have {sk}/{sv}; CP shards q, k and v along the same sequence",
            "use CP only for self-attention whose q, k and v come from the same sharded tokens",
        )
    if site.k_shape[-1] != d:
        raise site_error(
            node,
            f"q head dim {d} and k head dim {site.k_shape[-1]} differ; attention scores need one q/k head dim",
            "give q and k the same head dim (v's may differ, as in MLA)",
        )

    window = window_of(site, causal, sq * group.size)
    softcap = softcap_of(site)
    sinks = sinks_of(site)
    check_token_metadata(site)
    features = (("window",) if window is not None else ()) + (("softcap",) if softcap else ())

    def comm_problem(name: str) -> tuple[str, str] | None:
        """The comm's rules for this site, read from its capabilities (comm/capabilities.py)."""
        comm = get_comm(name)
        if not comm.serves("sdpa"):
            return comm.capabilities.dense_refusal
        caps = comm.capabilities
        return (
            caps.levels_problem(name, group.level_sizes)
            or dense_feature_problem(comm, features)
            or caps.head_problem(site.q_shape[1], site.k_shape[1], group.size, group.level_sizes)
        )

    comms = site_comms(site, config.comm, comm_problem)
    layout = get_layout(config.strategy)
    if sq % layout.chunks_per_rank != 0:
        raise site_error(
            node,
            f"layout {layout.name!r} splits each rank's tokens into {layout.chunks_per_rank} equal chunks, "
            f"but this rank has {sq} tokens",
            f"pad the global sequence to a multiple of {layout.required_multiple(group.size)} tokens "
            "(cpcompile.pad_to_multiple) before cpcompile.shard",
        )
    try:
        kernels = site_kernels(site, config.kernel, d, varlen=False, features=features)
    except CPCompileError as e:
        if not softcap:
            raise
        raise site_error(
            node,
            f"its scores are softcapped (softcap={softcap}, e.g. Gemma 2's attn_logit_softcapping) and no kernel "
            f"here caps scores ({e}); 'flex_softcap' (FlexAttention, CUDA fp16/bf16, head dims powers of two in "
            "[16, 256]) and 'cpu_ref' (CPU) do",
            "use kernel='auto' (it picks them for softcapped sites), or name one of them",
        ) from None
    shape = site_shape(site, DENSE, causal, group.size, SEQ_DIM, window=window or NO_WINDOW, levels=group.level_sizes)
    comm, kernel, choice = resolve(shape, layout.name, comms, kernels)
    scale = float(constant(site, "scale", site.scale, (int, float))) if site.scale is not None else 1 / math.sqrt(d)
    return CPPlan(
        site=site,
        layout=layout.name,
        comm=comm,
        kernel=kernel,
        causal=causal,
        scale=scale,
        group=group,
        window=window,
        softcap=softcap,
        choice=choice,
        sinks=sinks,
    )
