"""DTensor placements the pass refuses (one CPCompileError each, at compile time). One process on a fake
process group: tracing and rewriting need no peers."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

import cpcompile
from tests.support.dtensor import _captured_graph, _qkv

WORLD, RANK = 4, 1


@pytest.fixture(scope="module", autouse=True)
def fake_group():
    dist.init_process_group("fake", store=FakeStore(), rank=RANK, world_size=WORLD)
    yield
    dist.destroy_process_group()


def _refusal(q, k, v, **backend_kwargs) -> str:
    gm = _captured_graph(q, k, v)
    with pytest.raises(cpcompile.CPCompileError) as info:
        cpcompile.backend(inner="eager", **backend_kwargs).transform(gm)
    message = str(info.value)
    assert "attention node 'scaled_dot_product_attention'" in message and "Fix:" in message, message
    return message


def test_replicated_over_cp_is_refused():
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("cp",))
    assert "replicated over the CP mesh dim" in _refusal(*_qkv(mesh, [Replicate()]))


def test_shard_on_wrong_dim_is_refused():
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("cp",))
    assert "placed Shard(1) over the CP mesh dim" in _refusal(*_qkv(mesh, [Shard(1)]))


def test_mismatched_qkv_placements_are_refused():
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("cp",))
    assert "key is placed (Replicate(),)" in _refusal(*_qkv(mesh, [Shard(2)], k_placements=[Replicate()]))


def test_mesh_without_cp_dim_is_refused():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    assert "none named 'cp'" in _refusal(*_qkv(mesh, [Shard(0), Shard(2)]))


def test_non_cp_dim_must_be_replicate_or_batch():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    assert "besides the CP dim" in _refusal(*_qkv(mesh, [Shard(1), Shard(2)]))


def test_explicit_mesh_must_agree_with_placements():
    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    whole = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("cp",))
    message = _refusal(*_qkv(mesh2, [Shard(0), Shard(2)]), mesh=whole)
    assert "names CP ranks [0, 1, 2, 3] but q/k/v are sharded over ranks [0, 1]" in message, message


def test_zigzag_needs_two_chunks_per_rank():
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("cp",))
    message = _refusal(*_qkv(mesh, [Shard(2)], seq=12), strategy="zigzag")
    assert "12 tokens; layout 'zigzag' with cp=4 needs a multiple of 8" in message, message


def test_helper_errors():
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("cp",))
    x = torch.randn(2, 8, 3)
    with pytest.raises(cpcompile.CPCompileError, match="needs the DeviceMesh"):
        cpcompile.shard(x, strategy="flat", seq_dim=1, as_dtensor=True)
    dt = DTensor.from_local(x, mesh, [Shard(1)], run_check=False)
    with pytest.raises(cpcompile.CPCompileError, match="seq_dim=2 but the DTensor is sharded .* on dim 1"):
        cpcompile.unshard(dt, strategy="flat", seq_dim=2)
    with pytest.raises(cpcompile.CPCompileError, match="needs seq_dim="):
        cpcompile.unshard(x, strategy="flat")


def test_zigzag_dtensor_inputs_then_cumsum_are_refused():
    """A zigzag-sharded DTensor is a permuted sequence: DTensor's own cumsum would scan it in the wrong order,
    so the token guard checks DTensor graphs of permuted layouts (a flat Shard DTensor redistributes itself)."""
    import torch.nn.functional as F

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("cp",))
    q, k, v = _qkv(mesh, [Shard(2)])

    def model(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).cumsum(dim=2)

    torch._dynamo.reset()
    with pytest.raises(Exception) as info:
        torch.compile(model, backend=cpcompile.backend(strategy="zigzag", inner="eager"), fullgraph=True)(q, k, v)
    assert "aten.cumsum" in str(info.value) and "node 'cumsum'" in str(info.value), info.value


def test_zigzag_dtensor_token_wise_graph_compiles():
    import torch.nn.functional as F

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("cp",))
    q, k, v = _qkv(mesh, [Shard(2)])

    def model(q, k, v):
        return F.gelu(F.scaled_dot_product_attention(q, k, v, is_causal=True) * 2).sum()

    torch._dynamo.reset()
    be = cpcompile.backend(strategy="zigzag", inner="eager")
    torch.compile(model, backend=be, fullgraph=True)(q, k, v)
    assert len(be.plans) == 1
