"""Plan varlen_attn sites (packed documents): validate them against the THD layouts and build a VarlenPlan."""

from __future__ import annotations

import math
import operator

import torch
import torch.fx

from ...comm.entry import Comm
from ...comms.registry import comms_that, get_comm, packed_layout_problem
from ...errors import site_error
from ...kernels import get_varlen_kernel
from ...layouts import THD_LAYOUTS
from ...layouts.block import NO_WINDOW
from ...mesh import CPGroup
from ..auto import resolve, site_comms, site_kernels
from ..checks import is_static
from ..cost_shape import site_shape
from ..plans import CPConfig
from ..site import AttentionSite
from .costing import PACKED
from .plan_type import VarlenPlan

SEQ_DIM = 0
"""Packed q (T, H, D) holds the tokens on T."""


def _window(site: AttentionSite) -> tuple | None:
    window = site.window
    if isinstance(window, torch.fx.Node) or (window is not None and not isinstance(window, (list, tuple))):
        return None
    window = tuple(NO_WINDOW if window is None else window)
    return window if all(isinstance(w, int) for w in window) else None


def _mask(site: AttentionSite) -> tuple[bool, tuple[int, int], tuple[int, int]]:
    """(causal, extra window, window_size as given) from window_size / is_causal: (-1, 0) causal, (-1, -1) full,
    (w, 0) sliding causal, (left, right) two-sided (which comms take which: Capabilities.packed_window_problem)."""
    node, window, is_causal = site.node, _window(site), site.is_causal
    if window is None or not isinstance(is_causal, (bool, int)) or isinstance(is_causal, torch.fx.Node):
        raise site_error(
            node,
            f"its window_size {site.window!r} / is_causal {is_causal!r} are not Python constants",
            "pass window_size=(-1, 0) (causal) or leave it at (-1, -1), as constants",
        )
    if len(window) != 2 or any(w < -1 for w in window):
        raise site_error(
            node,
            f"window_size={window}: each side must be a token count >= 0 or -1 (unbounded)",
            "pass window_size=(left, right), e.g. (-1, 0) causal or (w, 0) sliding causal",
        )
    causal = bool(is_causal) or window[1] == 0
    left, right = window
    return causal, (left, -1 if causal else right), window


def _reads_lse(node: torch.fx.Node) -> bool:
    """Whether anything but `out` (getitem 0) or the unused rng state is read from the varlen node."""
    return any(not (u.target is operator.getitem and u.args[1] in (0, 2)) for u in node.users)


def _comm_problem(
    site: AttentionSite, strategy: str, comm: Comm, group: CPGroup, window: tuple[int, int], causal: bool
) -> tuple[str, str] | None:
    """The comm's rules for packed documents, read from its capabilities (comm/capabilities.py): a varlen region,
    the windows it takes, the packed layouts it takes, the head split. (rule broken, fix) or None."""
    if not comm.serves("varlen"):
        return (
            f"comm={comm.name!r} has no varlen region yet",
            f"use comm in {sorted(comms_that(lambda c: c.serves('varlen')))} for varlen_attn",
        )
    caps = comm.capabilities
    return (
        caps.levels_problem(comm.name, group.level_sizes)
        or caps.packed_window_problem(comm.name, window, causal)
        or packed_layout_problem(comm, strategy)
        or caps.head_problem(site.q_shape[1], site.k_shape[1], group.size, group.level_sizes)
    )


