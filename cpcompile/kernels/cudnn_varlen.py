"""CUDA varlen provider: cuDNN's packed (THD) attention, the graphs of cudnn-frontend's torch ops run by our own.

cudnn-frontend's `torch.ops.cudnn.sdpa_fwd` / `sdpa_bwd` (`cudnn.sdpa.fwd.torch_op`, nvidia-cudnn-frontend >= 1.32,
which needs apache-tvm-ffi: `pip install 'cpcompile[cudnn]'`) define the contract read here; the calls go to
kernels/cudnn_graph.py's ops, which build the same graphs once a key and skip the frontend op's per-call Python.
The graphs take packed (T, H, D) q/k/v with cu_seqlens, GQA,
d_qk != d_v (MLA) and strided K/V views. Measured on an H200 over a whole packed sequence at 1.66-1.78x aten's
FA2 varlen fwd+bwd with the top-left band, 0.95-1.07x with the bottom-right one (docs/benchmarks.md, "cuDNN
THD"). Optional: nothing imports
the package until a CUDA block asks `supports()`; without it `supports()` gives the reason (a CPCompileError when
named, flash_varlen under kernel="auto").

Where the op's rules differ from kernels/base.VarlenAttentionKernel, and what this module does about it:
- sequences: the graphs take each sequence's length and start offset, so each range is one sequence addressed
  where it lies (cudnn_graph.range_columns), gaps or not: no gap sequences, unlike FA2's cu_seqlens
  (`varlen_ranges`), half the grid of their adjacent encoding (measured 2-12% faster kernels on an H100,
  bench/results/logs/cudnn_split_probe_h100.txt, "direct").
- masks: bottom-right causal is `is_causal` + `causal_bottom_right`; cuDNN's left band bound counts the
  diagonal, so flash's window left w is cuDNN's w + 1; right bounds agree. A block whose ranges are all square
  (`square=True`: q length = k length wherever there are rows, e.g. whole documents) runs the band top-left
  instead: for a square range the two anchors give the same mask, and cuDNN 9.19's top-left kernel is 1.6-1.8x
  faster there (1.7-3.8x under a 4K window). A causal block without a window that holds cut pieces
  (rectangular ranges) runs as kernels/cudnn_split's two calls instead of one bottom-right call: every range's
  square top-left, the cut pieces' rectangles unmasked, each range addressed by its own ragged offsets, merged by
  log-sum-exp (`splits` says which blocks; a window's band stays one bottom-right call).
- LSE: forward returns it token-major (Tq, Hq, 1): a transposed view gives the executor's (Hq, Tq). Backward
  takes it PADDED (sequences, Hq, max_q, 1): `padded_at` scatters the final lse to its `lse_slots` (~8 kernels
  traced). It can read it back token-major and ragged instead (one transposing copy), which
  cudnn_graph.reads_ragged_stats switches off: NaN gradients on an H100 (cudnn_graph.RAGGED_STATS_ON).
- prepared metadata: each range's length and start columns (cudnn_graph.range_columns), the lse slots, a
  window's unseen keys and the split calls' columns and masks depend on the ranges alone;
  `prepare` computes them as device ops, which the regions run once per batch in their graph (Inductor), so a
  ring step's kernel call does only the kernel's own work on the host.
- graphs: cudnn_graph keeps one graph per key (sequence count, max lengths, strides, mask; backward also the
  packed totals rounded to 64). All are static per block (the ranges' length, the block's bounds), so new documents
  never build a graph (checked on the GPU by tests/gpu/test_cudnn_varlen.py).
- unseen keys: the contract wants dK/dV = 0 for keys of a range that no row sees. Without a left window every
  key of a range with rows is seen (bottom-right: the last row sees them all); with one, the leading keys of a
  range may be out of reach, and they are zeroed here rather than trusting cuDNN to write key tiles it skips.
- rows of no sequence and sequences without keys are left as the kernel leaves them, as FA2's are: the
  executor masks them unless the block vouches that there are none.
"""

from __future__ import annotations

import functools
import importlib

import torch

from . import cudnn_graph
from ._cuda import cuda_half_reason, head_dim_reason, missing_package
from .base import range_ids
from .cudnn_graph import ragged_metadata, range_columns
from .cudnn_split import SPLIT_COUNT, combine, merge, prepare_split

_OP_MODULE = "cudnn.sdpa.fwd.torch_op"
_EXTRA = "pip install 'cpcompile[cudnn]'"


