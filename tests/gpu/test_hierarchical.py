"""GPU: comm="hierarchical" on the CUDA kernels, fwd+bwd in bf16, 4 gloo ranks sharing one GPU as a 2x2 ("cp_inter",
"cp_intra") mesh (collectives through host memory: cpcompile.testing.distributed.share_one_gpu; right for the
kernels, not the comm timing). Each rank compares its output and q/k/v gradients with single-GPU SDPA in fp64 under
the bf16 rule of tests/support/parity.py, the roundings counted from the ring's steps over the nodes
(tests/support/roundings.py). Skipped where CUDA is absent."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import cpcompile
from cpcompile.testing.distributed import run_ranks, share_one_gpu
from tests.support.parity import bf16_rule, max_err, sdpa_case
from tests.support.roundings import dense_partials, roundings

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

MESH = (2, 2)
SHAPES = {"gqa": (1, 8, 2, 768, 64), "gqa-1kv": (1, 4, 1, 384, 128), "mha-b2": (2, 4, 4, 384, 64)}
KERNELS = ("auto", "cudnn", "flash")


def _reference(q, k, v, dout, causal, dtype):
    leaves = [t.detach().to("cuda", dtype).requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=True)
    out.backward(dout.to("cuda", dtype))
    return [out.detach()] + [t.grad for t in leaves]


def _cp(mesh, q, k, v, dout, *, layout, kernel, causal):
    shard = lambda t: cpcompile.shard(t.to("cuda", torch.bfloat16), strategy=layout, seq_dim=2, mesh=mesh)  # noqa: E731
    leaves = [shard(t).detach().requires_grad_() for t in (q, k, v)]
    be = cpcompile.backend(strategy=layout, comm="hierarchical", mesh=mesh, kernel=kernel, inner="aot_eager")

    def attn(a, b, c):
        return F.scaled_dot_product_attention(a, b, c, is_causal=causal, enable_gqa=True)

    torch._dynamo.reset()
    out = torch.compile(attn, backend=be, fullgraph=True)(*leaves)
    out.backward(shard(dout))
    (plan,) = be.plans
    assert plan.comm == "hierarchical" and plan.kernel == ("cudnn" if kernel == "auto" else kernel), plan
    return [out.detach()] + [t.grad for t in leaves]


def _sweep(rank, world):
    share_one_gpu()
    mesh = init_device_mesh("cpu", MESH, mesh_dim_names=("cp_inter", "cp_intra"))  # gloo: a CPU mesh
    failures, worst = [], {}
    for shape_name, shape in SHAPES.items():
        for causal in (True, False):
            q, k, v, dout = sdpa_case(7, *shape)
            exact = _reference(q, k, v, dout, causal, torch.float64)
            low = _reference(q, k, v, dout, causal, torch.bfloat16)
            for layout in ("flat", "zigzag"):
                shard = lambda t: cpcompile.shard(t, strategy=layout, seq_dim=2, mesh=mesh)  # noqa: E731, B023
                partials = dense_partials(layout, "hierarchical", world, causal, shape[1], shape[2], MESH)
                for kernel in KERNELS:
                    got = _cp(mesh, q, k, v, dout, layout=layout, kernel=kernel, causal=causal)
                    for name, g, e, lo in zip(("out", "dq", "dk", "dv"), got, exact, low):
                        err, ref_err = max_err(g, shard(e)), max_err(shard(lo), shard(e))
                        allowed = bf16_rule(err, ref_err, torch.bfloat16, roundings(partials[name]))
                        case = f"{layout}/{kernel} {shape_name} causal={causal} {name}"
                        worst[case] = err / allowed
                        if not err <= allowed:
                            failures.append(f"rank {rank} {case}: error {err:.3g} > allowed {allowed:.3g}")
    return failures, worst


@pytest.mark.multirank
def test_hierarchical_gpu_parity():
    per_rank = run_ranks(_sweep, MESH[0] * MESH[1], timeout=600)
    ratios: dict[str, float] = {}
    for _, worst in per_rank:
        for case, r in worst.items():
            ratios[case] = max(r, ratios.get(case, 0.0))
    print("\n2x2: largest error / allowed:", *sorted(ratios.items(), key=lambda kv: -kv[1])[:6], sep="\n  ")
    failures = [f for fs, _ in per_rank for f in fs]
    assert not failures, "\n".join(failures)
