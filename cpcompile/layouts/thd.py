"""Packed-document (THD) layouts: which packed tokens a rank owns and its varlen blocks (pure index math).

A packed buffer of T tokens holds documents given by the GLOBAL cu_seqlens (N+1 offsets, cu[0] = 0, cu[N] = T).
Documents change every batch, so everything that depends on them is computed with torch ops on the device
that holds cu_seqlens, with static shapes and no host synchronisation: the region traces these functions into
the graph. Only the rules about document lengths (`document_error`) read cu_seqlens on the host, in the
user-side sharding helpers.

- thd: rank r owns the contiguous tokens [r*L, (r+1)*L), L = T / cp. Documents of any length.
- thd_zigzag: every document is cut into 2*cp chunks and rank r owns chunks r and 2*cp-1-r of each, in
  document order (the TE/Megatron layout); every document length must be a multiple of 2*cp.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

LOCAL, GATHERED = 0, 1
"""Block sources: this rank's own K/V, and the all-gather of every rank's K/V (rank-major, T tokens)."""


@dataclass(frozen=True)
class VarlenBlock:
    """One varlen kernel call: `ranges` (4, B) int64 = q rows [0]..[1] of the local q attend keys [2]..[3] of
    the source buffer, per sequence (see kernels.base.VarlenAttentionKernel). `max_q`/`max_k` bound the lengths
    of the q and k ranges statically; `causal` is a causal square per sequence (equal q and k lengths);
    `window` (left, right) further limits key j of q row t to t-left <= j <= t+right (-1: unbounded)."""

    source: int
    causal: bool
    ranges: torch.Tensor
    max_q: int
    max_k: int
    window: tuple[int, int] = (-1, -1)


def _ranges(q0, q1, k0, k1) -> torch.Tensor:
    return torch.stack((q0, q1, k0, k1)).long()


def _capped(block: VarlenBlock, max_doc: int | None) -> VarlenBlock:
    """`block` with its length bounds cut to `max_doc` (every range lies within one document)."""
    if max_doc is None:
        return block
    return dataclasses.replace(block, max_q=min(block.max_q, max_doc), max_k=min(block.max_k, max_doc))


def _interleave(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.stack((a, b), 1).flatten()


class PackedLayout:
    """Base of the THD layouts; subclasses define the total-length rule, sharding and blocks."""

    name: str = ""
    doc_multiple_per_cp: int = 0
    """Every document length must be a multiple of this times cp (0: any length)."""

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

    def blocks(
        self, cu_seqlens: torch.Tensor, local_len: int, cp: int, rank: int, causal: bool, max_doc: int | None = None
    ) -> list[VarlenBlock]:
        """Rank `rank`'s attention as varlen blocks over its local and the gathered K/V: every (q row, key)
        pair of the same document (and causal by global position when `causal`) exactly once. `max_doc`, when
        given, bounds every document's length (the varlen_attn call's max_q/max_k): the blocks' max_q/max_k
        are then at most what a document that long can put in one range (smaller kernel grids)."""
        raise NotImplementedError

    def device_check(self, cu_seqlens: torch.Tensor, cp: int) -> None:
        """Data-dependent rules asserted on device inside the region (no host sync); none by default."""


class ThdLayout(PackedLayout):
    """Contiguous chunks of the packed buffer; a document piece sees its own earlier tokens on other ranks."""

    name = "thd"

    def shard_index(self, cu_seqlens, total, cp, rank):
        local = total // cp
        return torch.arange(rank * local, (rank + 1) * local, device=cu_seqlens.device)

    def blocks(self, cu_seqlens, local_len, cp, rank, causal, max_doc=None):
        return [_capped(b, max_doc) for b in self._blocks(cu_seqlens, local_len, cp, rank, causal)]

    def _blocks(self, cu_seqlens, local_len, cp, rank, causal):
        cu = cu_seqlens.long()
        lo, total = rank * local_len, cp * local_len
        piece = (cu - lo).clamp(0, local_len)  # document pieces in local coordinates (empty when elsewhere)
        q0, q1 = piece[:-1], piece[1:]
        if not causal:
            keys = cu.clamp(0, total)
            return [VarlenBlock(GATHERED, False, _ranges(q0, q1, keys[:-1], keys[1:]), local_len, total)]
        out = [VarlenBlock(LOCAL, True, _ranges(q0, q1, q0, q1), local_len, local_len)]
        if rank > 0:
            # Only the document that crosses position lo has earlier tokens: keys [doc start, lo) of the gather.
            earlier = cu.clamp(0, lo)
            out.append(VarlenBlock(GATHERED, False, _ranges(q0, q1, earlier[:-1], earlier[1:]), local_len, lo))
        return out


class ThdZigzagLayout(PackedLayout):
    """Per-document dual-chunk: rank r holds chunks r and 2cp-1-r of every document (front and back chunk)."""

    name = "thd_zigzag"
    doc_multiple_per_cp = 2

    def _local_docs(self, cu_seqlens: torch.Tensor, cp: int):
        """Per document: local start, local mid (front/back chunk boundary), local end, chunk length."""
        cu = cu_seqlens.long()
        chunk = (cu[1:] - cu[:-1]) // (2 * cp)
        start = cu[:-1] // cp
        return start, start + chunk, cu[1:] // cp, chunk

    def shard_index(self, cu_seqlens, total, cp, rank):
        cu = cu_seqlens.long()
        start, mid, _, chunk = self._local_docs(cu, cp)
        j = torch.arange(total // cp, device=cu.device)
        doc = (torch.searchsorted(cu // cp, j, right=True) - 1).clamp(0, chunk.numel() - 1)
        off, c, s = j - start[doc], chunk[doc], cu[:-1][doc]
        return torch.where(off < c, s + rank * c + off, s + (2 * cp - 1 - rank) * c + (off - c))

    def blocks(self, cu_seqlens, local_len, cp, rank, causal, max_doc=None):
        start, mid, end, _ = self._local_docs(cu_seqlens, cp)
        # ranges of one chunk of a document, and of two (a whole local document): at most these many tokens
        one, two = local_len // 2, local_len
        if max_doc is not None:
            one, two = min(one, max_doc // (2 * cp)), min(two, 2 * (max_doc // (2 * cp)))
        if not causal:
            out = [VarlenBlock(LOCAL, False, _ranges(start, end, start, end), two, two)]
            for p in range(cp):
                if p != rank:
                    at = p * local_len
                    out.append(VarlenBlock(GATHERED, False, _ranges(start, end, at + start, at + end), two, two))
            return out
        chunks0, chunks1 = _interleave(start, mid), _interleave(mid, end)  # front and back chunks as sequences
        out = [
            VarlenBlock(LOCAL, True, _ranges(chunks0, chunks1, chunks0, chunks1), one, one),
            VarlenBlock(LOCAL, False, _ranges(mid, end, start, mid), one, one),  # back chunk sees own front
        ]
        for p in range(cp):
            at = p * local_len
            if p < rank:  # rank p's front chunk (chunk p) precedes both local chunks
                out.append(VarlenBlock(GATHERED, False, _ranges(start, end, at + start, at + mid), two, one))
            elif p > rank:  # both of rank p's chunks (p and 2cp-1-p) precede only the local back chunk
                out.append(VarlenBlock(GATHERED, False, _ranges(mid, end, at + start, at + end), one, two))
        return out

    def device_check(self, cu_seqlens: torch.Tensor, cp: int) -> None:
        """Assert on device (no host sync) that every document length is a multiple of 2*cp."""
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        torch._assert_async(
            (lengths % (2 * cp) == 0).all(),
            f"cpcompile thd_zigzag: every document length must be a multiple of 2*cp={2 * cp}",
        )


def whole_sequence_blocks(
    cu_seqlens: torch.Tensor, total: int, causal: bool, window: tuple[int, int] = (-1, -1)
) -> list[VarlenBlock]:
    """The blocks of cp=1 (what a2a runs after the exchange): every document against itself, in one block
    over the packed buffer of `total` tokens in global order (source 0), causal and windowed as asked."""
    cu = cu_seqlens.long()
    return [VarlenBlock(0, causal, _ranges(cu[:-1], cu[1:], cu[:-1], cu[1:]), total, total, window)]


THD_LAYOUTS: dict[str, PackedLayout] = {"thd": ThdLayout(), "thd_zigzag": ThdZigzagLayout()}


def get_packed_layout(strategy: str) -> PackedLayout:
    return THD_LAYOUTS[strategy]
