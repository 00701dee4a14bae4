"""Plan varlen_attn sites (packed documents): validate them against the THD layouts and build a VarlenPlan."""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch
import torch.fx

from ..errors import CPCompileError, node_origin, site_error
from ..groups import CPGroup
from ..head_split import head_split_problem
from ..kernels import get_varlen_kernel, resolve_kernel
from ..layouts.thd import THD_LAYOUTS
from ..regions import VARLEN_REGIONS
from .match import AttentionSite
from .plan import CPConfig, CPPlan, _is_static

CAUSAL_WINDOW, FULL_WINDOW = (-1, 0), (-1, -1)


@dataclass(frozen=True)
class VarlenPlan(CPPlan):
    """A CPPlan for a varlen site: cu_seqlens is a region input, plus the window and whether lse is read."""

    window: tuple[int, int] = (-1, -1)
    """Sliding-window limits on top of `causal` ((-1, -1): none; under all_gather only causal (left, 0))."""
    return_lse: bool = True
    """Whether the graph reads the lse output (a2a sends it back only then)."""
    max_doc: int | None = None
    """The call's max_q/max_k (static ints), a bound on every document's length: it bounds the kernels' grids."""

    def region_target(self):
        return VARLEN_REGIONS[self.comm]

    def region_args(self) -> tuple:
        return (*super().region_args(), self.site.cu_seqlens_q)

    def region_kwargs(self) -> dict:
        extra = dict(max_doc=self.max_doc, window=self.window)
        if self.comm == "a2a":
            extra["return_lse"] = self.return_lse
        return {**super().region_kwargs(), **extra}


def _window(site: AttentionSite) -> tuple | None:
    window = site.window
    if isinstance(window, torch.fx.Node) or (window is not None and not isinstance(window, (list, tuple))):
        return None
    window = tuple(FULL_WINDOW if window is None else window)
    return window if all(isinstance(w, int) for w in window) else None


def _mask(site: AttentionSite, comm: str) -> tuple[bool, tuple[int, int]]:
    """(causal, extra window) from window_size / is_causal: (-1, 0) causal, (-1, -1) full, (w, 0) sliding causal
    (a rank's q pieces end their key ranges under all_gather, so the bottom-right window is right); under a2a
    any flash-attn window (left, right), which after the exchange is a cp=1 mask."""
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
    if not causal and window != FULL_WINDOW and comm != "a2a":
        raise site_error(
            node,
            f"window_size={window}: a sliding window that reaches right of the diagonal is not supported by the "
            "all-gather THD region (causal (-1, 0), sliding causal (w, 0) and full (-1, -1) are)",
            "use comm='a2a' (strategy='thd') for two-sided windows, or a causal window (w, 0)",
        )
    left, right = window
    return causal, (left, -1 if causal else right)


def _reads_lse(node: torch.fx.Node) -> bool:
    """Whether anything but `out` (getitem 0) or the unused rng state is read from the varlen node."""
    return any(not (u.target is operator.getitem and u.args[1] in (0, 2)) for u in node.users)


def _a2a_problem(site: AttentionSite, strategy: str, cp: int) -> tuple[str, str] | None:
    """Layout and head rules of comm='a2a' for packed documents: (rule broken, fix) or None."""
    if strategy != "thd":
        return (
            f"comm='a2a' runs the whole sequence on every rank (for H/cp of the heads), so causal work is "
            f"balanced with the contiguous layout already; strategy={strategy!r} (per-document zigzag) would "
            "only add a reorder of q/k/v and the output after each exchange",
            "use strategy='thd' with comm='a2a' (shard with cpcompile.shard(..., strategy='thd', cu_seqlens=...))",
        )
    return head_split_problem(site.q_shape[1], site.k_shape[1], cp)


def plan_varlen_site(site: AttentionSite, config: CPConfig, group: CPGroup) -> VarlenPlan:
    """Validate a varlen `site` against CP with this config and return its plan (or raise CPCompileError)."""
    node = site.node
    if config.strategy not in THD_LAYOUTS:
        raise site_error(
            node,
            f"varlen_attn packs documents, but strategy={config.strategy!r} lays out one unpacked sequence",
            "use strategy='thd' (any document lengths) or 'thd_zigzag' (documents of multiples of 2*cp), "
            "and shard with cpcompile.shard(..., cu_seqlens=cu_seqlens)",
        )
    if config.comm not in VARLEN_REGIONS:
        raise site_error(
            node,
            f"comm={config.comm!r} has no varlen region yet",
            f"use comm in {sorted(VARLEN_REGIONS)} for varlen_attn",
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
    causal, window = _mask(site, config.comm)
    gqa = bool(site.enable_gqa) if isinstance(site.enable_gqa, (bool, int)) else False
    for name, shape in (("query", site.q_shape), ("key", site.k_shape), ("value", site.v_shape)):
        if len(shape) != 3:
            raise site_error(
                node,
                f"its {name} has shape {shape}; varlen_attn under CP takes packed (tokens, heads, head_dim)",
                "call varlen_attn with 3-D packed tensors",
            )
        if not _is_static(shape):
            raise site_error(
                node,
                f"its {name} has a dynamic shape {shape}; the packed length per rank must be static",
                "compile with dynamic=False and pack every batch to the same total length "
                "(cpcompile.pad_cu_seqlens adds a padding document)",
            )
    (tq, hq, d), (tk, hkv, dk), (tv, hv, dv) = site.q_shape, site.k_shape, site.v_shape
    if dk != d or dv != d:
        raise site_error(
            node,
            f"q head dim {d}, k head dim {dk} and v head dim {dv} differ; the CP region gathers K and V in one "
            "buffer and its kernels take one head dim",
            "use the same head dim for q, k and v (pad v's head dim and slice the output)",
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
    if config.comm == "a2a" and (problem := _a2a_problem(site, config.strategy, group.size)):
        raise site_error(node, *problem)
    layout = THD_LAYOUTS[config.strategy]
    local_multiple = layout.required_multiple(group.size) // group.size
    if tq % local_multiple:
        raise site_error(
            node,
            f"layout {layout.name!r} needs every document length to be a multiple of 2*cp, so each rank holds "
            f"an even number of tokens, but this rank has {tq}",
            "pad every document to a multiple of 2*cp (cpcompile.pad_documents) before cpcompile.shard",
        )
    try:
        kernel = resolve_kernel(config.kernel, site.device, site.dtype, d, varlen=True)
    except CPCompileError as e:
        raise CPCompileError(f"cpcompile cannot rewrite {node_origin(node)}: {e}") from None
    if window != (-1, -1) and not getattr(get_varlen_kernel(kernel), "supports_window", False):
        raise site_error(
            node,
            f"window_size={_window(site)} needs a varlen kernel with sliding windows, and {kernel!r} has none",
            "use kernel='cpu_varlen_ref' (or a provider with supports_window) or drop the window",
        )
    if site.scale is not None and (isinstance(site.scale, torch.fx.Node) or not isinstance(site.scale, (int, float))):
        raise site_error(node, f"its `scale` is {site.scale!r}", "pass `scale` as a plain Python constant")
    scale = float(site.scale) if site.scale is not None else 1 / math.sqrt(d)
    bounds = site.max_seqlen or ()
    max_doc = max(bounds) if len(bounds) == 2 and all(type(b) is int and b > 0 for b in bounds) else None
    return VarlenPlan(
        site=site,
        layout=layout.name,
        comm=config.comm,
        kernel=kernel,
        causal=causal,
        scale=scale,
        group=group,
        window=window,
        return_lse=_reads_lse(node),
        max_doc=max_doc,
    )