@functools.cache
def _import_problem() -> str | None:
    """Why cudnn-frontend's torch ops cannot be used here (None: imported, ops registered). Cached: once."""
    absent = missing_package("cudnn", "nvidia-cudnn-frontend", _EXTRA)
    if absent:
        return absent
    try:
        importlib.import_module(_OP_MODULE)
    except Exception as e:  # an old frontend, a missing apache-tvm-ffi, a libcudnn it cannot load
        return f"{_OP_MODULE} did not import ({type(e).__name__}: {e}); it needs nvidia-cudnn-frontend>=1.32 ({_EXTRA})"
    return None


def _ops():
    """The ops a call runs (kernels/cudnn_graph: our graphs, metadata made in the region's graph); tests substitute
    a CPU stand-in of their contract."""
    return cudnn_graph.ops()


def band(causal: bool, window: tuple[int, int], square: bool = False) -> dict:
    """The op's mask keywords for the interface's (causal, window): bottom-right per sequence, flash's window
    left w as cuDNN's left bound w + 1 (cuDNN counts the diagonal), right bounds as they are. `square`: every
    range with rows has q length = k length, where the top-left anchor is the same mask (and faster)."""
    left, right = window
    right = 0 if causal else right
    kw: dict = {"is_causal": True} if right == 0 else ({"window_right": right} if right > 0 else {})
    if left >= 0:
        kw["window_left"] = left + 1
    if kw and not square:  # a band on rectangular ranges: anchor its diagonal at each bottom-right corner
        kw["causal_bottom_right"] = True
    return kw


def band_args(causal: bool, window: tuple[int, int], square: bool) -> tuple[bool, bool, int, int]:
    """`band`'s keywords as the graph ops take them: (is_causal, bottom_right, window_left, window_right)."""
    kw = band(causal, window, square)
    return (kw.get("is_causal", False), kw.get("causal_bottom_right", False), kw.get("window_left", -1),
            kw.get("window_right", -1))  # fmt: skip


def lse_slots(ranges: torch.Tensor, tq: int, sequences: int, max_q: int, tiled: bool) -> list[torch.Tensor]:
    """[slot, position], each (Tq,) int64: where `padded_lse` puts each row of the (Hq, Tq) lse. Row t of range i
    goes to [i (tiled) or 2i (adjacent: gaps are odd sequences), t - start]; rows outside every range to the
    spare slot `sequences`. Depends on the ranges only: computed once per block (in the graph)."""
    qs, qe = ranges[0], ranges[1]
    rid = range_ids(qs, qe, tq)
    seq = torch.where(rid >= 0, rid * (1 if tiled else 2), sequences)  # rows outside every range: a spare slot
    pos = (torch.arange(tq, device=ranges.device) - qs[rid.clamp(min=0)]).clamp(0, max_q - 1)
    return [seq, pos]


def padded_at(lse: torch.Tensor, slots: list[torch.Tensor], sequences: int, max_q: int) -> torch.Tensor:
    """The (Hq, Tq) lse scattered to its `lse_slots`: (sequences, Hq, max_q, 1) fp32, only rows in ranges written
    (rows past a sequence's length, and gap sequences, are never read for the ranges' results); no host sync."""
    padded = lse.new_empty((sequences + 1, lse.shape[0], max_q), dtype=torch.float32)
    padded[slots[0], :, slots[1]] = lse.t().float()
    return padded[:sequences].unsqueeze(-1)  # a contiguous prefix: the op takes it without a copy


def padded_lse(lse: torch.Tensor, ranges: torch.Tensor, sequences: int, max_q: int, tiled: bool) -> torch.Tensor:
    """The (Hq, Tq) lse as the backward wants it: (sequences, Hq, max_q, 1) fp32 (`lse_slots`, `padded_at`)."""
    return padded_at(lse, lse_slots(ranges, lse.shape[1], sequences, max_q, tiled), sequences, max_q)


def unseen_keys(ranges: torch.Tensor, tk: int, left: int) -> torch.Tensor:
    """(Tk,) bool: keys of a range that no row of it sees under a left window `left` (bottom-right diagonal).

    Row t of a range sees keys from t + (k_len - q_len) - left on, so keys before k_len - q_len - left are
    unseen (all of them when the range has no rows); right of the diagonal the last row reaches the end."""
    qs, qe, ks, ke = ranges
    qn, kn = qe - qs, ke - ks
    cut = torch.where(qn > 0, (kn - qn - left).clamp(min=0).minimum(kn), kn)
    return range_ids(ks, ks + cut, tk) >= 0


