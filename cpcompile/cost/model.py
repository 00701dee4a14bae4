"""The cost of one attention site under a layout x comm x kernel: blocks, FLOPs and time per rank, bytes sent.

Everything comes from facts the project already has: the layout's blocks (dense: the `rank_blocks` of the comm's
sdpa region; packed: of its varlen region, over the documents), the heads each rank runs (a2a: Hq/cp, the head-split
rules of layouts/heads.py), the bytes on the wire (the comm's `wire_bytes`) and the measured kernel rates
(cost/rates.py). A rank's time is its kernel calls plus its region's own copies; the site's estimate is the
slowest rank plus the time on the wire at the assumed link bandwidth, forward + backward, with no overlap of
communication and compute assumed.

Packed documents change every batch, and the planner sees no document: it estimates with documents of the
call's max_q/max_k (`max_doc`, the longest a batch may hold; the whole packed length without it), the densest
packing the bounds allow (`assumed_documents`). explain() has the example batch, so it also estimates with its
documents.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..comm.wire import LevelBytes, WireShape
from ..comms.registry import get_comm
from ..layouts.block import NO_WINDOW
from ..layouts.heads import HeadSplit
from ..layouts.thd import get_packed_layout
from .measured import measured_at
from .rates import inter_gbps, kernel_rate, link_gbps, region_overhead_ms
from .work import CallWork, dense_work, flops, varlen_work


@dataclass(frozen=True)
class SiteShape:
    """What the cost model needs of a site: this rank's shapes, element sizes, the mask and the CP world."""

    kind: str
    """The attention family (families/registry.py) whose comm regions' blocks are counted: "sdpa" (dense blocks)
    or "varlen" (packed documents); a family builds its SiteShape (Family.cost_shape)."""
    batch: int
    tokens: int
    """Local tokens a rank (sequence dim of SDPA q; packed length of varlen q)."""
    q_heads: int
    kv_heads: int
    head_dim: int
    v_head_dim: int
    elt: int
    acc_elt: int
    causal: bool
    world: int
    window: tuple[int, int] = NO_WINDOW
    max_doc: int | None = None
    return_lse: bool = True
    levels: tuple[int, int] | None = None
    """A 2-D CP mesh's (inter, intra) sizes (world = their product; mesh.CPGroup.levels), else None."""

    @property
    def block_window(self) -> tuple[int, int] | None:
        """The window as the layouts' block functions take it (None: no window)."""
        return None if self.window == NO_WINDOW else self.window


@dataclass(frozen=True)
class Estimate:
    """One layout x comm x kernel for one site: per-rank blocks, FLOPs and time, and the bytes on the wire."""

    layout: str
    comm: str
    kernel: str
    rates: str
    """Whose rates timed the kernel calls (a proxy's name when the kernel has no measurement of its own)."""
    blocks: tuple[int, ...]
    flops: tuple[float, ...]
    """Forward + backward FLOPs a rank computes (the mask's kept pairs only)."""
    compute_ms: tuple[float, ...]
    """Per rank: its kernel calls plus its region's copies, forward + backward."""
    sent_fwd: int
    sent_bwd: int
    """Bytes a rank sends per forward / per backward (the same on every rank)."""
    wire_ms: float
    documents: str
    """Which documents a packed site was costed with ("" for dense sites)."""
    levels: tuple[LevelBytes, ...] = ()
    """A comm on a 2-D CP mesh: what a rank sends on each level (sent_fwd / sent_bwd are their sums)."""
    measured_ms: float | None = None
    """The step time bench/overlap.py measured at exactly this site, comm and kernel (cost/measured.py), if any."""

    @property
    def total_ms(self) -> float:
        """The model's time: the slowest rank's compute plus the time on the wire (no overlap assumed). Never the
        measurement: that is the whole layer's step (projections included), comparable only with the other
        measurements at its point (cost/choose.py), not with other layouts' or sites' estimates."""
        return max(self.compute_ms) + self.wire_ms

    @property
    def balance(self) -> float:
        """max / mean FLOPs over the ranks (1.0: balanced)."""
        mean = sum(self.flops) / len(self.flops)
        return max(self.flops) / mean if mean else 1.0


def assumed_documents(total: int, max_doc: int | None) -> torch.Tensor:
    """cu_seqlens of documents of `max_doc` tokens filling `total` (the last one shorter): what the planner
    costs packed sites with, knowing only the bounds."""
    size = total if max_doc is None else max(1, min(max_doc, total))
    cuts = list(range(0, total, size)) + [total]
    return torch.tensor(cuts, dtype=torch.int64)


def _rank_heads(shape: SiteShape, caps) -> tuple[int, int]:
    if not caps.splits_heads:
        return shape.q_heads, shape.kv_heads
    over = shape.levels[1] if caps.levels and shape.levels else shape.world  # a 2-D mesh: over a node's ranks
    split = HeadSplit(shape.q_heads, shape.kv_heads, over)
    return split.q_per_rank, split.kv_per_rank


