"""The host work of a packed region's kernel calls stays a handful of ops a ring step.

Compiled, a region's own ops are Inductor kernels; the inside of the executor's custom ops runs eagerly, op by
op, at every ring step. On the H200 ring over thd_zigzag at 32K/cp=8 was host-bound (28.3 ms wall against 8.5
ms of GPU work a step) with the block metadata (masks, cu_seqlens, cuDNN's lse slots: scatters, scans, casts)
built inside the ops: 43 + 66 ops a step (forward + backward, rank 0, counted by tests/support/host_ops.py).
The regions now build it once per batch in their graph (executor.prepare_blocks); the ops only read it.
Counted on cudnn_varlen's CPU stand-in (its kernel one op), causal, cp=8, through the opaque executor ops (the
path of a provider that cannot be traced; a traceable one runs no executor op at all at run time: its calls are
graph nodes, tests/unit/test_traced_executor.py).
"""

from __future__ import annotations

import pytest

from cpcompile.comms.ring.schedule import packed_visited_steps
from cpcompile.layouts.block import NO_WINDOW
from tests.support.host_ops import LENGTHS, count_region

METADATA_OPS = ("scatter", "cumsum", "arange", "stack", "cat", "clamp", "unbind", "index.Tensor")
"""What building block metadata dispatches (range_ids, cu_seqlens, lse slots); an op call must run none."""

# (comm, layout, rank) -> most ops a step may dispatch inside the executor ops (forward, backward), steps after
# the first; then the first step's. Measured now: ring thd_zigzag rank 0 (15, 18) / (11, 16), rank 7 (11, 20) /
# (11, 16); ring thd rank 7 (15, 22) / (11, 16); all_gather, one step: (11, 18), thd rank 7 (11, 22). Of those, one
# multiply a ragged tensor a call (5 forward, 7 backward) makes cuDNN's element offsets from the prepared prefix
# columns (kernels/cudnn_graph.ragged_metadata): they need the call's strides, and on cuDNN's real, traced path
# Inductor compiles them with the region. Before the metadata moved out: ring thd_zigzag rank 0 (43, 66) /
# (102, 133), rank 7 (18, 71); ring thd rank 7 (43, 90); all_gather (14, 39). These blocks are below
# cudnn_varlen.SPLIT_MIN_ROWS; split in two (threshold 0), all_gather's causal blocks with cut pieces dispatch
# (49, 38), thd rank 7 (49, 42): the merge and gradient sums, one fused kernel each on the traced path.
BUDGETS = {
    ("ring", "thd_zigzag", 0): ((17, 20), (32, 36)),
    ("ring", "thd_zigzag", 7): ((13, 22), (32, 36)),
    ("ring", "thd", 7): ((17, 24), (13, 18)),
    ("all_gather", "thd_zigzag", 0): (None, (13, 20)),
    ("all_gather", "thd_balanced", 0): (None, (13, 20)),
    ("all_gather", "thd", 7): (None, (13, 24)),
}


@pytest.mark.parametrize("comm,layout,rank", list(BUDGETS))
def test_each_kernel_call_reads_prepared_metadata(comm, layout, rank, monkeypatch):
    from cpcompile.kernels.cudnn_varlen import CuDNNVarlenKernel

    monkeypatch.setattr(CuDNNVarlenKernel, "traceable", False)  # the opaque ops, whose inside runs each step
    later, first = BUDGETS[(comm, layout, rank)]
    count = count_region(comm, layout, world=8, rank=rank)
    forward, backward = count.per_call("attend_varlen_blocks"), count.per_call("attend_varlen_blocks_backward")
    # every visited step has blocks at these ranks (thd: the steps its longest document reaches, 5 of 8)
    steps = (
        len(packed_visited_steps(layout, sum(LENGTHS) // 8, 8, NO_WINDOW, True, max(LENGTHS))) if comm == "ring" else 1
    )
    assert len(forward) == len(backward) == steps, (forward, backward)
    built = {name for names in count.call_names for name in names if any(op in name for op in METADATA_OPS)}
    assert not built, f"an executor op built block metadata on the host: {sorted(built)}"
    assert forward[0] <= first[0] and backward[0] <= first[1], f"the first step: {forward}, {backward}"
    for f, b in zip(forward[1:], backward[1:]):
        assert f <= later[0] and b <= later[1], f"a ring step dispatches {f} + {b} ops: {forward}, {backward}"
