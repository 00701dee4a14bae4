"""GPU: the stand-in link group's CUDA path (cpcompile/testing/link_group.py), which bench/overlap.py measures with.
A collective occupies its side stream for bytes / bandwidth; the issuing stream is not blocked until the result is
waited, and then waits for the whole link time; eagerly and from an Inductor-compiled graph; with the link off it
costs nothing. Lower bounds and orderings only (other tests may share the GPU: a sleep can last longer, never
shorter)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from cpcompile.testing.link_group import calibrate, link_group
from cpcompile.testing.link_model import Topology

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# 1 MiB all-gathered over 4 ranks at 0.01 GB/s: 3 MiB sent, ~315 ms on the link (long against the GPU time
# slices of the other tests' processes)
TOPO = Topology(per_node=4, intra_gbps=0.01, inter_gbps=0.01)
LINK_MS = 3 * 2**20 / 0.01e9 * 1e3


def _elapsed(fn) -> tuple[float, float]:
    """(ms until fn returned its marker on the current stream, ms until the stream finished fn's work)."""
    torch.cuda.synchronize()
    start, marker, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    start.record()
    fn(marker)
    end.record()
    end.synchronize()
    return start.elapsed_time(marker), start.elapsed_time(end)


def test_calibrated_sleep_clock_is_a_gpu_clock():
    cycles_per_ms = calibrate()
    assert 2e5 < cycles_per_ms < 5e6, cycles_per_ms  # 0.2 to 5 GHz


def test_a_collective_occupies_the_link_until_waited_eager_and_compiled():
    x = torch.ones(2**18, device="cuda")  # 1 MiB of fp32
    with link_group(0, 4, TOPO) as link:
        name = dist.group.WORLD.group_name

        def eager(marker):
            pending = torch.ops._c10d_functional.all_gather_into_tensor(x, 4, name)
            marker.record()  # issued, not waited: the stream runs on
            torch.ops._c10d_functional.wait_tensor(pending)

        issued, waited = _elapsed(eager)
        assert issued < 0.5 * LINK_MS and waited >= 0.8 * LINK_MS, (issued, waited, LINK_MS)

        compiled = torch.compile(lambda t: funcol.all_gather_tensor(t, 0, name) + 1, backend="inductor")
        compiled(x)  # compile
        _, waited = _elapsed(lambda marker: (compiled(x), marker.record()))
        assert waited >= 0.8 * LINK_MS, (waited, LINK_MS)

        link.enabled = False  # compute only: nothing on the link
        _, off = _elapsed(lambda marker: (compiled(x), marker.record()))
        assert off < 0.2 * LINK_MS, (off, LINK_MS)

        link.enabled = True
        link.record()
        compiled(x)
        sent = link.stop()
        assert link.waits == len(sent) == 1 and sent[0].bytes == 3 * 2**20
        assert link.measured_ms() >= 0.8 * LINK_MS
