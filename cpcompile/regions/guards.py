"""Run-time guards the pass inserts next to the regions: checks every rank makes together, so a bad input is
an error on every rank (never a hang on one rank waiting for another, never a silently wrong answer).

Each guard gathers a few int64 values from every rank of the CP group (one small collective) and asserts on
device (`torch._assert_async`: no host sync; on CPU it raises at once, on CUDA it fails the stream) that
they agree, before the region's own collectives run.
"""

from __future__ import annotations

import torch

from ..comm.collectives import all_gather_dim0
from ..layouts import get_layout
from ..layouts.search import sorted_search
from ..layouts.thd import get_packed_layout, offsets_ok


def _agreed(values: torch.Tensor, group_name: str, message: str) -> torch.Tensor:
    """All-gather the int64 vector `values` (same length on every rank) and assert every rank sent the same."""
    gathered = all_gather_dim0(values.reshape(1, -1), group_name)
    torch._assert_async((gathered == gathered[:1]).all(), message)
    return gathered


COND_DIFFERS = (
    "cpcompile: the condition of a torch.cond around attention differs between CP ranks; make it the same on every rank"
)


def agree_condition(pred: torch.Tensor, *, group_name: str, world: int) -> torch.Tensor:
    """`pred` of a torch.cond whose branches hold CP regions, once every rank has the same value: ranks taking
    different branches would issue different collectives."""
    del world
    _agreed(pred.reshape(()).to(torch.int64), group_name, COND_DIFFERS)
    return pred


MAX_MESSAGE = 254
"""CUDA's device assert takes messages shorter than 255 characters (torch 2.11 refuses longer ones)."""

DIFFERS = "cpcompile: cu_seqlens differs between CP ranks; pass the same GLOBAL cu_seqlens (unsharded) to every rank"


def bad_cu_message(total: int, max_doc: int | None, doc_multiple_per_cp: int, world: int) -> str:
    """The packed check's assert message: the rules for this site, within MAX_MESSAGE characters."""
    rules = [f"cu[0]=0, non-decreasing, cu[-1]={total} (the GLOBAL packed length, not a rank's local one)"]
    if max_doc is not None:
        rules.append(f"docs <= max_q/max_k={max_doc}")
    if doc_multiple_per_cp > 1:
        rules.append(f"each a multiple of {doc_multiple_per_cp}*cp={doc_multiple_per_cp * world}")
    return f"cpcompile: bad cu_seqlens, need {'; '.join(rules)}. cpcompile.shard checks it on the host"


def _checksum(cu: torch.Tensor) -> torch.Tensor:
    """An int64 fingerprint of cu_seqlens (position-weighted, wrapping): equal on every rank iff, for practical
    purposes, cu is; cheap next to any attention."""
    # a multiplier that fits int32: Inductor's Triton code multiplies the arange index in int32 with the
    # literal, and 2654435761 failed to compile there ("Scalar ... out of range for type int32", H200)
    weights = torch.arange(1, cu.numel() + 1, device=cu.device, dtype=torch.int64) * 40503 + 97
    return (cu.long() * weights).sum() + cu.numel()


def check_packed_metadata(
    cu_seqlens: torch.Tensor,
    *,
    total: int,
    max_doc: int | None,
    doc_multiple_per_cp: int,
    group_name: str,
    world: int,
    layout: str | None = None,
) -> torch.Tensor:
    """cu_seqlens, once every rank has checked that it is the same on every CP rank and that it describes
    documents tiling the packed buffer: starts at 0, never decreases, ends at `total` (the global packed
    length), no document longer than `max_doc` (varlen_attn's max_q/max_k: the kernels size their grids by
    it), every length a multiple of `doc_multiple_per_cp` * cp when the layout asks (thd_zigzag: 2*cp).
    `layout` (given for layouts whose cu_seqlens carries a plan: thd_balanced) checks the whole plan instead.

    Returned through a where() on the verdict, so the regions depend on the check (it runs before them) and,
    should a CUDA assert be late, see empty documents rather than out-of-range offsets."""
    cu = cu_seqlens.long()
    if layout is None:
        ok = offsets_ok(cu, total, doc_multiple_per_cp * world, max_doc)
        message = bad_cu_message(total, max_doc, doc_multiple_per_cp, world)
    else:
        lay = get_packed_layout(layout)
        ok, message = lay.metadata_ok(cu, total, world, max_doc), lay.bad_metadata_message(total, max_doc, world)
    gathered = all_gather_dim0(torch.stack((_checksum(cu), ok.long())).reshape(1, 2), group_name)
    same = (gathered[:, 0] == gathered[0, 0]).all()
    torch._assert_async(same, DIFFERS)
    valid = same & (gathered[:, 1] == 1).all()
    torch._assert_async(valid, message)
    return torch.where(valid, cu_seqlens, torch.zeros_like(cu_seqlens))


