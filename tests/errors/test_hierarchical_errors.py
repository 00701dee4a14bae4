"""comm="hierarchical"'s refusals: one CPCompileError at compile time naming the node, the rule and the fix, before
any collective (every cpcompile collective goes through collectives._run or pending._start, both made to fail)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.attention.varlen import varlen_attn

import cpcompile
from cpcompile import CPCompileError
from tests.support.errors import cp_error
from tests.support.fake_pg import fake_group


@pytest.fixture
def no_collective(monkeypatch):
    import cpcompile.comm.collectives as collectives
    import cpcompile.comm.pending as pending

    def boom(*args, **kwargs):
        raise AssertionError("a collective ran before the error was raised")

    monkeypatch.setattr(collectives, "_run", boom)
    monkeypatch.setattr(pending, "_start", boom)


def sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def _qkv(hq=4, hkv=2, s=8):
    return [torch.randn(1, h, s, 8) for h in (hq, hkv, hkv)]


def _compile(fn, *args, **backend_kwargs) -> CPCompileError:
    be = cpcompile.backend(comm="hierarchical", inner="eager", **backend_kwargs)
    with pytest.raises(Exception) as info:
        torch.compile(fn, backend=be, fullgraph=True)(*args)
    return cp_error(info)


@pytest.mark.parametrize("mesh_kind", ["none", "1-D", "cp dim"])
def test_a_flat_cp_group_is_refused(no_collective, mesh_kind):
    with fake_group(1, 4):
        mesh = {
            "none": None,
            "1-D": init_device_mesh("cpu", (4,), mesh_dim_names=("cp",)),
            "cp dim": init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp")),
        }[mesh_kind]
        err = _compile(sdpa, *_qkv(), strategy="zigzag", mesh=mesh)
    text = str(err)
    assert "cpcompile cannot rewrite attention node" in text and "test_hierarchical_errors.py" in text, text
    assert "comm='hierarchical' runs an all-to-all inside a node and a ring across nodes" in text, text
    assert "mesh_dim_names=('cp_inter', 'cp_intra')" in text, text


@pytest.mark.parametrize(
    "heads, mesh_shape",
    [((3, 3), (2, 2)), ((6, 3), (2, 2)), ((6, 6), (1, 4)), ((6, 2), (2, 3)), ((9, 3), (3, 2))],
)
def test_heads_that_do_not_split_over_a_node_are_refused(no_collective, heads, mesh_shape):
    world = mesh_shape[0] * mesh_shape[1]
    with fake_group(0, world):
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("cp_inter", "cp_intra"))
        err = _compile(sdpa, *_qkv(*heads, s=2 * world), strategy="zigzag", mesh=mesh)
    text = str(err)
    assert f"splits the heads over the {mesh_shape[1]} ranks of a node (the 'cp_intra' dim)" in text, text
    assert "Fix: use a 'cp_intra' size that divides the head counts" in text, text
    assert "sdpa" in text  # the node's source line


def test_the_same_heads_run_on_a_1d_comm_over_the_2d_mesh():
    """The refusal's fix holds: a 1-D comm runs on the same 2-D mesh (its two dims flattened, CP rank = inter rank *
    intra size + intra rank)."""
    with fake_group(1, 4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp_inter", "cp_intra"))
        be = cpcompile.backend(strategy="zigzag", comm="all_gather", mesh=mesh, inner="eager")
        torch.compile(sdpa, backend=be, fullgraph=True)(*_qkv(3, 3))
    (plan,) = be.plans
    assert (plan.comm, plan.group.rank, plan.group.size, plan.group.level_sizes) == ("all_gather", 1, 4, (2, 2))


@pytest.mark.parametrize(
    "strategy, window, message",
    [
        ("thd_zigzag", (-1, 0), "contiguous run in global order only under strategy='thd' ('thd_zigzag' interleaves"),
        (
            "thd",
            (3, 0),
            "window_size=(3, 0): comm='hierarchical' takes causal (-1, 0) and full (-1, -1) attention of packed",
        ),
    ],
)
def test_packed_layouts_and_windows_it_cannot_take_are_refused(no_collective, strategy, window, message):
    cu = torch.tensor([0, 8, 16], dtype=torch.int32)

    def fn(q, k, v, cu):
        return varlen_attn(q, k, v, cu, cu, 16, 16, window_size=window)

    with fake_group(0, 4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp_inter", "cp_intra"))
        qkv = [torch.randn(4, 2, 8) for _ in range(3)]
        err = _compile(fn, *qkv, cu, strategy=strategy, mesh=mesh)
    assert message in str(err) and "cpcompile cannot rewrite attention node" in str(err), str(err)


def test_a_mesh_with_only_one_level_names_the_fix():
    with fake_group(0, 4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp_intra"))
        with pytest.raises(CPCompileError, match=r"none named 'cp'.*or name two dims \('cp_inter', 'cp_intra'\)"):
            cpcompile.shard(torch.zeros(1, 8), strategy="flat", seq_dim=1, mesh=mesh)
