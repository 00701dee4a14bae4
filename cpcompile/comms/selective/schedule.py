"""Selective exchange (thd_balanced, thd): which K/V tokens each rank sends each peer, and where they land.

Under thd_balanced most documents are whole on one rank; only the cut ones (at most 2(cp - 1)) have pieces on
several ranks. A rank's queries read, besides its own tokens, only the other pieces of the documents it holds a
piece of (causal: each document's prefix up to the rank's last token in it; full: the whole document). So rank
r needs from peer p exactly those tokens: `need[r, p]` of them, a matrix that depends on the batch's plan.
Under thd (contiguous chunks) a rank reads only the documents crossing its first token (causal) and its last
one (full): one document from each peer (`thd_reads`).

An all-to-all with those per-peer sizes needs them on the host (torch's functional all_to_all_single takes its
splits as ints: a host sync, and a recompile whenever they change). Here every peer slot has a STATIC capacity C
instead: each rank sends each peer C token slots, the tokens that peer reads first (in the sender's local
order, which is global order), the rest of the slots unread padding. C is known at trace time:

    C = min(L, max_doc)     (L = T / cp tokens a rank; max_doc = varlen_attn's static max_q/max_k; L without it)

L always holds (a peer has only L tokens); under thd so does max_doc (one document a peer). Under thd_balanced
max_doc holds while a peer shares with this rank the pieces of at
most one document, or several whose remote parts add up to at most max_doc; the solver's plans keep it on the
bench's mixes (the largest need was 0.73 max_doc, docs/architecture.md), and the region asserts it on device
for every batch (`fits`, the same value on every rank, before the exchange). A rank receives (cp - 1) * C
tokens instead of the all-gather's (cp - 1) * L: fewer bytes when max_doc < L, the same otherwise.

Everything is device ops of static shape on the plan (searchsorted, cumsum, scatter_reduce): no host sync, no
recompile when documents change. The held buffer a rank attends over is [its own L tokens | the (cp - 1) * C
received slots, peers in rank order]; the layout's key buffer (thd_balanced's, `Plan.key_buffer`; thd's in
global order, `global_key_buffer`) is copied from it through `held_position`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...layouts.search import sorted_search
from ...layouts.thd_balanced import Plan


def capacity(local_len: int, max_doc: int | None) -> int:
    """C: the static token slots a rank sends each peer (see the module docstring)."""
    return local_len if max_doc is None else max(1, min(local_len, max_doc))


def held_len(local_len: int, cp: int, cap: int) -> int:
    """Tokens of the held buffer: the rank's own, then cp - 1 peers' slots."""
    return local_len + (cp - 1) * cap


@dataclass(frozen=True)
class Selection:
    """Rank `rank`'s side of one batch's selective exchange (int64 device tensors of static shape)."""

    send_index: torch.Tensor
    """((cp - 1) * C,): the local token in each send slot, peers in rank order (unused slots: any token)."""
    held_position: torch.Tensor
    """(T,): where each global position sits in the held buffer (positions this rank never reads: 0)."""
    held_mask: torch.Tensor
    """(T,) bool: the global positions the held buffer holds (the rank's own and those it reads)."""
    back: torch.Tensor
    """(cp - 1, L): per peer, the slot of the returned gradient that holds each local token's part, -1 none."""
    need: torch.Tensor
    """(cp, cp): tokens reader r needs from owner p (the diagonal is 0: its own)."""
    fits: torch.Tensor
    """0-dim bool: every need fits C (the same on every rank: computed from the global plan)."""


def local_positions(plan: Plan, local_len: int) -> torch.Tensor:
    """(cp, L): the global position of every rank's local tokens (rank-major, local order)."""
    q0, n = plan.local_start, plan.lens
    j = torch.arange(local_len, device=q0.device).expand(plan.cp, local_len).contiguous()
    piece = sorted_search(q0 + n, j, right=True).clamp(max=plan.slots - 1)
    return plan.starts.gather(1, piece) + (j - q0.gather(1, piece))


def _read_matrix(positions, doc, limit) -> torch.Tensor:
    """(reader, owner, L) bool from each token's document and each reader's highest key + 1 per document."""
    cp = positions.shape[0]
    read = positions.unsqueeze(0) < limit[:, doc.flatten()].view(cp, cp, -1)
    others = ~torch.eye(cp, dtype=torch.bool, device=read.device)
    return read & others.unsqueeze(-1)


def reads(plan: Plan, positions: torch.Tensor, causal: bool) -> torch.Tensor:
    """(reader, owner, L) bool under thd_balanced: whether reader r's queries read owner p's local token (never
    its own): the keys of each document it holds a piece of, below its last token in it (causal) or all."""
    cp = plan.cp
    docs = plan.offsets.numel() - 1
    piece_doc = plan.documents(plan.starts)  # (cp, P)
    reach = plan.starts + plan.lens if causal else plan.offsets[piece_doc + 1]
    reach = torch.where(plan.lens > 0, reach, 0)
    limit = torch.zeros(cp, docs, dtype=reach.dtype, device=reach.device)
    limit = limit.scatter_reduce(1, piece_doc, reach, "amax")  # per reader and document: keys read below this
    return _read_matrix(positions, plan.documents(positions), limit)


def thd_reads(cu_seqlens: torch.Tensor, local_len: int, cp: int, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions (cp, L), reads (reader, owner, L)) under thd (rank r owns [rL, (r+1)L)): a reader reads the
    documents crossing its first token (causal) and its last one (full attention): one document a peer, so every
    need fits C = min(L, max_doc) (documents are checked against max_doc on device)."""
    cu = cu_seqlens.long()
    positions = torch.arange(cp * local_len, device=cu.device).view(cp, local_len)
    lo = torch.arange(cp, device=cu.device).unsqueeze(-1) * local_len  # (reader, 1)
    start, end = cu[:-1].unsqueeze(0), cu[1:].unsqueeze(0)
    here = (start < lo + local_len) & (end > lo) & (end > start)  # (reader, document): a piece of it here
    limit = torch.where(here, end.clamp(max=lo + local_len) if causal else end, 0)
    doc = (sorted_search(cu, positions, right=True) - 1).clamp(0, cu.numel() - 2)
    return positions, _read_matrix(positions, doc, limit)


def select(cu_seqlens: torch.Tensor, local_len: int, cp: int, rank: int, causal: bool, cap: int) -> Selection:
    """The exchange of rank `rank` for this batch's plan (`cu_seqlens`: thd_balanced's), C = `cap` slots a peer."""
    plan = Plan(cu_seqlens, cp)
    positions = local_positions(plan, local_len)
    return exchange(positions, reads(plan, positions, causal), local_len, cp, rank, cap)


def select_thd(cu_seqlens: torch.Tensor, local_len: int, cp: int, rank: int, causal: bool, cap: int) -> Selection:
    """The exchange of rank `rank` under thd (plain GLOBAL offsets), C = `cap` slots a peer."""
    return exchange(*thd_reads(cu_seqlens, local_len, cp, causal), local_len, cp, rank, cap)


def exchange(positions: torch.Tensor, read: torch.Tensor, local_len: int, cp: int, rank: int, cap: int) -> Selection:
    """Rank `rank`'s slots, held positions and way back, from every rank's global positions and what reads what."""
    need = read.sum(-1)
    slot = read.long().cumsum(-1) - 1  # (reader, owner, L): a read token's slot among what the owner sends
    peers = [p for p in range(cp) if p != rank]
    # send: the k-th token reader p reads from me is the first local j with slot == k
    wanted = torch.arange(cap, device=slot.device).expand(cp, cap).contiguous()
    mine = slot[:, rank].contiguous()  # (reader, L)
    send = sorted_search(mine, wanted, right=False).clamp(max=local_len - 1)
    send_index = torch.cat((send[:rank], send[rank + 1 :])).flatten()
    # receive: owner p's read tokens land in its block of slots after my own tokens, which stay first
    offset = [local_len + peers.index(p) * cap if p != rank else 0 for p in range(cp)]
    offset = torch.tensor(offset, device=slot.device).unsqueeze(-1)
    j = torch.arange(local_len, device=slot.device)
    own = (torch.arange(cp, device=slot.device) == rank).unsqueeze(-1)
    held = torch.where(own, j, torch.where(read[rank], offset + slot[rank], 0))
    held_position = torch.zeros(cp * local_len, dtype=torch.int64, device=held.device)
    held_position = held_position.index_put((positions.flatten(),), held.flatten())
    # backward: the gradient reader p returns sits in its block of the returned (cp - 1) * C slots
    block = torch.arange(cp - 1, device=slot.device).unsqueeze(-1) * cap
    back = torch.where(torch.cat((read[:rank, rank], read[rank + 1 :, rank])), block + torch.cat(
        (mine[:rank], mine[rank + 1 :])), -1)  # fmt: skip
    held_mask = torch.zeros(cp * local_len, dtype=torch.bool, device=held.device)
    held_mask = held_mask.index_put((positions.flatten(),), (own | read[rank]).flatten())
    return Selection(send_index, held_position, held_mask, back, need, (need <= cap).all())


def global_key_buffer(
    sel: Selection, held: int, key_slice: tuple[int, int] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """thd's key buffer over the held buffer: T tokens in GLOBAL order (the all-gather's own key buffer, so thd's
    blocks read it unchanged), copied through `held_position`; positions the rank does not hold are in no range
    (any token fills them). `key_slice` (layouts' key_window): only global positions [start, stop), the keys the
    rank's rows can reach, at key-buffer positions 0.. (the blocks narrowed to it, PackedLayout.kernel_blocks);
    held tokens outside it are read by no row and fold to nothing. (index, fold) as PackedLayout.key_buffer,
    fold (1, held)."""
    start, stop = (0, sel.held_position.numel()) if key_slice is None else key_slice
    g = torch.arange(start, stop, device=sel.held_position.device)
    position, mask = sel.held_position[start:stop], sel.held_mask[start:stop]
    target = torch.where(mask, position, held + g - start)  # all distinct
    fold = torch.full((held + stop - start,), -1, dtype=torch.int64, device=g.device)
    fold = fold.index_put((target,), g - start)
    return position, fold[:held].view(1, held)
