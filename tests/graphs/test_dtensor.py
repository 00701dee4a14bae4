"""The graph the pass produces for a DTensor site, on a fake process group (rank 1 of 4, a 2-D mesh)."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from expecttest import assert_expected_inline
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

import cpcompile
from tests.support.dtensor import _captured_graph, _qkv
from tests.support.fake_pg import normalize_gm

WORLD, RANK = 4, 1


@pytest.fixture(scope="module", autouse=True)
def fake_group():
    dist.init_process_group("fake", store=FakeStore(), rank=RANK, world_size=WORLD)
    yield
    dist.destroy_process_group()


def test_dtensor_site_graph():
    """A DTensor site becomes one dtensor_region call: mesh and group read from the placements (2-D mesh)."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    gm = _captured_graph(*_qkv(mesh, [Shard(0), Shard(2)]))
    be = cpcompile.backend(strategy="zigzag", inner="eager")
    be.transform(gm)
    assert be.plans[0].group.size == 2 and be.plans[0].group.rank == 1
    group = be.plans[0].group.name
    assert_expected_inline(
        normalize_gm(gm.print_readable(False)).replace(repr(group), "'<cp group>'"),
        """\
class GraphModule(torch.nn.Module):
    def forward(self, L_a_: "DTensor(f32[2, 4, 16, 8], S(0)S(2))", L_b_: "DTensor(f32[2, 4, 16, 8], S(0)S(2))", L_c_: "DTensor(f32[2, 4, 16, 8], S(0)S(2))"):
        l_a_ = L_a_
        l_b_ = L_b_
        l_c_ = L_c_
        dtensor_region: "DTensor(f32[2, 4, 16, 8], S(0)S(2))" = cpcompile_comms_dtensor_dtensor_region(l_a_, l_b_, l_c_, comm = 'all_gather', layout = 'zigzag', causal = True, scale = 0.35355339059327373, kernel = 'cpu_flash', group_name = '<cp group>', rank = 1, world = 2)
        return (dtensor_region,)
""",
    )
