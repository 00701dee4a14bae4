"""What a link would spend on one collective: the bytes this rank sends to each peer, and the seconds they take on
an intra-node or an inter-node link (the stand-in link group's arithmetic, cpcompile/testing/link_group.py).

A topology is nodes of `per_node` consecutive global ranks, an intra-node bandwidth and an inter-node bandwidth,
each in GB/s one rank sends (one direction; a link is full duplex, so what a rank receives travels at the same
time). A collective's time is its bytes over the bandwidth of the links it needs, and a collective completes only
when every rank's share has arrived, so one process standing in for its group charges the slowest rank's time:

- ring collectives (all-gather, reduce-scatter, all-reduce): NCCL's ring crosses every link of the group in turn,
  so a group spanning nodes moves all its bytes at the inter-node bandwidth, one inside a node at the intra-node
  one;
- all-to-all: the bytes a rank sends to peers on its node and to peers on other nodes travel at the same time on
  the two links; the time is the slower of the two, and the slowest rank's (the other ranks' splits are taken as
  this rank's rotated: exact for equal splits and for the ring's shift, the all-to-alls cpcompile issues).
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9

NVLINK4_GBPS = 300.0
"""An H100/H200 GPU's NVLink 4 bandwidth in one direction is 450 GB/s (18 links x 25 GB/s); what NCCL delivers of
it to a rank is taken as 300 GB/s, the cost model's assumption (cpcompile/cost/rates.json: not measured here, one
GPU is lent), so the bench measures at the link the planner assumes."""
IB_400G_GBPS = 50.0
"""One 400 Gb/s InfiniBand NIC a GPU (ConnectX-7, the usual H100/H200 node): 50 GB/s in one direction, the cost
model's inter-node assumption (cpcompile/cost/rates.py: inter_gbps)."""


@dataclass(frozen=True)
class Topology:
    """Nodes of `per_node` consecutive global ranks; GB/s one rank sends inside a node and across nodes."""

    per_node: int
    intra_gbps: float = NVLINK4_GBPS
    inter_gbps: float = IB_400G_GBPS

    def __post_init__(self) -> None:
        if self.per_node < 1 or self.intra_gbps <= 0 or self.inter_gbps <= 0:
            raise ValueError(f"a topology needs per_node >= 1 and positive bandwidths, got {self}")

    def spans_nodes(self, ranks: list[int]) -> bool:
        """Whether the global `ranks` of a group sit on more than one node."""
        return len({r // self.per_node for r in ranks}) > 1

    def describe(self, world: int) -> str:
        """E.g. `2x4 (intra 350 GB/s, inter 50 GB/s)`."""
        nodes = -(-world // self.per_node)
        return f"{nodes}x{min(world, self.per_node)} (intra {self.intra_gbps:g} GB/s, inter {self.inter_gbps:g} GB/s)"


RING = ("all_gather", "reduce_scatter", "all_reduce")
KINDS = (*RING, "all_to_all")


def sent_to_peers(kind: str, size: int, me: int, nbytes: int, splits: list[int] | None = None) -> list[int]:
    """Bytes group rank `me` of `size` sends to each group rank (its own entry 0) for one collective.

    `nbytes`: the input's bytes (all_to_all: the bytes of one row of dim 0 when `splits` are given, the input's
    bytes when not, sent in `size` equal parts); `splits`: all_to_all's input split sizes (rows to each rank)."""
    if kind not in KINDS:
        raise ValueError(f"unknown collective {kind!r} (one of {KINDS})")
    if kind == "all_to_all":
        if splits is None:
            if nbytes % size:
                raise ValueError(f"an equal-split all_to_all of {nbytes} bytes does not split over {size} ranks")
            per = [nbytes // size] * size
        else:
            if len(splits) != size:
                raise ValueError(f"all_to_all splits {splits} name {len(splits)} ranks, the group has {size}")
            per = [s * nbytes for s in splits]
    elif kind == "all_gather":
        per = [nbytes] * size  # the whole input to every other rank
    elif kind == "reduce_scatter":
        per = [nbytes // size] * size  # each rank's slice of the input to that rank
    else:  # ring all-reduce: reduce-scatter then all-gather of the slices, 2 (n - 1) / n of the input in all
        per = [2 * nbytes // size] * size
    per[me] = 0
    return per


def collective_seconds(kind: str, ranks: list[int], me: int, per_peer: list[int], topo: Topology) -> float:
    """Seconds the group's links spend on one collective, `per_peer` being what group rank `me` sends to each
    group rank (`sent_to_peers`) and `ranks` the group's global ranks (module docstring: the rules)."""
    size = len(ranks)
    if kind in RING:
        gbps = topo.inter_gbps if topo.spans_nodes(ranks) else topo.intra_gbps
        return sum(per_peer) / (gbps * GB)
    worst = 0.0
    for sender in range(size):  # rank `sender` sends to sender + d what `me` sends to me + d
        local = remote = 0
        for d in range(1, size):
            nbytes = per_peer[(me + d) % size]
            same_node = ranks[sender] // topo.per_node == ranks[(sender + d) % size] // topo.per_node
            if same_node:
                local += nbytes
            else:
                remote += nbytes
        worst = max(worst, local / (topo.intra_gbps * GB), remote / (topo.inter_gbps * GB))
    return worst


def sleep_cycles(seconds: float, cycles_per_ms: float) -> int:
    """GPU clock cycles of a `torch.cuda._sleep` lasting `seconds` (0 for nothing to send)."""
    return max(0, round(seconds * 1e3 * cycles_per_ms))
