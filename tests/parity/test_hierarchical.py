"""comm="hierarchical" on a 2-D CP mesh ("cp_inter", "cp_intra") against one process: 4 gloo ranks as 2x2, 6 as
2x3 and 3x2; flat and zigzag, causal and full, GQA (kv heads split, and replicated where a node has more ranks than
kv heads), a sliding window with softcap and sinks, forward and backward in fp64, sharded with the mesh itself
(CP rank = inter rank * intra size + intra rank); and the 2-D mesh's flattened group under a 1-D comm. One pool of
ranks per world size (aot_eager, tiny shapes)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import cpcompile
from cpcompile.testing.distributed import RankPool
from tests.support.parity import max_err

pytestmark = pytest.mark.multirank

SEQ, D = 48, 8  # divides by 2 * 6: zigzag chunks of 4 tokens at 6 ranks
CASES = {
    # world: [(mesh (inter, intra), strategy, causal, (hq, hkv), comm, feature)]
    4: [
        ((2, 2), "zigzag", True, (4, 2), "hierarchical", None),
        ((2, 2), "flat", False, (2, 2), "hierarchical", None),
        ((2, 2), "flat", True, (4, 1), "hierarchical", None),  # one kv head replicated to both ranks of a node
        ((2, 2), "zigzag", True, (4, 2), "hierarchical", "window"),  # window (5, 0), softcap, sinks
        ((2, 2), "zigzag", True, (4, 2), "a2a", None),  # a 1-D comm over the flattened 2-D group
    ],
    6: [
        ((2, 3), "zigzag", True, (6, 3), "hierarchical", None),
        ((2, 3), "flat", True, (3, 1), "hierarchical", None),
        ((3, 2), "zigzag", False, (4, 2), "hierarchical", None),
        ((3, 2), "zigzag", True, (2, 1), "hierarchical", None),
    ],
}


@pytest.fixture(scope="module", params=sorted(CASES))
def pool(request):
    p = RankPool(request.param)
    yield p
    p.close()


def _attention(causal: bool, feature: str | None, sinks: torch.Tensor | None):
    if feature is None:
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    return lambda q, k, v: cpcompile.attention(q, k, v, is_causal=causal, window=(5, 0), softcap=8.0, sinks=sinks)


def _errors(mesh_shape, strategy, causal, heads, comm, feature) -> dict:
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("cp_inter", "cp_intra"))
    g = torch.Generator().manual_seed(0)
    hq, hkv = heads
    shapes = ((2, hq, SEQ, D), (2, hkv, SEQ, D), (2, hkv, SEQ, D), (2, hq, SEQ, D))
    q, k, v, dout = (torch.randn(s, generator=g, dtype=torch.float64) for s in shapes)
    sinks = torch.randn(hq, generator=g, dtype=torch.float64) if feature else None
    attn = _attention(causal, feature, sinks)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = attn(*leaves)
    ref.backward(dout)
    shard = lambda t: cpcompile.shard(t, strategy=strategy, seq_dim=2, mesh=mesh)  # noqa: E731
    local = [shard(t).requires_grad_() for t in (q, k, v)]
    be = cpcompile.backend(strategy=strategy, comm=comm, mesh=mesh, inner="aot_eager")
    torch._dynamo.reset()
    out = torch.compile(attn, backend=be, fullgraph=True)(*local)
    out.backward(shard(dout))
    (plan,) = be.plans
    assert plan.comm == comm and plan.group.level_sizes == mesh_shape, (plan.comm, plan.group)
    errs = {"out": max_err(out, shard(ref))}
    errs.update({name: max_err(t.grad, shard(r.grad)) for name, t, r in zip(("dq", "dk", "dv"), local, leaves)})
    return errs


def _run(rank, world):
    return {case: _errors(*case) for case in CASES[world]}


def test_hierarchical_parity(pool):
    per_rank = pool.run(_run, timeout=600)
    bad = {(r, c): e for r, found in enumerate(per_rank) for c, e in found.items() if max(e.values()) > 1e-10}
    assert not bad, bad
