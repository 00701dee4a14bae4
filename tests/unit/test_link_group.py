"""The stand-in link group (cpcompile/testing/link_group.py, link_model.py) on CPU: the bytes a rank sends per
collective, the seconds they take on an intra- or inter-node link, and that functional collectives, eager and
compiled, and a DeviceMesh's groups reach it with the right links. The CUDA sleeps run in bench/overlap.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import init_device_mesh

from cpcompile.testing.link_group import link_group
from cpcompile.testing.link_model import Topology, collective_seconds, sent_to_peers, sleep_cycles

TOPO = Topology(per_node=2, intra_gbps=100, inter_gbps=10)


def test_bytes_a_rank_sends_per_collective():
    assert sent_to_peers("all_gather", 4, 1, 100) == [100, 0, 100, 100]
    assert sent_to_peers("reduce_scatter", 4, 0, 400) == [0, 100, 100, 100]
    assert sent_to_peers("all_reduce", 4, 0, 400) == [0, 200, 200, 200]
    assert sent_to_peers("all_to_all", 4, 2, 400) == [100, 100, 0, 100]
    assert sent_to_peers("all_to_all", 4, 2, 8, [0, 0, 5, 3]) == [0, 0, 0, 24]  # rows x row bytes, self free
    with pytest.raises(ValueError, match="does not split"):
        sent_to_peers("all_to_all", 4, 0, 10)
    with pytest.raises(ValueError, match="unknown collective"):
        sent_to_peers("broadcast", 4, 0, 10)


def test_ring_collectives_run_at_the_slowest_link_they_cross():
    per_peer = sent_to_peers("all_gather", 2, 0, 1000)
    assert collective_seconds("all_gather", [0, 1], 0, per_peer, TOPO) == pytest.approx(1000 / 100e9)  # one node
    assert collective_seconds("all_gather", [1, 2], 0, per_peer, TOPO) == pytest.approx(1000 / 10e9)  # two nodes
    per_peer = sent_to_peers("all_gather", 4, 0, 1000)
    assert collective_seconds("all_gather", [0, 1, 2, 3], 0, per_peer, TOPO) == pytest.approx(3000 / 10e9)


def test_all_to_all_overlaps_its_two_links_and_charges_the_slowest_rank():
    # equal splits on 2x2: each rank sends 1 part inside its node, 2 across: the inter link is the slower
    per_peer = sent_to_peers("all_to_all", 4, 0, 4000)
    assert collective_seconds("all_to_all", [0, 1, 2, 3], 0, per_peer, TOPO) == pytest.approx(2000 / 10e9)
    # the ring's shift by one: rank 0 sends inside its node, but rank 1 sends across; the step waits for it
    shift = sent_to_peers("all_to_all", 4, 0, 1, [0, 1000, 0, 0])
    assert collective_seconds("all_to_all", [0, 1, 2, 3], 0, shift, TOPO) == pytest.approx(1000 / 10e9)
    # inside one node the shift is NVLink-fast
    assert collective_seconds("all_to_all", [0, 1], 0, [0, 1000], TOPO) == pytest.approx(1000 / 100e9)
    # on one node of 4 a shift by two stays on NVLink
    one_node = Topology(per_node=4, intra_gbps=100, inter_gbps=10)
    assert collective_seconds("all_to_all", [0, 1, 2, 3], 0, [0, 0, 1000, 0], one_node) == pytest.approx(1e-8)


def test_sleep_cycles_and_topology_checks():
    assert sleep_cycles(1e-3, 1.98e6) == 1_980_000
    assert sleep_cycles(0.0, 1.98e6) == 0
    assert TOPO.describe(4) == "2x2 (intra 100 GB/s, inter 10 GB/s)"
    with pytest.raises(ValueError):
        Topology(per_node=0)


def test_functional_collectives_reach_the_group_eager_and_compiled():
    with link_group(1, 4, TOPO) as link:
        name = dist.group.WORLD.group_name
        assert dist.group.WORLD.stands_in_for_peers  # cpcompile's rank agreement has no peer to wait for
        x = torch.arange(8.0).view(4, 2)
        c10d = torch.ops._c10d_functional
        link.record()
        gathered = c10d.wait_tensor(c10d.all_gather_into_tensor(x, 4, name))
        assert torch.equal(gathered, x.repeat(4, 1))  # every slot a copy of this rank's input, as the fake group
        assert c10d.wait_tensor(c10d.reduce_scatter_tensor(x, "sum", 4, name)).shape == (1, 2)
        assert funcol.all_to_all_single(x, None, None, name).wait().shape == (4, 2)
        shifted = c10d.wait_tensor(c10d.all_to_all_single(x.view(-1), [8, 0, 0, 0], [0, 0, 8, 0], name))
        assert shifted.shape == (8,)

        def f(t):
            return funcol.all_gather_tensor(t, 0, name) * 2

        assert torch.compile(f, backend="aot_eager", fullgraph=True)(x).shape == (16, 2)
        sent = link.stop()
        assert link.waits == len(sent)  # wait_tensor (eager and compiled) waits through LinkWork.wait
    assert [(s.kind, s.bytes) for s in sent] == [
        ("all_gather", 3 * 32), ("reduce_scatter", 3 * 8), ("all_to_all", 3 * 8), ("all_to_all", 32),
        ("all_gather", 3 * 32),
    ]  # fmt: skip
    assert all(s.spans_nodes for s in sent)
    assert sent[0].seconds == pytest.approx(96 / 10e9)  # ring across two nodes: the inter-node link
    assert sent[2].seconds == pytest.approx(16 / 10e9)  # a2a: 2 parts across, 1 inside
    assert sent[3].seconds == pytest.approx(32 / 10e9)  # rank 1 -> 3 crosses


def test_a_2d_mesh_puts_each_level_on_its_link():
    with link_group(1, 4, TOPO) as link:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp_inter", "cp_intra"))
        x = torch.ones(4, 2)
        link.record()
        for dim in ("cp_inter", "cp_intra"):
            funcol.all_gather_tensor(x, 0, mesh.get_group(dim).group_name).wait()
        inter, intra = link.stop()
        assert dist.get_process_group_ranks(mesh.get_group("cp_inter")) == [1, 3]
    assert inter.spans_nodes and inter.seconds == pytest.approx(32 / 10e9)
    assert not intra.spans_nodes and intra.seconds == pytest.approx(32 / 100e9)
