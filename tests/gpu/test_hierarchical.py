"""GPU: comm="hierarchical" on the CUDA kernels, fwd+bwd in bf16, 4 gloo ranks sharing one GPU as a 2x2 ("cp_inter",
"cp_intra") mesh (collectives through host memory: cpcompile.testing.distributed.share_one_gpu; right for the
kernels, not the comm timing). Each rank compares its output and q/k/v gradients with single-GPU SDPA in fp64 under
the bf16 rule of tests/support/parity.py, the roundings counted from the ring's steps over the nodes
(tests/support/roundings.py); packed documents (thd, FA2 varlen) against per-document fp64 SDPA, the baseline
single-GPU bf16 varlen_attn, a partial per ring step. Skipped where CUDA is absent."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import cpcompile
from cpcompile.layouts.heads import HeadSplit
from cpcompile.testing.distributed import run_ranks, share_one_gpu
from tests.support.parity import bf16_rule, max_err, sdpa_case
from tests.support.roundings import dense_partials, roundings
from tests.support.thd_parity import cu_of, doc_reference, packed_case

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


DOCS = [[1, 1, 4 * 64 - 45, 5, 38], [100, 60, 40, 56]]  # 1-token documents, one spanning every rank; 256 tokens
THD_HEADS = {"gqa": (8, 2, 64), "mha": (4, 4, 128)}  # (q heads, kv heads, head dim)


def _varlen(causal: bool):
    """varlen_attn as a model calls it, across torch versions (2.11 has no enable_gqa: GQA by head counts)."""
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    kw = {"enable_gqa": True} if "enable_gqa" in params else {}
    if "window_size" in params:
        kw["window_size"] = (-1, 0) if causal else (-1, -1)
    elif causal:
        kw["is_causal"] = True
    return lambda q, k, v, cu, longest: varlen_attn(q, k, v, cu, cu, longest, longest, **kw)


def _thd_sweep(rank, world):
    share_one_gpu()
    mesh = init_device_mesh("cpu", MESH, mesh_dim_names=("cp_inter", "cp_intra"))
    failures, worst = [], {}
    for i, lengths in enumerate(DOCS):
        cu = cu_of(lengths)
        longest = int((cu[1:] - cu[:-1]).max())
        shard = lambda t: cpcompile.shard(t.cpu(), strategy="thd", seq_dim=0, cu_seqlens=cu, mesh=mesh)  # noqa: E731, B023
        for heads_name, (hq, hkv, d) in THD_HEADS.items():
            q, k, v, dout = (t.to("cuda") for t in packed_case(i, int(cu[-1]), hq, hkv, d))
            for causal in (True, False):
                exact = doc_reference(q, k, v, dout, cu, causal, torch.float64)
                low = [t.detach().to(torch.bfloat16).clone().requires_grad_() for t in (q, k, v)]
                ref = _varlen(causal)(*low, cu.to("cuda"), longest)
                ref.backward(dout.to(torch.bfloat16))
                low = [ref.detach()] + [t.grad for t in low]
                leaves = [shard(t).to("cuda", torch.bfloat16).requires_grad_() for t in (q, k, v)]
                be = cpcompile.backend(strategy="thd", comm="hierarchical", mesh=mesh, kernel="flash_varlen",
                                       inner="aot_eager")  # fmt: skip
                torch._dynamo.reset()
                out = torch.compile(_varlen(causal), backend=be, fullgraph=True)(*leaves, cu.to("cuda"), longest)
                out.backward(shard(dout).to("cuda", torch.bfloat16))
                assert [p.comm for p in be.plans] == ["hierarchical"], be.plans
                steps, replicas = MESH[0], HeadSplit(hq, hkv, MESH[1]).kv_replicas  # a partial per ring step
                partials = {"out": steps, "dq": steps, "dk": steps * replicas, "dv": steps * replicas}
                got = [out.detach()] + [t.grad for t in leaves]
                for name, g, e, lo in zip(("out", "dq", "dk", "dv"), got, exact, low):
                    err, ref_err = max_err(g.cpu(), shard(e)), max_err(shard(lo), shard(e))
                    allowed = bf16_rule(err, ref_err, torch.bfloat16, roundings(partials[name]))
                    case = f"thd mix{i} {heads_name} causal={causal} {name}"
                    worst[case] = err / allowed
                    if not err <= allowed:
                        failures.append(f"rank {rank} {case}: error {err:.3g} > allowed {allowed:.3g}")
    return failures, worst


@pytest.mark.multirank
def test_hierarchical_gpu_thd_parity():
    per_rank = run_ranks(_thd_sweep, MESH[0] * MESH[1], timeout=600)
    ratios: dict[str, float] = {}
    for _, worst in per_rank:
        for case, r in worst.items():
            ratios[case] = max(r, ratios.get(case, 0.0))
    print("\n2x2 thd: largest error / allowed:", *sorted(ratios.items(), key=lambda kv: -kv[1])[:6], sep="\n  ")
    failures = [f for fs, _ in per_rank for f in fs]
    assert not failures, "\n".join(failures)