def token_major(t: torch.Tensor) -> bool:
    """A (T, H, D) k or v view the backward reads in place: dense dims, each token's heads side by side (a fused
    projection's or a K/V buffer's views, the a2a region's token-major exchange), more than one token. Head-major
    views and the rest are copied, and q always is (a strided q gave wrong dq on an H100)."""
    (s_t, s_h, s_d), (_, h, d) = t.stride(), t.shape
    return t.shape[0] > 1 and s_d == 1 and s_h >= d and s_t >= h * s_h


class CuDNNVarlenKernel:
    name = "cudnn_varlen"
    traceable = True
    """The executor records its calls into the region's graph (executor/varlen.py)."""
    supports_window = True
    """Any (left, right) window on the bottom-right diagonal: cuDNN's diagonal band (see `band`)."""

    def supports(self, device: torch.device, dtype: torch.dtype) -> str | None:
        return cuda_half_reason(device, dtype, "cuDNN THD attention") or _import_problem()

    def supports_head_dim(self, head_dim: int, v_head_dim: int | None = None) -> str | None:
        return head_dim_reason(head_dim, "cuDNN THD attention", v_head_dim, distinct_v=True)

    def grad_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return dtype  # the op writes dq/dk/dv in the io dtype (its graph accumulates in fp32, rounds once)

    def prepared_count(self, window: tuple[int, int] = (-1, -1), tiled: bool = False, square: bool = False) -> int:
        """How many tensors `prepare` returns for a block with these keywords (static)."""
        return (7 if window[0] >= 0 else 6) + (SPLIT_COUNT if splits(window, square) else 0)

    def prepare(self, ranges, tq, tk, max_q, window=(-1, -1), tiled=False, square=False) -> list[torch.Tensor]:
        """Each range's length and start columns (cudnn_graph.range_columns: range i is sequence i, no gap
        sequences, tiled or not), the backward's `lse_slots`, with a left window the keys no row sees, and where a
        causal block may split (`splits`) the split calls' metadata (cudnn_split.prepare_split): device ops on the
        ranges alone, so a region computes them once per batch, in its graph (a block that does not split leaves
        them unused: dead code there)."""
        bound = max(max_q, 1)
        prepared = [*range_columns(ranges), *lse_slots(ranges, tq, ranges.shape[1], bound, True)]
        if window[0] >= 0:
            prepared.append(unseen_keys(ranges, tk, window[0])[:, None, None])  # broadcast over heads, dims
        if splits(window, square):
            n = ranges.shape[1]
            prepared += prepare_split(ranges, tq, tk, lambda sq: lse_slots(sq, tq, n, bound, True))
        return prepared

    def forward(
        self, q, k, v, ranges, max_q, max_k, causal, scale, window=(-1, -1), tiled=False, square=False, prepared=None
    ):
        prepared = prepared or self.prepare(ranges, q.shape[0], k.shape[0], max_q, window, tiled, square)
        bounds = (max(max_q, 1), max(max_k, 1))
        if causal and splits(window, square, q.shape[0]):  # squares top-left, the cut pieces' rectangles unmasked
            extra = prepared[-SPLIT_COUNT:]
            sq = _fwd_call(q, k, v, extra[:4], scale, (bounds[0], max(min(max_q, max_k), 1)), (True, False, -1, -1))
            rc = _fwd_call(q, k, v, extra[4:8], scale, bounds, (False, False, -1, -1))
            return merge(*sq, *rc, extra[10], extra[12])
        return _fwd_call(q, k, v, prepared[:4], scale, bounds, band_args(causal, window, square))

    def backward(
        self, dout, q, k, v, out, lse, ranges, max_q, max_k, causal, scale, window=(-1, -1), tiled=False,
        square=False, prepared=None,
    ):  # fmt: skip
        # dO and O share one offsets column: both packed. k and v are read where they lie (a fused projection's
        # views, all_gather's key buffer), each with offsets of its own token stride, as the forward reads them.
        dout, out = [t if t.is_contiguous() else t.contiguous() for t in (dout, out)]
        # q is copied: read in place as a strided view, the H100's backward gave wrong dq (up to 4.9 off, every case
        # of bench/probes/cudnn_view_bwd.py) while k and v views gave bit-equal gradients (padded stats: 12 of 12)
        q = q if q.is_contiguous() else q.contiguous()
        k, v = [t if token_major(t) else t.contiguous() for t in (k, v)]  # lists: Dynamo 2.14 traces them
        prepared = prepared or self.prepare(ranges, q.shape[0], k.shape[0], max_q, window, tiled, square)
        bounds = (max(max_q, 1), max(max_k, 1))
        ragged = cudnn_graph.reads_ragged_stats(q.device)
        if causal and splits(window, square, q.shape[0]):
            extra = prepared[-SPLIT_COUNT:]
            stats = _stats(lse, ragged, extra[8:10], extra[0].shape[0], bounds[0])
            args = (dout, q, k, v, out, stats, ragged, scale)
            g1 = _bwd_call(*args, extra[:4], (bounds[0], max(min(max_q, max_k), 1)), (True, False, -1, -1))
            g2 = _bwd_call(*args, extra[4:8], bounds, (False, False, -1, -1))
            return combine(g1, g2, extra[10], extra[11], extra[12])
        stats = _stats(lse, ragged, prepared[4:6], prepared[0].shape[0], bounds[0])
        mask = band_args(causal, window, square)
        dq, dk, dv = _bwd_call(dout, q, k, v, out, stats, ragged, scale, prepared[:4], bounds, mask)
        if window[0] >= 0:  # leading keys of a range may be out of every row's reach: make them exact zeros
            unseen = prepared[6]
            dk, dv = dk.masked_fill(unseen, 0), dv.masked_fill(unseen, 0)
        return dq, dk, dv


