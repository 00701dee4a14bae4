"""The varlen executor's per-block metadata: everything its kernel calls and masks derive from the ranges alone.

A block's masks (which q rows and which keys lie in a range with both queries and keys) and its provider's
prepared tensors (kernels.base.VarlenAttentionKernel.prepare: cu_seqlens, cuDNN's lse slots) depend on its
ranges only, not on q/k/v. Built inside the executor op they were eager host work at every call: scatters,
scans and casts around each kernel, at every ring step (the H200 profile of ring over thd_zigzag: host-bound).
The regions build them with `prepare_blocks` in their graph instead, once per batch (Inductor compiles them),
and hand the flat list to the ops, whose per-call host work is then the kernel's own and a few masked copies.

The list, per block in order: its row mask (T_q,) bool unless it vouches for its rows (`covers_rows`), its key
mask (T_k,) bool unless it vouches for its keys (`covers_keys`), then its provider's `prepared_count` tensors.
The ops cut it back with `split_blocks`; both read the same static block encoding, so the two cannot disagree.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from ..kernels import get_varlen_kernel
from ..kernels.base import range_ids
from .blocks import VarlenSpec, decode_varlen


class BlockMeta(NamedTuple):
    """One block's metadata: row / key masks (None: the block vouches for that side) and the provider's tensors."""

    rows: torch.Tensor | None
    keys: torch.Tensor | None
    prepared: list[torch.Tensor]


def _covered_side(starts, ends, live: torch.Tensor, length: int) -> torch.Tensor:
    """(length,) bool: rows (keys) of this side inside a `live` range (one with both queries and keys)."""
    ids = range_ids(starts, ends, length)
    return (ids >= 0) & live[ids.clamp(min=0)]


def block_masks(
    ranges: torch.Tensor, tq: int, tk: int, covers: tuple[bool, bool]
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The (row, key) masks of a block: None on a side it vouches it covers (nothing to mask there)."""
    if all(covers):
        return None, None
    qs, qe, ks, ke = ranges
    live = (qe > qs) & (ke > ks)
    rows = None if covers[0] else _covered_side(qs, qe, live, tq)
    keys = None if covers[1] else _covered_side(ks, ke, live, tk)
    return rows, keys


def _prepare_one(impl, ranges: torch.Tensor, spec: VarlenSpec, tq: int, tk: int) -> BlockMeta:
    rows, keys = block_masks(ranges, tq, tk, (spec.covers_rows, spec.covers_keys))
    return BlockMeta(rows, keys, impl.prepare(ranges, tq, tk, spec.max_q, **spec.kernel_kwargs()))


def prepare_blocks(
    ranges: Sequence[torch.Tensor], blocks: list[int], tq: int, tks: Sequence[int], kernel: str
) -> list[torch.Tensor]:
    """The flat metadata list of `blocks` (executor.blocks encoding) for q of `tq` rows and sources of `tks`
    keys on provider `kernel`: device ops with static shapes, no host sync (a region traces them into its graph)."""
    impl = get_varlen_kernel(kernel)
    flat: list[torch.Tensor] = []
    for r, spec in zip(ranges, decode_varlen(blocks)):
        rows, keys, prepared = _prepare_one(impl, r, spec, tq, tks[spec.source])
        flat += [m for m in (rows, keys) if m is not None] + list(prepared)
    return flat


def _count(spec: VarlenSpec, impl) -> int:
    return (not spec.covers_rows) + (not spec.covers_keys) + impl.prepared_count(**spec.kernel_kwargs())


def split_blocks(meta: Sequence[torch.Tensor], specs: Sequence[VarlenSpec], impl) -> list[BlockMeta]:
    """`prepare_blocks`'s flat list cut back into one BlockMeta a block (`impl`: the provider it was made for)."""
    need = sum(_count(spec, impl) for spec in specs)
    assert len(meta) == need, f"{len(meta)} metadata tensors for blocks that take {need}: not prepare_blocks' list"
    out, at = [], 0
    for spec in specs:
        rows = None if spec.covers_rows else meta[at]
        at += rows is not None
        keys = None if spec.covers_keys else meta[at]
        at += keys is not None
        n = impl.prepared_count(**spec.kernel_kwargs())
        out.append(BlockMeta(rows, keys, list(meta[at : at + n])))
        at += n
    return out
