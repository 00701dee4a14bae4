"""How many times CP rounds an output or gradient element to bf16, for the bf16 rule of tests/support/parity.py.

A GPU kernel hands back its output and gradients in the input dtype, rounded once (it accumulates in fp32).
One device runs one kernel call per element: one rounding. CP runs several calls whose results meet in one
element (the blocks of a q row; every rank's blocks that read a key, then the reduce-scatter): each call's
partial is rounded to bf16 by the kernel, the executor and the reduce-scatter sum them in fp32, and the sum is
rounded once more. The dense counts are upper bounds derived from the same index math the executor runs
(`layout.blocks`, `exchange_blocks`, the a2a head split), so a new chunk layout gets its count without a
table; the packed counts follow from one varlen call a rank and thd_zigzag's two key copies (stated below).
"""

from __future__ import annotations

from collections import Counter

from cpcompile.comms.a2a.schedule import buffer_chunks, exchange_blocks, exchange_slots
from cpcompile.comms.hierarchical.levels import level_layout
from cpcompile.comms.ring.schedule import held_rank, ring_blocks
from cpcompile.layouts import get_layout
from cpcompile.layouts.heads import HeadSplit


def roundings(partials: int) -> int:
    """bf16 roundings of an element that sums `partials` kernel results: one partial is returned as it is."""
    return 1 if partials <= 1 else partials + 1


def _max_count(counter: Counter) -> int:
    return max(counter.values(), default=1)


def dense_partials(
    layout_name: str, comm: str, cp: int, causal: bool, hq: int, hkv: int, levels: tuple[int, int] | None = None
) -> dict[str, int]:
    """Most kernel partials summed into one element of out / dq (per q row) and dk / dv (per key); `levels`: a 2-D
    CP mesh's (inter, intra) for comm="hierarchical" (the ring's steps over the nodes, heads split in a node)."""
    layout = get_layout(layout_name)
    rows: Counter = Counter()
    keys: Counter = Counter()

    def count(q_group, blocks, source_chunks: list[list[int]]) -> None:
        """Tally each block's q rows (within q_group) and the global key chunks it reads (by source index)."""
        for b in blocks:
            rows.update((q_group, pos) for pos in range(b.q_start, b.q_start + b.q_len))
            keys.update(source_chunks[b.source][b.kv_start : b.kv_start + b.kv_len])

    kv_copies = 1
    if comm == "all_gather":
        gathered = [layout.source_chunks(slot, cp) for slot in range(layout.chunks_per_rank)]
        for rank in range(cp):  # chunk units: one "token" per chunk; source 0 = local, 1 + i = gathered slot i
            count(rank, layout.blocks(cp, rank, 1, causal), [list(layout.rank_chunks(rank, cp)), *gathered])
    elif comm == "a2a":
        buffers = [buffer_chunks(layout, cp, slots) for slots in exchange_slots(layout, causal)]
        for qb, blocks in enumerate(exchange_blocks(buffers, 1, causal)):
            count(qb, blocks, buffers)
        kv_copies = HeadSplit(hq, hkv, cp).kv_replicas  # a replicated kv head's gradient sums over its ranks
    elif comm == "ring":  # every step's blocks against the held rank's chunks (source 0)
        for rank in range(cp):
            for step, blocks in enumerate(ring_blocks(layout, cp, rank, 1, causal)):
                count(rank, blocks, [list(layout.rank_chunks(held_rank(rank, step, cp), cp))])
    elif comm == "hierarchical":  # the ring over the nodes, each node's chunks in global order (hierarchical/levels.py)
        nodes, per_node = levels
        node = level_layout(layout, nodes, per_node)
        for p in range(nodes):
            for step, blocks in enumerate(ring_blocks(node, nodes, p, 1, causal)):
                count(p, blocks, [list(node.rank_chunks(held_rank(p, step, nodes), nodes))])
        kv_copies = HeadSplit(hq, hkv, per_node).kv_replicas
    else:
        raise ValueError(f"unknown comm {comm!r}")
    q_side, k_side = _max_count(rows), _max_count(keys) * kv_copies
    return {"out": q_side, "dq": q_side, "dk": k_side, "dv": k_side}


def packed_partials(strategy: str, comm: str, cp: int, hq: int, hkv: int) -> dict[str, int]:
    """Same for packed documents: one varlen call a rank, so a q row has one partial. A key gets one partial
    from every rank (all_gather: each rank's call reads the whole gathered buffer; thd_zigzag's key buffer holds
    a key up to twice), or, under a2a, one per rank holding a replica of its kv head."""
    if comm == "a2a":
        keys = HeadSplit(hq, hkv, cp).kv_replicas
    else:
        keys = cp * (2 if strategy == "thd_zigzag" else 1)
    return {"out": 1, "dq": 1, "dk": keys, "dv": keys}
