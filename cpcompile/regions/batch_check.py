"""The run-time batch check: does this step's batch fit the layout the backend compiled for, on every rank?

A batch the CP regions read is this rank's tokens in the layout's order. Nothing in a graph's shapes tells a batch
sharded for that layout from one sharded for another (flat under zigzag), from positions numbered 0..L-1 on every
rank, or from no sharding at all (every rank feeds the whole batch): all of them ran silently wrong. So every graph
with a CP region checks its batch once a step, inserted by passes/batch_check.py before its first region:

- position ids (graph inputs named `*position*`, and cpcompile.attention's): under flat they must be this rank's
  slice of arange(global length), under zigzag its two chunks' (layouts' rank_chunks); packed documents: they count
  up by one inside each of this rank's document pieces from the document's start (plan_positions_ok), which also
  binds thd_balanced's plan to the tokens it sharded;
- cpcompile.attention's padding masks: all ones (CP cannot apply padding);
- where no positions are checked, the token ids (integer inputs with the local length): every rank's tokens
  identical (and not all one value, like a tail of padding) where the layout gives each rank other tokens is an
  unsharded batch.

Cost: a few elementwise ops over the ids and positions and ONE all-gather of four int64 per graph and step; the
verdict is read on device (`torch._assert_async`) on CUDA, with no host sync, and capturable by CUDA graphs, and
raised at once on CPU. Each rank asserts on every rank's verdicts, so a mismatch on one rank stops every rank (a
rank stopping alone would leave the others waiting in their next collective). The error is a BatchLayoutError (a
CPCompileError) on CPU; on CUDA the device assert, whose message says the same. Off: cpcompile.backend(...,
check_batch=False).
"""

from __future__ import annotations

import torch

from ..comm.collectives import all_gather_dim0
from ..errors import BatchLayoutError
from ..layouts import THD_LAYOUTS, get_layout
from ..layouts.search import sorted_search
from ..layouts.thd import get_packed_layout

MAX_MESSAGE = 254
"""CUDA's device assert takes messages shorter than 255 characters (torch 2.11 refuses longer ones)."""

PADDED = (
    "cpcompile: attention_mask has padding (zeros) on some CP rank, which CP cannot apply: drop an all-ones "
    "mask, or make the padded rows packed documents: cpcompile.shard_batch(..., strategy='thd_balanced', "
    "hf_packing=True)"
)
PLAN_MISMATCH = (
    "cpcompile: position_ids do not match the thd_balanced plan in cu_seqlens on some CP rank: the tokens were "
    "sharded with another plan (another batch's?). Pass the cu_seqlens shard_batch returned with these tokens"
)


def bad_positions_message(layout: str) -> str:
    """The positions check's message for `layout` (within MAX_MESSAGE)."""
    if layout in THD_LAYOUTS and THD_LAYOUTS[layout].carries_plan:
        return PLAN_MISMATCH
    return (
        f"cpcompile: position_ids are not every token's GLOBAL position under layout {layout!r} on some CP rank: "
        f"shard the GLOBAL batch with cpcompile.shard_batch(batch, strategy={layout!r}, mesh=...) on every rank"
    )


def unsharded_message(layout: str) -> str:
    """The unsharded-batch check's message for `layout` (within MAX_MESSAGE)."""
    return (
        f"cpcompile: every CP rank got the same tokens, but layout {layout!r} gives each rank its own: shard the "
        f"GLOBAL batch with cpcompile.shard_batch(batch, strategy={layout!r}, mesh=...) on every rank"
    )


@torch.library.custom_op("cpcompile::assert_on_ranks", mutates_args=())
def assert_on_ranks(ok: torch.Tensor, message: str) -> None:
    """Stop if `ok` (a 0-dim bool, the same on every rank: made of all-gathered verdicts) is false: a
    BatchLayoutError on CPU (the value is on the host already), a device assert on CUDA (no host sync)."""
    if ok.device.type == "cpu":
        if not bool(ok):
            raise BatchLayoutError(message)
        return
    torch._assert_async(ok, message)


@assert_on_ranks.register_fake
def _(ok: torch.Tensor, message: str) -> None:
    return None


torch.fx.node.has_side_effect(torch.ops.cpcompile.assert_on_ranks.default)  # never dropped: it has no outputs


def global_positions(layout: str, rank: int, world: int, local_len: int, device: torch.device) -> torch.Tensor:
    """The global position of each of this rank's `local_len` tokens, in local order (layouts' rank_chunks)."""
    lay = get_layout(layout)
    chunk = local_len // lay.chunks_per_rank
    starts = [c * chunk for c in lay.rank_chunks(rank, world)]
    return torch.cat([torch.arange(s, s + chunk, device=device) for s in starts])


