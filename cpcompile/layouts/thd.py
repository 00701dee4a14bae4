"""Packed-document (THD) layouts: which packed tokens a rank owns and its varlen blocks (pure index math).

A packed buffer of T tokens holds documents given by the GLOBAL cu_seqlens (N+1 offsets, cu[0] = 0, cu[N] = T).
Documents change every batch, so everything that depends on them is computed with torch ops on the device
that holds cu_seqlens, with static shapes and no host synchronisation: the region traces these functions into
the graph. Only the rules about document lengths (`document_error`) read cu_seqlens on the host, in the
user-side sharding helpers.

- thd: rank r owns the contiguous tokens [r*L, (r+1)*L), L = T / cp. Documents of any length.
- thd_zigzag: every document is cut into 2*cp chunks and rank r owns chunks r and 2*cp-1-r of each, in
  document order (the TE/Megatron layout); every document length must be a multiple of 2*cp.
- thd_balanced (thd_balanced.py): equal tokens and equal causal work a rank, from a plan chosen per batch on
  the host that rides in cu_seqlens (`carries_plan`).

Under the all-gather region a rank's whole attention is ONE varlen block (no merge): each local q piece of a
document attends the document's keys up to its own last token, bottom-right causal, in a key buffer where
those keys are contiguous. For thd that buffer is the all-gather buffer itself (rank-major = global order);
for thd_zigzag it is a copy (`key_buffer`) holding, per document, the keys of its front chunk then those of
its back chunk (chunks 0..r and 0..2cp-1-r, in global order): (2cp+1)/(2cp) of T tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .block import NO_WINDOW
from .search import sorted_search


@dataclass(frozen=True)
class VarlenBlock:
    """One varlen kernel call: `ranges` (4, B) int64 = q rows [0]..[1] of the local q attend keys [2]..[3] of
    the source buffer, per sequence (see kernels.base.VarlenAttentionKernel). `max_q`/`max_k` bound the lengths
    of the q and k ranges statically; `causal` is bottom-right causal per sequence (a q range is the last
    tokens of its key range); `window` (left, right) further limits key j of q row t to t-left <= j <= t+right
    (-1: unbounded). `covers_rows`: every q row lies in a range and sees at least one key; `covers_keys`: every
    key of the source lies in a range that has q rows. What a layout vouches for here the executor does not
    mask (checked by tests/unit/test_thd_layouts.py for every layout). A source may end in an unused tail past the
    last range's end (thd_balanced's key buffer has a static size for every batch): no kernel sequence reaches
    it, so its gradient is left as the kernel leaves it, and `covers_keys` speaks for the keys before it; the
    caller must not read the tail's gradient (the region's fold reads only the positions it copied).
    `square`: every range with q rows has as many keys as rows (whole documents, diagonal pieces), for every
    batch: the causal/window diagonal is then the top-left one too (cuDNN runs that anchor faster; checked with
    covers_* by tests/unit/test_thd_layouts.py, and a wrong claim changes results on the cuDNN stand-in)."""

    source: int
    causal: bool
    ranges: torch.Tensor
    max_q: int
    max_k: int
    window: tuple[int, int] = NO_WINDOW
    covers_rows: bool = False
    covers_keys: bool = False
    square: bool = False


def qk_ranges(q0, q1, k0, k1) -> torch.Tensor:
    """A varlen block's RANGES tensor (4, B): per sequence its q rows [q0, q1) and keys [k0, k1), int64."""
    return torch.stack((q0, q1, k0, k1)).long()


