"""The one interface every attention kernel provider implements.

A provider runs one block: q (B, Hq, Sq, D) against k (B, Hkv, Sk, D), v (B, Hkv, Sk, Dv), either a causal square
(Sq == Sk, top-left aligned) or unmasked. It returns the output and the log-sum-exp of the scaled scores
(B, Hq, Sq) in at least fp32, and its backward takes the FINAL merged output and LSE (ring-attention identity).

Two optional features, each a keyword passed only when a block uses it (the planner refuses sites that need a
feature from a provider without it): `window=(left, right)` (`supports_window`): key j is visible to row i iff
-left <= j - i - (Sk - Sq) <= right, -1 unbounded (flash-attn's window_size, bottom-right; causal is then False;
every row of a windowed block sees at least one key, layouts/window.py); `softcap=c` (`supports_softcap`): the
scores become c * tanh(score / c) before the softmax (Gemma 2), and the LSE is of those.
"""

from __future__ import annotations

from typing import Protocol

import torch


class AttentionKernel(Protocol):
    """A dense provider. `traceable` (optional, default False): forward and backward are torch ops that a trace
    can record (aten kernels on views, torch math), so the executor's calls become graph nodes that Inductor
    launches itself; without it they run inside the opaque executor ops, in Python at run time."""

    name: str
    supports_window: bool
    supports_softcap: bool

    def supports(self, device: torch.device, dtype: torch.dtype) -> str | None:
        """None when this provider can run on `device`/`dtype`, else the reason it cannot."""

    def supports_head_dim(self, head_dim: int, v_head_dim: int | None = None) -> str | None:
        """None when this provider takes q/k of `head_dim` and v of `v_head_dim` (None: the same), else why not."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(out, lse) for one block."""

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        causal: bool,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(dq, dk, dv) for one block, given the final out and lse of its q rows."""


class VarlenAttentionKernel(Protocol):
    """One varlen block: packed q (Tq, Hq, D) against packed k (Tk, Hkv, D), v (Tk, Hkv, Dv), tokens on dim 0.

    Which q rows see which keys is given by `ranges`, an int64 tensor (4, B) on the q device whose columns are
    sequences i: q rows [ranges[0, i], ranges[1, i]) attend keys [ranges[2, i], ranges[3, i]). Ranges are
    non-overlapping and in increasing order on each side, may be empty (q or k side), and need not be adjacent
    (gaps are rows/keys of no sequence). `max_q`/`max_k` are static upper bounds of any range's length (for
    grid sizing; never read the ranges on the host). k/v may be strided views (e.g. of an all-gather buffer).

    causal: within each sequence, key j is visible to q row t iff (j - k_start) <= (t - q_start) + (k_len -
    q_len), i.e. BOTTOM-RIGHT aligned (flash-attn's convention): the all-gather THD layouts issue causal
    sequences whose q rows are the LAST q_len tokens of their key range (q_len <= k_len), so a provider must
    implement bottom-right alignment. Non-causal: no mask inside a sequence.

    window (left, right), a keyword passed only when the block has one (providers that set
    `supports_window = True`; the planner refuses windows for the others): on top of the above, key j is
    visible to q row t iff -left <= (j - k_start) - (t - q_start) - (k_len - q_len) <= right, each side
    unbounded when -1 (flash-attn's window_size on the same bottom-right diagonal).

    tiled=True (a keyword, passed only then) promises that the ranges tile both buffers: each range starts where
    the previous one ends, the first at 0, the last ending at Tq / Tk (so no gaps to encode).

    square=True (a keyword, passed only then) promises that every range with q rows has as many keys as rows
    (whole documents, the diagonal pieces of chunked layouts): bottom-right and top-left anchors are then the
    same mask, and a provider may use whichever of its kernels is faster.

    Returns out (Tq, Hq, Dv) in q's dtype or wider and lse (Hq, Tq) (the log-sum-exp of the scaled scores,
    flash varlen's layout) in fp32 (fp64 for fp64 inputs). Every row of a sequence that sees a key must be
    written; rows in no sequence, or that see no key, may hold anything (even NaN/inf): the executor masks
    them unless the block vouches that there are none (`covers_rows`). GQA: Hkv divides Hq, q head h uses kv
    head h // (Hq // Hkv).

    prepare(ranges, tq, tk, max_q, window, tiled, square) returns the tensors the provider derives from the
    ranges alone (cu_seqlens, index maps; `prepared_count` of them for the same keywords, a static number): device
    ops with static shapes and no host sync, which the regions run once per batch in their graph and hand to every call
    of the block as `prepared=` (forward and backward). Without it a call prepares them itself.

    backward gets the FINAL merged out and lse of every q row (ring-attention identity) and returns (dq, dk,
    dv) shaped like q, k, v, in `grad_dtype` (the executor sums several blocks in fp32). Every key in the key
    range of a sequence WITH q rows gets a written gradient, 0 where no row sees it (window, causal); keys of a
    sequence without q rows, and rows/keys outside every range, may hold anything: the executor masks them
    unless the block vouches that there are none (`covers_keys`: every key lies in a range with q rows).
    """

    name: str
    supports_window: bool
    traceable: bool
    """Forward, backward and prepare are ops a trace can record (with fake kernels, no host reads of the
    ranges): the executor's calls become graph nodes (executor/varlen.py); optional, default False."""

    def supports(self, device: torch.device, dtype: torch.dtype) -> str | None:
        """None when this provider can run on `device`/`dtype`, else the reason it cannot."""

    def supports_head_dim(self, head_dim: int, v_head_dim: int | None = None) -> str | None:
        """None when this provider takes q/k of `head_dim` and v of `v_head_dim` (None: the same), else why not."""

    def grad_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype backward returns dq/dk/dv in for inputs of `dtype` (static: graphs are traced with it)."""

    def prepared_count(self, window: tuple[int, int] = (-1, -1), tiled: bool = False, square: bool = False) -> int:
        """How many tensors `prepare` returns for a block with these keywords (static)."""

    def prepare(
        self,
        ranges: torch.Tensor,
        tq: int,
        tk: int,
        max_q: int,
        window: tuple[int, int] = (-1, -1),
        tiled: bool = False,
        square: bool = False,
    ) -> list[torch.Tensor]:
        """The block's metadata for `prepared=`, from its ranges alone (device ops, no sync)."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        ranges: torch.Tensor,
        max_q: int,
        max_k: int,
        causal: bool,
        scale: float,
        window: tuple[int, int] = (-1, -1),
        tiled: bool = False,
        square: bool = False,
        prepared: list[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(out, lse) for one varlen block."""

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        ranges: torch.Tensor,
        max_q: int,
        max_k: int,
        causal: bool,
        scale: float,
        window: tuple[int, int] = (-1, -1),
        tiled: bool = False,
        square: bool = False,
        prepared: list[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(dq, dk, dv) for one varlen block, given the final out and lse of its q rows."""


def range_ids(starts: torch.Tensor, ends: torch.Tensor, length: int) -> torch.Tensor:
    """For each of `length` rows, the index of the (non-empty) range containing it, or -1 (on device, no sync).

    Ranges must be non-overlapping; +(i+1) at each start and -(i+1) at each end, summed, is i+1 inside range i.
    """
    ids = torch.arange(1, starts.numel() + 1, device=starts.device, dtype=torch.int64)
    delta = torch.zeros(length + 1, device=starts.device, dtype=torch.int64)
    delta = delta.scatter_add(0, starts.long(), ids).scatter_add(0, ends.long(), -ids)
    return delta.cumsum(0)[:length] - 1


def any_head_dim(head_dim: int, v_head_dim: int | None = None) -> str | None:
    """supports_head_dim of a provider that takes every head dim (the CPU kernels)."""
    return None


def cpu_support_problem(device: torch.device, dtype: torch.dtype) -> str | None:
    """The device/dtype rule shared by the CPU providers: None when they can run, else why not."""
    if device.type != "cpu":
        return f"it runs on CPU tensors only, these are on {device}"
    if dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        return f"it takes floating-point q/k/v, not {dtype}"
    return None