PLAN_MISMATCH = (
    "cpcompile: position_ids do not match the thd_balanced plan in cu_seqlens on some CP rank: the tokens were "
    "sharded with another plan (another batch's?). Pass the cu_seqlens shard_batch returned with these tokens"
)


def plan_positions_ok(
    positions: torch.Tensor, cu_seqlens: torch.Tensor, *, layout: str, rank: int, world: int
) -> torch.Tensor:
    """Whether this rank's position ids are those of the tokens the plan (thd_balanced's cu_seqlens) gives it: in
    every document piece they count up by one from the document's first position, which is 0 (positions inside
    documents), the document's offset in the packed buffer (positions over the buffer), or the previous
    document's length (HF's padded rows, positions 0..L-1 over the row: a row's real tokens start where its
    padding document ends, or its padding where its real tokens end). A bool scalar, no host sync."""
    lay = get_packed_layout(layout)
    pos = positions.reshape(-1).long()
    index = lay.shard_index(cu_seqlens, pos.numel() * world, world, rank).long()
    offsets = lay.offsets(cu_seqlens, world).long()
    doc = (sorted_search(offsets, index, right=True) - 1).clamp(0, offsets.numel() - 1)
    first = pos - (index - offsets[doc])  # the position this token's document would start at
    same_doc = doc[1:] == doc[:-1]
    counts_up = ((first[1:] == first[:-1]) | ~same_doc).all()
    previous = offsets[doc] - offsets[(doc - 1).clamp(min=0)]
    known_start = (first == 0) | (first == offsets[doc]) | ((doc > 0) & (first == previous))
    return counts_up & known_start.all()


def check_plan_positions(
    positions: torch.Tensor, cu_seqlens: torch.Tensor, *, layout: str, group_name: str, rank: int, world: int
) -> None:
    """Binds a plan (thd_balanced's cu_seqlens) to the tokens it sharded through the model's position ids
    (plan_positions_ok). Data sharded with another plan (the previous batch's, another row's) has other
    positions there, which fails every rank's device assert (one 1-int64 all-gather, no host sync). Inserted by
    passes/rewrite next to the packed check when the graph takes position ids."""
    ok = plan_positions_ok(positions, cu_seqlens, layout=layout, rank=rank, world=world)
    gathered = all_gather_dim0(ok.long().reshape(1, 1), group_name)
    torch._assert_async((gathered == 1).all(), PLAN_MISMATCH)


BAD_POSITIONS = (
    "cpcompile: position_ids are not every token's GLOBAL position on some CP rank: pass arange(global length) "
    "sharded like the tokens (cpcompile.shard_batch); HF packed documents: shard_batch(..., "
    "strategy='thd_balanced', hf_packing=True)"
)
PADDED = (
    "cpcompile: attention_mask has padding (zeros) on some CP rank, which CP cannot apply: drop an all-ones "
    "mask, or make the padded rows packed documents: cpcompile.shard_batch(..., strategy='thd_balanced', "
    "hf_packing=True)"
)


def global_positions(layout: str, rank: int, world: int, local_len: int, device: torch.device) -> torch.Tensor:
    """The global position of each of this rank's `local_len` tokens, in local order (layouts' shard_index)."""
    lay = get_layout(layout)
    chunk = local_len // lay.chunks_per_rank
    starts = [c * chunk for c in lay.rank_chunks(rank, world)]
    return torch.cat([torch.arange(s, s + chunk, device=device) for s in starts])


def check_dense_tokens(
    position_ids: torch.Tensor | None,
    padding_mask: torch.Tensor | None,
    *,
    layout: str,
    group_name: str,
    rank: int,
    world: int,
) -> None:
    """Every rank's cpcompile.attention metadata describes one unpadded, unpacked sequence: the position ids are
    the tokens' global positions in this layout (which HF's packed sequences, positions left at 0..L-1 on every
    rank, or a mismatched sharding all break), and the padding mask is all ones. One 2-int64 all-gather a graph,
    then a device assert per rule on every rank. Inserted once per graph before the first region (passes/rewrite);
    its result is nothing: the asserts are the point (aot_autograd keeps them: they have side effects)."""
    device = (position_ids if position_ids is not None else padding_mask).device
    true = torch.ones((), dtype=torch.bool, device=device)
    positions_ok = true
    if position_ids is not None:
        expected = global_positions(layout, rank, world, position_ids.shape[-1], device)
        positions_ok = (position_ids == expected).all()
    padding_ok = true if padding_mask is None else padding_mask.bool().all()
    ok = [positions_ok, padding_ok]
    gathered = all_gather_dim0(torch.stack(ok).long().reshape(1, 2), group_name)
    torch._assert_async((gathered[:, 0] == 1).all(), BAD_POSITIONS)
    torch._assert_async((gathered[:, 1] == 1).all(), PADDED)