def _rank_work(shape: SiteShape, layout: str, comm, rank: int, cu: torch.Tensor | None) -> tuple[int, CallWork]:
    """(blocks, their counts) of one rank."""
    levels = {"levels": shape.levels} if comm.capabilities.levels else {}  # a comm on a 2-D CP mesh
    if shape.kind == "sdpa":
        blocks = comm.regions[shape.kind].rank_blocks(
            layout, shape.causal, rank, shape.world, shape.tokens, shape.block_window, **levels
        )
        return len(blocks), dense_work(blocks, shape.batch)
    blocks = comm.regions[shape.kind].rank_blocks(
        layout, shape.causal, rank, shape.world, shape.tokens, cu, shape.max_doc, shape.window, **levels
    )
    total = CallWork()
    for block in blocks:
        total = total + varlen_work(block)
    return len(blocks), total


def estimate(shape: SiteShape, layout: str, comm: str, kernel: str, cu_seqlens: torch.Tensor | None = None) -> Estimate:
    """The cost of the site under `layout`, `comm` and `kernel` on every rank (packed sites: with these GLOBAL
    cu_seqlens, else `assumed_documents`). The caller checked that the comm takes the layout and heads."""
    entry = get_comm(comm)
    documents = ""
    if shape.kind == "varlen":
        packed, total = get_packed_layout(layout), shape.tokens * shape.world
        if cu_seqlens is None:
            cu_seqlens = assumed_documents(total, shape.max_doc)
            documents = f"assumed: documents of {int((cu_seqlens[1:] - cu_seqlens[:-1]).max())} tokens"
            if packed.carries_plan:  # thd_balanced: the plan shard_batch would make of them
                cu_seqlens = packed.prepare(cu_seqlens, total, shape.world)
        else:
            offsets = packed.offsets(cu_seqlens, shape.world) if packed.is_plan(cu_seqlens) else cu_seqlens
            documents = f"this batch's {offsets.numel() - 1} documents"
        cu_seqlens = cu_seqlens.long().cpu()
    q_heads, kv_heads = _rank_heads(shape, entry.capabilities)
    rate = kernel_rate(kernel, "varlen" if shape.kind == "varlen" else "dense")
    wire = WireShape(
        shape.tokens, shape.batch, shape.q_heads, shape.kv_heads, shape.head_dim, shape.v_head_dim, shape.world,
        shape.elt, shape.acc_elt, shape.kind == "varlen" and shape.return_lse and entry.capabilities.lse_on_demand,
        max_doc=shape.max_doc if shape.kind == "varlen" else None,
        dense_mask=(layout, shape.causal, shape.block_window) if shape.kind == "sdpa" else None,
        packed_mask=(layout, shape.causal, shape.window) if shape.kind == "varlen" else None,
        levels=shape.levels,
    )  # fmt: skip
    fwd, bwd = entry.wire_bytes(wire)
    levels = entry.level_bytes(wire) if entry.level_bytes is not None else ()
    exchanged = (fwd + bwd) * shape.world // (shape.world - 1)
    overhead, _ = region_overhead_ms(entry.overhead_as or comm, kernel if rate.proxy_for is None else rate.name,
                                     exchanged)  # fmt: skip
    blocks, work_flops, times = [], [], []
    for rank in range(shape.world):
        n, work = _rank_work(shape, layout, entry, rank, cu_seqlens)
        blocks.append(n)
        work_flops.append(flops(work.pairs, q_heads, shape.head_dim, shape.v_head_dim))  # batch counted in work
        times.append(rate.ms(work, q_heads, shape.head_dim, shape.v_head_dim) + overhead)
    rates = rate.name if rate.proxy_for is None else f"{rate.name} (proxy: {kernel} has no measured rate)"
    wire_ms = wire_time_ms(fwd + bwd, levels, shape.levels, comm)
    return Estimate(layout, comm, kernel, rates, tuple(blocks), tuple(work_flops), tuple(times), fwd, bwd, wire_ms,
                    documents, levels, measured_at(shape, layout, comm, kernel))  # fmt: skip


ALL_TO_ALL = ("a2a", "selective")
"""The 1-D comms whose collectives are all-to-alls: on a 2-D mesh their bytes to peers on the rank's node move
on the intra-node link while the rest cross nodes (the others' collectives, all-gathers and the ring's shifts,
run at the slowest link they cross)."""


def wire_time_ms(sent: int, levels: tuple[LevelBytes, ...], mesh: tuple[int, int] | None, comm: str) -> float:
    """Milliseconds on the wire of `sent` bytes a rank: one link (`link_gbps`) on a 1-D CP group; on a 2-D CP mesh
    (inter, intra) a level comm's bytes each on its level's link (cp_intra: `link_gbps`, cp_inter:
    `inter_gbps`), a 1-D comm's over the flattened group, which crosses nodes."""
    intra, inter = link_gbps() * 1e6, inter_gbps() * 1e6
    if levels:
        return sum((lv.fwd + lv.bwd) / (intra if lv.dim == "cp_intra" else inter) for lv in levels)
    if mesh is None or mesh[0] == 1:
        return sent / intra
    if comm in ALL_TO_ALL:  # equal parts to the world - 1 others, intra - 1 of them on the node
        world = mesh[0] * mesh[1]
        local = sent * (mesh[1] - 1) // (world - 1)
        return max(local / intra, (sent - local) / inter)
    return sent / inter
