"""Run-time guards the pass inserts next to the regions: checks every rank makes together, so a bad input is
an error on every rank (never a hang on one rank waiting for another, never a silently wrong answer).

Each guard gathers a few int64 values from every rank of the CP group (one small collective) and asserts on
device (`torch._assert_async`: no host sync; on CPU it raises at once, on CUDA it fails the stream) that
they agree, before the region's own collectives run. Here: the packed metadata and torch.cond conditions; the
batch itself (positions, padding, an unsharded batch) is batch_check.py's.
"""

from __future__ import annotations

import torch

from ..comm.collectives import all_gather_dim0
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