SPLIT_MIN_ROWS = 8192
"""The fewest q rows a block splits at. Measured on an H100 (bench/results/logs/cudnn_split_probe_h100.txt, kernels
alone, slowest rank): at 16K rows the split ran in 0.85x (thd_balanced) and 0.68x (thd) of the one call's GPU time
with direct offsets, at 4K rows in 1.06x (the second call's fixed cost); the crossover lies between."""


def splits(window: tuple[int, int], square: bool, rows: int | None = None) -> bool:
    """Whether a causal block with these keywords runs as cudnn_split's two calls: without a window (a band's
    rectangles would need their own bounds), unless every range is square (one top-left call is then the same
    mask), and with at least SPLIT_MIN_ROWS q rows (`rows`; None: whether it may, for `prepare`)."""
    return tuple(window) == (-1, -1) and not square and (rows is None or rows >= SPLIT_MIN_ROWS)


def _fwd_call(q, k, v, columns, scale, bounds, mask) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward graph call on the sequences of `columns`: (out, lse (Hq, Tq), a view of the token-major stats)."""
    hq, dv = q.shape[1], v.shape[2]
    tokens = [q.stride(0), k.stride(0), v.stride(0)]  # the real layouts: q and k/v may be views
    meta = ragged_metadata(columns, (tokens[0], hq * dv, hq), tokens[1:])
    out, stats = _ops().cudnn_thd_fwd(q, k, v, meta, tokens, scale, *bounds, *mask)
    return out, stats.squeeze(-1).t()  # (Tq, Hq, 1) token-major -> (Hq, Tq), a view


def _stats(lse, ragged: bool, slots, sequences: int, max_q: int) -> torch.Tensor:
    """The final (Hq, Tq) lse as the backward reads it: ragged token-major (Tq, Hq, 1) (one transposing copy), or
    padded at its slots where the GPU's THD backward takes no ragged stats (cudnn_graph.reads_ragged_stats)."""
    return lse.t().float().contiguous().unsqueeze(-1) if ragged else padded_at(lse, slots, sequences, max_q)


def _bwd_call(dout, q, k, v, out, stats, ragged, scale, columns, bounds, mask):
    """One backward graph call on the sequences of `columns`: (dq, dk, dv)."""
    (hq, d), (hk, hv, dv) = q.shape[1:], (k.shape[1], v.shape[1], v.shape[2])
    # q, o, dq (, stats) | k, v, dk, dv: o, dq, dk, dv packed (shapes: stride(0) is arbitrary at one token)
    q_side: tuple[int, ...] = (q.stride(0), hq * dv, hq * d) + ((hq,) if ragged else ())
    meta = ragged_metadata(columns, q_side, (k.stride(0), v.stride(0), hk * d, hv * dv))
    tokens = [q.stride(0), hq * dv, k.stride(0), v.stride(0)]  # q, o, k, v as the offsets were made for them
    deterministic = torch.are_deterministic_algorithms_enabled()
    return _ops().cudnn_thd_bwd(dout, q, k, v, out, stats, meta, tokens, scale, *bounds, *mask, deterministic)