def interleave(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a[0], b[0], a[1], b[1], ...: two pieces per document, in order (thd_zigzag's front and back)."""
    return torch.stack((a, b), 1).flatten()


def offsets_ok(cu: torch.Tensor, total: int, doc_multiple: int, max_doc: int | None) -> torch.Tensor:
    """0-dim bool, on device: offsets start at 0, never decrease, end at `total`, no document is longer than
    `max_doc` (when given) and every length is a multiple of `doc_multiple` (when > 1)."""
    cu = cu.long()
    lengths = cu[1:] - cu[:-1]
    ok = (cu[0] == 0) & (cu[-1] == total) & (lengths >= 0).all()
    if max_doc is not None:
        ok &= (lengths <= max_doc).all()
    if doc_multiple > 1:
        ok &= (lengths % doc_multiple == 0).all()
    return ok


class PackedLayout:
    """Base of the THD layouts; subclasses define the total-length rule, sharding, key buffer and blocks."""

    name: str = ""
    doc_multiple_per_cp: int = 0
    """Every document length must be a multiple of this times cp (0: any length)."""
    carries_plan: bool = False
    """Whether the model's cu_seqlens is a per-batch plan (offsets and more) rather than the plain offsets."""

    def cu_problem(self, length: object, cp: int) -> tuple[str, str] | None:
        """(rule, fix) when a cu_seqlens of `length` entries (an int, or symbolic) cannot be this layout's."""
        return None

    def offsets(self, cu_seqlens: torch.Tensor, cp: int) -> torch.Tensor:
        """The GLOBAL document offsets in what the model was given (on device, static slicing)."""
        return cu_seqlens

    def is_plan(self, cu_seqlens: torch.Tensor) -> bool:
        """Host: whether `cu_seqlens` is already this layout's plan (never, for layouts without one)."""
        return False

    def prepare(self, cu_seqlens: torch.Tensor, total: int, cp: int) -> torch.Tensor:
        """Host: what the model and the index math take, from checked plain offsets or a plan (checked here)."""
        return cu_seqlens

    def metadata_ok(self, cu_seqlens: torch.Tensor, total: int, cp: int, max_doc: int | None) -> torch.Tensor:
        """0-dim bool, on device, no sync: whether the model's cu_seqlens is valid for this layout."""
        return offsets_ok(cu_seqlens, total, self.doc_multiple_per_cp * cp, max_doc)

    def bad_metadata_message(self, total: int, max_doc: int | None, cp: int) -> str:
        """The run-time check's assert message for layouts with a plan (under 255 characters)."""
        return f"cpcompile: bad cu_seqlens for {self.name} (T={total}, cp={cp})"

    def required_multiple(self, cp: int) -> int:
        """The packed total T must be a multiple of this."""
        return cp * max(self.doc_multiple_per_cp, 1)

    def document_error(self, cu_seqlens: list[int], total: int, cp: int) -> str | None:
        """Host-side check of cu_seqlens against this layout for a packed total `total`: None or the reason."""
        cu = list(cu_seqlens)
        if len(cu) < 2 or cu[0] != 0 or cu[-1] != total or any(b < a for a, b in zip(cu, cu[1:])):
            return (
                f"cu_seqlens must start at 0, never decrease and end at the packed length {total}; got "
                f"{cu[:8]}{'...' if len(cu) > 8 else ''} (last {cu[-1] if cu else None})"
            )
        if total % self.required_multiple(cp):
            return (
                f"layout {self.name!r} with cp={cp} needs the packed length to be a multiple of "
                f"{self.required_multiple(cp)}, got {total}"
            )
        need = self.doc_multiple_per_cp * cp
        if need:
            bad = [(i, b - a) for i, (a, b) in enumerate(zip(cu, cu[1:])) if (b - a) % need]
            if bad:
                i, n = bad[0]
                return (
                    f"layout {self.name!r} cuts every document into {need} equal chunks, but document {i} has "
                    f"{n} tokens ({len(bad)} document(s) are not multiples of {need})"
                )
        return None

    def shard_index(self, cu_seqlens: torch.Tensor, total: int, cp: int, rank: int) -> torch.Tensor:
        """Global positions (int64, on cu_seqlens' device) of rank `rank`'s local tokens, in local order."""
        raise NotImplementedError

    def key_buffer(
        self, cu_seqlens: torch.Tensor, local_len: int, cp: int, rank: int, causal: bool
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The key buffer the blocks read, when it is not the all-gather buffer itself (None: it is).

        (index, fold), int64: `index` (static length) = positions in the rank-major all-gather buffer
        (cp * local_len tokens) of the key buffer's tokens; `fold`, its inverse for the backward, (copies,
        cp * local_len): entry [c, p] = the key-buffer position of the c-th copy of gathered token p, or -1
        (fewer copies, or not read). A gather, not a scatter-add: no atomics, deterministic."""
        return None

    def key_window(
        self, local_len: int, cp: int, rank: int, causal: bool, max_doc: int | None, window: tuple[int, int]
    ) -> tuple[int, int] | None:
        """The static positions [start, stop) of the all-gather buffer that rank `rank`'s blocks can read, when
        the bounds make it narrower (None: all of it). Only a layout whose blocks read that buffer itself (no
        `key_buffer`) may give one.
        The region then hands the kernel only that slice (`narrow_keys`), and its gradient is padded back."""
        return None

    def kernel_blocks(
        self,
        cu_seqlens: torch.Tensor,
        local_len: int,
        cp: int,
        rank: int,
        causal: bool,
        max_doc: int | None = None,
        window: tuple[int, int] = NO_WINDOW,
    ) -> tuple[list[VarlenBlock], tuple[int, int] | None]:
        """Rank `rank`'s blocks as the all-gather region hands them to the kernel, and the slice [start, stop) of
        the all-gather buffer they read (`key_window`; None: the whole key buffer). One place for the region,
        the benchmarks and the coverage test, so those time and check the region's own blocks."""
        blocks = self.blocks(cu_seqlens, local_len, cp, rank, causal, max_doc, window)
        read = self.key_window(local_len, cp, rank, causal, max_doc, window)
        return (blocks, None) if read is None else (narrow_keys(blocks, *read), read)

    def blocks(
        self,
        cu_seqlens: torch.Tensor,
        local_len: int,
        cp: int,
        rank: int,
        causal: bool,
        max_doc: int | None = None,
        window: tuple[int, int] = NO_WINDOW,
    ) -> list[VarlenBlock]:
        """Rank `rank`'s attention as varlen blocks over the key buffer (source 0, see `key_buffer`): every
        (q row, key) pair of the same document (causal by global position when `causal`, within `window` when
        given: only (left, 0) causal windows) exactly once. `max_doc`, when given, bounds every document's
        length (varlen_attn's max_q/max_k) and so the blocks' max_q/max_k (smaller kernel grids)."""
        raise NotImplementedError


def doc_bound(n: int, max_doc: int | None) -> int:
    """A block's static max length: n tokens, or the documents' bound max_doc where it is smaller."""
    return n if max_doc is None else min(n, max_doc)


class ThdLayout(PackedLayout):
    """Contiguous chunks of the packed buffer: a document piece attends its document's keys up to its last
    token, which the rank-major all-gather buffer already holds contiguously (no copy, one block)."""

    name = "thd"

    def shard_index(self, cu_seqlens, total, cp, rank):
        local = total // cp
        return torch.arange(rank * local, (rank + 1) * local, device=cu_seqlens.device)

    def blocks(self, cu_seqlens, local_len, cp, rank, causal, max_doc=None, window=NO_WINDOW):
        cu = cu_seqlens.long()
        lo, hi = rank * local_len, (rank + 1) * local_len
        start, end = cu[:-1], cu[1:]
        q0, q1 = (start - lo).clamp(0, local_len), (end - lo).clamp(0, local_len)  # pieces, local coordinates
        here = q1 > q0
        # keys of a document with a piece here: its start .. its last local token (causal) or its end; other
        # documents get an empty key range at their start, so the ranges stay in increasing order
        k1 = torch.where(here, end.clamp(max=hi) if causal else end, start)
        bounds = (doc_bound(local_len, max_doc), doc_bound(hi if causal else cp * local_len, max_doc))
        # every local token is in a piece and sees itself; keys of documents with no piece here are not read.
        # Causal, rank 0's pieces all start their documents: each attends its own tokens, a square
        square = causal and rank == 0
        return [VarlenBlock(0, causal, qk_ranges(q0, q1, start, k1), *bounds, window, covers_rows=True, square=square)]

    def key_window(self, local_len, cp, rank, causal, max_doc, window):
        # A key read by row t is in t's document, so within max_doc - 1 of t (varlen_attn's contract, which the
        # run-time guard checks), and within the window's reach; causal rows read nothing after the rank's end.
        lo, hi, total = rank * local_len, (rank + 1) * local_len, cp * local_len
        left = token_reach(max_doc, window[0])
        right = 0 if causal else token_reach(max_doc, window[1])
        start = 0 if left is None else max(0, lo - left)
        stop = total if right is None else min(total, hi + right)
        return None if (start, stop) == (0, total) else (start, stop)


def token_reach(max_doc: int | None, side: int) -> int | None:
    """How many tokens a row's keys can lie away from it on one side, at most (None: unbounded): within the
    window's side (-1: unbounded) and within its document, max_doc - 1 (varlen_attn's max_q/max_k, which the
    run-time guard checks). The all-gather key slice and the ring's skipped steps both follow from it."""
    assert max_doc is None or max_doc >= 1, f"max_doc={max_doc}: the planner keeps only positive bounds"
    bounds = [b for b in (None if max_doc is None else max_doc - 1, None if side < 0 else side) if b is not None]
    return min(bounds) if bounds else None


def narrow_keys(blocks: list[VarlenBlock], start: int, stop: int) -> list[VarlenBlock]:
    """`blocks` over keys [start, stop) of their source, as blocks over that slice: key ranges shifted by
    -start. Every key range with q rows must lie inside (`key_window` says where they do); the empty key
    ranges of documents with no rows here are clamped into it, which keeps the ranges in increasing order."""
    out = []
    for b in blocks:
        ranges = torch.cat((b.ranges[:2], (b.ranges[2:] - start).clamp(0, stop - start)))
        out.append(replace(b, ranges=ranges, max_k=min(b.max_k, stop - start)))
    return out


class ThdZigzagLayout(PackedLayout):
    """Per-document dual-chunk: rank r holds chunks r and 2cp-1-r of every document (front and back chunk)."""

    name = "thd_zigzag"
    doc_multiple_per_cp = 2

    def local_docs(self, cu_seqlens: torch.Tensor, cp: int):
        """Per document: local start, local mid (front/back chunk boundary), local end, chunk length."""
        cu = cu_seqlens.long()
        chunk = (cu[1:] - cu[:-1]) // (2 * cp)
        start = cu[:-1] // cp
        return start, start + chunk, cu[1:] // cp, chunk

    def _key_chunks(self, cp: int, rank: int, causal: bool) -> tuple[int, ...]:
        """Per document, the key buffer's segments as counts of leading chunks: the front chunk's keys (chunks
        0..r) then the back chunk's (0..2cp-1-r) when causal, else the whole document once."""
        return (rank + 1, 2 * cp - rank) if causal else (2 * cp,)

    def shard_index(self, cu_seqlens, total, cp, rank):
        cu = cu_seqlens.long()
        start, mid, _, chunk = self.local_docs(cu, cp)
        j = torch.arange(total // cp, device=cu.device)
        doc = (sorted_search(cu // cp, j, right=True) - 1).clamp(0, chunk.numel() - 1)
        off, c, s = j - start[doc], chunk[doc], cu[:-1][doc]
        return torch.where(off < c, s + rank * c + off, s + (2 * cp - 1 - rank) * c + (off - c))

    def key_buffer(self, cu_seqlens, local_len, cp, rank, causal):
        index, segment = self._key_index(cu_seqlens, local_len, cp, rank, causal)
        copies, total = len(self._key_chunks(cp, rank, causal)), cp * local_len
        fold = torch.full((copies * total,), -1, dtype=torch.int64, device=index.device)
        position = torch.arange(index.numel(), device=index.device)
        return index, fold.index_put_((segment * total + index,), position).view(copies, total)  # unique targets

    def _key_index(self, cu_seqlens, local_len, cp, rank, causal):
        """(key-buffer index, the segment (copy) each key-buffer position belongs to)."""
        cu = cu_seqlens.long()
        start, _, _, chunk = self.local_docs(cu, cp)
        segments = self._key_chunks(cp, rank, causal)
        per_doc = sum(segments)  # chunks per document in the key buffer
        cu_chunks = cu // (2 * cp)  # document offsets in chunk units
        i = torch.arange(local_len // 2 * per_doc, device=cu.device)
        doc = (sorted_search(cu_chunks * per_doc, i, right=True) - 1).clamp(0, chunk.numel() - 1)
        c = chunk[doc].clamp(min=1)
        off = i - cu_chunks[doc] * per_doc  # offset in the document's key-buffer segments
        segment = torch.zeros_like(off)
        if len(segments) == 2:  # past the front segment: restart the chunk count for the back segment
            segment = (off >= segments[0] * c).long()
            off = off - segment * segments[0] * c
        j, t = off // c, off % c  # global chunk of the document, token in it
        owner = torch.where(j < cp, j, 2 * cp - 1 - j)
        return owner * local_len + start[doc] + torch.where(j < cp, 0, c) + t, segment

    def blocks(self, cu_seqlens, local_len, cp, rank, causal, max_doc=None, window=NO_WINDOW):
        start, mid, end, chunk = self.local_docs(cu_seqlens, cp)
        segments = self._key_chunks(cp, rank, causal)
        at = (cu_seqlens.long()[:-1] // (2 * cp)) * sum(segments)  # each document's key-buffer offset
        one = doc_bound(local_len // 2, None if max_doc is None else max_doc // (2 * cp))  # one chunk, at most
        full = dict(covers_rows=True, covers_keys=True)  # the key buffer is exactly the ranges' keys
        if not causal:  # both local chunks of a document against the whole document, unmasked
            ranges = qk_ranges(start, end, at, at + 2 * cp * chunk)
            return [VarlenBlock(0, False, ranges, 2 * one, 2 * cp * one, window, **full)]
        front_keys = at + segments[0] * chunk
        q0, q1 = interleave(start, mid), interleave(mid, end)
        k0, k1 = interleave(at, front_keys), interleave(front_keys, front_keys + segments[1] * chunk)
        return [VarlenBlock(0, True, qk_ranges(q0, q1, k0, k1), one, segments[1] * one, window, **full)]


def whole_sequence_blocks(
    cu_seqlens: torch.Tensor,
    total: int,
    causal: bool,
    window: tuple[int, int] = NO_WINDOW,
    max_doc: int | None = None,
) -> list[VarlenBlock]:
    """The blocks of cp=1 (what a2a runs after the exchange): every document against itself, in one block
    over the packed buffer of `total` tokens in global order (source 0), causal and windowed as asked.
    `max_doc` (varlen_attn's max_q/max_k) bounds the kernel grid, as on one device."""
    cu = cu_seqlens.long()
    ranges = qk_ranges(cu[:-1], cu[1:], cu[:-1], cu[1:])
    bound = doc_bound(total, max_doc)
    # documents tile [0, total) and every row sees its own position (the window's diagonal), whatever the mask
    return [VarlenBlock(0, causal, ranges, bound, bound, window, covers_rows=True, covers_keys=True, square=True)]


THD_LAYOUTS: dict[str, PackedLayout] = {"thd": ThdLayout(), "thd_zigzag": ThdZigzagLayout()}


def get_packed_layout(strategy: str) -> PackedLayout:
    return THD_LAYOUTS[strategy]