def plan_varlen_site(site: AttentionSite, config: CPConfig, group: CPGroup) -> VarlenPlan:
    """Validate a varlen `site` against CP with this config and return its plan (or raise CPCompileError)."""
    node = site.node
    if config.strategy not in THD_LAYOUTS:
        raise site_error(
            node,
            f"varlen_attn packs documents, but strategy={config.strategy!r} lays out one unpacked sequence",
            "use strategy='thd' (any document lengths), 'thd_zigzag' (documents of multiples of 2*cp) or "
            "'thd_balanced' (equal work a rank), and shard with cpcompile.shard_batch(..., cu_seqlens=cu_seqlens)",
        )
    if site.inference_args:
        raise site_error(
            node,
            f"it passes {', '.join(site.inference_args)}: KV-cache and paged inputs are inference-only",
            "call varlen_attn without KV-cache/paging inputs under CP",
        )
    if site.cu_seqlens_k is not None and site.cu_seqlens_k is not site.cu_seqlens_q:
        raise site_error(
            node,
            "cu_seq_q and cu_seq_k are different tensors; CP shards q, k and v of the same packed documents",
            "pass the same global cu_seqlens tensor as cu_seq_q and cu_seq_k (self-attention)",
        )
    cu = site.cu_seqlens_q
    cu_val = cu.meta.get("example_value", cu.meta.get("val")) if isinstance(cu, torch.fx.Node) else None
    if not isinstance(cu_val, torch.Tensor) or cu_val.dim() != 1 or cu_val.is_floating_point():
        raise site_error(
            node,
            "its cu_seqlens is not a 1-D integer tensor",
            "pass the global document offsets as a 1-D int32 tensor (an unsharded model input)",
        )
    causal, window, asked = _mask(site)
    gqa = bool(site.enable_gqa) if isinstance(site.enable_gqa, (bool, int)) else False
    for name, shape in (("query", site.q_shape), ("key", site.k_shape), ("value", site.v_shape)):
        if len(shape) != 3:
            raise site_error(
                node,
                f"its {name} has shape {shape}; varlen_attn under CP takes packed (tokens, heads, head_dim)",
                "call varlen_attn with 3-D packed tensors",
            )
        if not is_static(shape):
            raise site_error(
                node,
                f"its {name} has a dynamic shape {shape}; the packed length per rank must be static",
                "compile with dynamic=False and pack every batch to the same total length "
                "(cpcompile.pad_cu_seqlens adds a padding document)",
            )
    (tq, hq, d), (tk, hkv, dk), (tv, hv, _) = site.q_shape, site.k_shape, site.v_shape
    if tq == 0:
        raise site_error(
            node,
            "its query has 0 local packed tokens; the attention kernels cannot run on an empty buffer",
            "pack at least one token per rank (cpcompile.pad_to_multiple + pad_cu_seqlens)",
        )
    if dk != d:
        raise site_error(
            node,
            f"q head dim {d} and k head dim {dk} differ; attention scores need one q/k head dim",
            "give q and k the same head dim (v's may differ, as in MLA)",
        )
    if tq != tk or tk != tv:
        raise site_error(
            node,
            f"q has {tq} local tokens but k/v have {tk}/{tv}; CP shards q, k and v of the same packed tokens",
            "use CP only for self-attention over one packed buffer",
        )
    if hkv != hv or (hq != hkv and not (gqa and hq % hkv == 0)):
        raise site_error(
            node,
            f"q has {hq} heads, k {hkv} and v {hv}; heads must match, or with enable_gqa=True k/v heads must "
            "be equal and divide the q heads",
            "fix the head counts (pass enable_gqa=True for grouped-query attention)",
        )
    comms = site_comms(
        site, config.comm, lambda c: _comm_problem(site, config.strategy, get_comm(c), group, asked, causal)
    )
    layout = THD_LAYOUTS[config.strategy]
    if problem := layout.cu_problem(cu_val.shape[0], group.size):
        raise site_error(node, *problem)
    local_multiple = layout.required_multiple(group.size) // group.size
    if tq % local_multiple:
        raise site_error(
            node,
            f"layout {layout.name!r} needs every document length to be a multiple of 2*cp, so each rank holds "
            f"an even number of tokens, but this rank has {tq}",
            "pad every document to a multiple of 2*cp (cpcompile.pad_documents) before cpcompile.shard",
        )

    def usable(kernel: str) -> bool:
        return window == NO_WINDOW or get_varlen_kernel(kernel).supports_window

    kernels = site_kernels(site, config.kernel, d, True, usable)
    if not usable(kernels[0]):
        raise site_error(
            node,
            f"window_size={_window(site)} needs a varlen kernel with sliding windows, and {kernels[0]!r} has none",
            "use kernel='cpu_varlen_ref' (or a provider with supports_window) or drop the window",
        )
    if site.scale is not None and (isinstance(site.scale, torch.fx.Node) or not isinstance(site.scale, (int, float))):
        raise site_error(node, f"its `scale` is {site.scale!r}", "pass `scale` as a plain Python constant")
    scale = float(site.scale) if site.scale is not None else 1 / math.sqrt(d)
    bounds = site.max_seqlen or ()
    max_doc = max(bounds) if len(bounds) == 2 and all(type(b) is int and b > 0 for b in bounds) else None
    lse = _reads_lse(node)
    shape = site_shape(
        site,
        PACKED,
        causal,
        group.size,
        SEQ_DIM,
        window=window,
        max_doc=max_doc,
        return_lse=lse,
        levels=group.level_sizes,
    )
    # a plan layout's blocks come from each batch's plan: it is costed with the plan of the assumed documents
    comm, kernel, choice = resolve(shape, layout.name, comms, kernels)  # (costing.py), like every other layout
    return VarlenPlan(
        site=site,
        layout=layout.name,
        comm=comm,
        kernel=kernel,
        causal=causal,
        scale=scale,
        group=group,
        choice=choice,
        window=window,
        return_lse=lse,
        max_doc=max_doc,
    )
