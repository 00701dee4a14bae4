"""The cost of one attention site under a layout x comm x kernel: blocks, FLOPs and time per rank, bytes sent.

Everything comes from facts the project already has: the layout's blocks (the `rank_blocks` of the comm's region
for the site's family, counted by the family's costing: cost/shape.Costing), the heads each rank runs (a2a: Hq/cp,
the head-split rules of layouts/heads.py), the bytes on the wire (the comm's `wire_bytes`) and the measured kernel
rates (cost/rates.py). A rank's time is its kernel calls plus its region's own copies, plus the host time its kernel
calls cost beyond the cheapest kernel's (cuDNN's varlen op runs ~1.2 ms of Python a call: where a step is
host-bound, as at 4K tokens a rank, that is step time; at long shards its GPU saving outweighs it); the site's
estimate is the slowest rank plus the time on the wire at the assumed link bandwidth, forward + backward, with no
overlap of communication and compute assumed.

Which documents a site is costed with is its costing's word too: packed documents change every batch, and the
planner sees no document, so the varlen family's costing assumes the densest packing its bounds allow
(families/varlen/costing.py); explain() has the example batch and passes its documents.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..comm.entry import Comm
from ..comm.wire import LevelBytes, WireShape
from ..comms.registry import get_comm
from ..layouts.heads import HeadSplit
from .measured import measured_at
from .rates import host_call_ms, inter_gbps, kernel_rate, link_gbps, region_overhead_ms
from .shape import SiteShape
from .work import CallWork, flops


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
    host_ms: tuple[float, ...] = ()
    """Per rank: the host time its kernel calls cost beyond flash_varlen's (cost/rates.host_call_ms). At a few
    thousand tokens a rank the compiled step is host-bound, so that host time is step time and counts in full."""

    @property
    def total_ms(self) -> float:
        """The model's time: the slowest rank's compute plus the time on the wire (no overlap assumed). Never the
        measurement: that is the whole layer's step (projections included), comparable only with the other
        measurements at its point (cost/choose.py), not with other layouts' or sites' estimates. The host term
        is added per rank (host_ms)."""
        host = self.host_ms or (0.0,) * len(self.compute_ms)
        return max(c + h for c, h in zip(self.compute_ms, host)) + self.wire_ms

    @property
    def balance(self) -> float:
        """max / mean FLOPs over the ranks (1.0: balanced)."""
        mean = sum(self.flops) / len(self.flops)
        return max(self.flops) / mean if mean else 1.0


def _rank_heads(shape: SiteShape, caps) -> tuple[int, int]:
    if not caps.splits_heads:
        return shape.q_heads, shape.kv_heads
    over = shape.levels[1] if caps.levels and shape.levels else shape.world  # a 2-D mesh: over a node's ranks
    split = HeadSplit(shape.q_heads, shape.kv_heads, over)
    return split.q_per_rank, split.kv_per_rank


def rank_work(
    shape: SiteShape, layout: str, comm: Comm, rank: int, documents: torch.Tensor | None
) -> tuple[int, CallWork]:
    """(blocks, their counts) of one rank under `comm`'s region for the site's family, as its costing counts them
    (`documents`: what `Costing.documents` gave)."""
    levels = {"levels": shape.levels} if comm.capabilities.levels else {}  # a comm on a 2-D CP mesh
    region = comm.regions[shape.costing.family]
    return shape.costing.rank_work(shape, layout, region, rank, documents, **levels)


def wire_shape(shape: SiteShape, layout: str, comm: str) -> WireShape:
    """The site under `layout` as `comm`'s wire_bytes reads it (its family's costing fills the family's fields)."""
    return shape.costing.wire(shape, layout, get_comm(comm).capabilities.lse_on_demand)


def estimate(shape: SiteShape, layout: str, comm: str, kernel: str, cu_seqlens: torch.Tensor | None = None) -> Estimate:
    """The cost of the site under `layout`, `comm` and `kernel` on every rank (sites with documents: with these
    GLOBAL cu_seqlens, else what their costing assumes). The caller checked that the comm takes the layout and
    heads."""
    entry = get_comm(comm)
    documents, described = shape.costing.documents(shape, layout, cu_seqlens)
    q_heads, kv_heads = _rank_heads(shape, entry.capabilities)
    rate = kernel_rate(kernel, shape.costing.kernels)
    wire = wire_shape(shape, layout, comm)
    fwd, bwd = entry.wire_bytes(wire)
    levels = entry.level_bytes(wire) if entry.level_bytes is not None else ()
    exchanged = (fwd + bwd) * shape.world // (shape.world - 1)
    overhead, _ = region_overhead_ms(entry.overhead_as or comm, kernel if rate.proxy_for is None else rate.name,
                                     exchanged)  # fmt: skip
    blocks, work_flops, times, host = [], [], [], []
    for rank in range(shape.world):
        n, work = rank_work(shape, layout, entry, rank, documents)
        blocks.append(n)
        work_flops.append(flops(work.pairs, q_heads, shape.head_dim, shape.v_head_dim))  # batch counted in work
        times.append(rate.ms(work, q_heads, shape.head_dim, shape.v_head_dim) + overhead)
        host.append(host_call_ms(kernel) * work.calls)
    rates = rate.name if rate.proxy_for is None else f"{rate.name} (proxy: {kernel} has no measured rate)"
    wire_ms = wire_time_ms(fwd + bwd, levels, shape.levels, comm)
    return Estimate(layout, comm, kernel, rates, tuple(blocks), tuple(work_flops), tuple(times), fwd, bwd, wire_ms,
                    described, levels, measured_at(shape, layout, comm, kernel), tuple(host))  # fmt: skip


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
