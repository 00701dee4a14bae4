"""DTensor inputs for the tests: the CP region on sequence-sharded DTensors against single-process SDPA
(multi-rank parity), and DTensors on a fake mesh with the Dynamo graph of an attention site (one process)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard

import cpcompile
from tests.support.parity import max_err, reference, sdpa_case

SHAPE = (2, 4, 2, 32, 8)  # batch, q heads, kv heads (GQA), global seq, head dim
TOL = {torch.float32: 1e-5, torch.float64: 1e-12}


def _attention(a, b, c, causal):
    return F.scaled_dot_product_attention(a, b, c, is_causal=causal, enable_gqa=True)


def _dtensor_attention_errors(mesh, strategy, causal, dtype, *, dp_slice=slice(None), comm="all_gather") -> dict:
    """Max error of out/dq/dk/dv of the compiled CP region on DTensor inputs vs single-process SDPA."""
    q, k, v, dout = (t[dp_slice] for t in sdpa_case(0, *SHAPE))
    ref = reference(q, k, v, dout, causal, torch.float64)

    def place(t):
        return cpcompile.shard(t.to(dtype), strategy=strategy, seq_dim=2, mesh=mesh, as_dtensor=True)

    leaves = [place(t).detach().requires_grad_() for t in (q, k, v)]
    be = cpcompile.backend(strategy=strategy, comm=comm, inner="aot_eager")  # mesh, seq dim: from the placements
    torch._dynamo.reset()
    out = torch.compile(_attention, backend=be, fullgraph=True)(*leaves, causal)
    assert isinstance(out, DTensor) and out.placements == leaves[0].placements, out
    out.backward(place(dout))
    assert len(be.plans) == 1
    got = [out] + [t.grad for t in leaves]
    assert all(g.placements == leaves[0].placements for g in got[1:])
    full = [cpcompile.unshard(g, strategy=strategy).to(torch.float64) for g in got]  # undoes zigzag's permutation
    return {name: max_err(g, r) for name, g, r in zip(("out", "dq", "dk", "dv"), full, ref)}


def _qkv(mesh, placements, seq=16, k_placements=None):
    """Local q/k/v shards wrapped as DTensors (from_local: no collective), global shape (2, 4, seq, 8)."""

    def make(pl):
        local_shape = [2, 4, seq, 8]
        for size, p in zip(mesh.shape, pl):
            if isinstance(p, Shard):
                local_shape[p.dim] //= size
        return DTensor.from_local(torch.randn(local_shape), mesh, pl, run_check=False)

    return make(placements), make(k_placements or placements), make(placements)


def _captured_graph(q, k, v) -> torch.fx.GraphModule:
    """The Dynamo graph of causal SDPA on (q, k, v), before any pass."""
    graphs = []

    def capture(gm, _):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    attention = lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True)  # noqa: E731
    torch.compile(attention, backend=capture, fullgraph=True)(q, k, v)
    return graphs[0]