def plan_positions_ok(
    positions: torch.Tensor, cu_seqlens: torch.Tensor, *, layout: str, rank: int, world: int
) -> torch.Tensor:
    """Whether this rank's position ids are those of the tokens a packed layout gives it (thd_balanced: the plan
    in cu_seqlens): in every document piece they count up by one from the document's first position, which is 0
    (positions inside documents), the document's offset in the packed buffer (positions over the buffer), or the
    previous document's length (HF's padded rows, positions 0..L-1 over the row: a row's real tokens start where
    its padding document ends, or its padding where its real tokens end). A position 0 is padding's (torchtitan's
    adapter pads documents with tokens at position 0) and passes anywhere. A bool scalar, no host sync."""
    lay = get_packed_layout(layout)
    pos = positions.reshape(-1).long()
    index = lay.shard_index(cu_seqlens, pos.numel() * world, world, rank).long()
    offsets = lay.offsets(cu_seqlens, world).long()
    doc = (sorted_search(offsets, index, right=True) - 1).clamp(0, offsets.numel() - 1)
    first = pos - (index - offsets[doc])  # the position this token's document would start at
    free = pos == 0
    same_doc = doc[1:] == doc[:-1]
    counts_up = ((first[1:] == first[:-1]) | ~same_doc | free[1:] | free[:-1]).all()
    previous = offsets[doc] - offsets[(doc - 1).clamp(min=0)]
    known_start = free | (first == 0) | (first == offsets[doc]) | ((doc > 0) & (first == previous))
    return counts_up & known_start.all()


def positions_ok(
    positions: torch.Tensor, cu_seqlens: torch.Tensor | None, *, layout: str, rank: int, world: int
) -> torch.Tensor:
    """Whether `positions` are the global positions `layout` gives this rank's tokens (0-dim bool); a position 0
    passes anywhere (padding's: torchtitan's adapter pads rows with position 0)."""
    if cu_seqlens is not None:
        return plan_positions_ok(positions, cu_seqlens, layout=layout, rank=rank, world=world)
    expected = global_positions(layout, rank, world, positions.shape[-1], positions.device)
    pos = positions.long()
    return ((pos == expected) | (pos == 0)).all()


def fingerprint(tokens: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(an int64 fingerprint of the tokens, position-weighted and wrapping: equal on two ranks iff, for practical
    purposes, their tokens are; whether the first tensor holds more than one value)."""
    total = torch.zeros((), dtype=torch.int64, device=tokens[0].device)
    for t in tokens:
        flat = t.reshape(-1).long()
        # a multiplier that fits int32 (Inductor's Triton code multiplies the arange index in int32)
        weights = torch.arange(1, flat.numel() + 1, device=flat.device, dtype=torch.int64) * 40503 + 97
        total = total + (flat * weights).sum() + flat.numel()
    first = tokens[0].reshape(-1)
    return total, (first != first[:1]).any()


def check_batch(
    positions: list[torch.Tensor],
    padding_masks: list[torch.Tensor],
    tokens: list[torch.Tensor],
    cu_seqlens: torch.Tensor | None,
    *,
    layout: str,
    group_name: str,
    rank: int,
    world: int,
) -> None:
    """This step's batch against `layout` on every CP rank (the module's docstring): one all-gather of four int64,
    then one assert per rule on every rank. No outputs: the asserts are the point (they are never dropped)."""
    device = next(t.device for t in (*positions, *padding_masks, *tokens))
    true = torch.ones((), dtype=torch.bool, device=device)
    ok_positions, ok_padding = true, true
    for p in positions:
        ok_positions = ok_positions & positions_ok(p, cu_seqlens, layout=layout, rank=rank, world=world)
    for m in padding_masks:
        ok_padding = ok_padding & m.bool().all()
    mark, varied = fingerprint(tokens) if tokens else (torch.zeros((), dtype=torch.int64, device=device), ~true)
    verdicts = torch.stack([ok_positions.long(), ok_padding.long(), mark, varied.long()]).reshape(1, 4)
    gathered = all_gather_dim0(verdicts, group_name)
    if positions:
        assert_on_ranks((gathered[:, 0] == 1).all(), bad_positions_message(layout))
    if padding_masks:
        assert_on_ranks((gathered[:, 1] == 1).all(), PADDED)
    if tokens:
        same = (gathered[:, 2] == gathered[0, 2]).all() & (gathered[:, 3] == 1).all()
        assert_on_ranks(~same, unsharded_message(layout))
