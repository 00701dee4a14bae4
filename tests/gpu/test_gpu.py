"""GPU parity: every layout x comm x CUDA kernel, fwd+bwd in bf16, several gloo ranks sharing one GPU.

NCCL refuses two ranks on one device, so the ranks talk over gloo, and gloo's all-gather of CUDA tensors crashes
(SIGSEGV, torch 2.11, seen on the H200 without cpcompile: `python -m bench.probes.gloo_cuda`): every collective
cpcompile issues hops through host memory in these tests (`share_one_gpu`, cpcompile/comm/route.py). Right for
kernel correctness (comm correctness is the CPU tests' job), meaningless for comm timing. Each rank compares its output and
q/k/v gradients with single-GPU SDPA over the full sequence, with the bf16 rule of tests/support/parity.py,
counting the bf16 partials that the kernels return and CP sums into one element (tests/support/roundings.py).
Skipped where CUDA is absent.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import cpcompile
from cpcompile.comms.registry import COMMS
from cpcompile.layouts import LAYOUTS
from cpcompile.testing.distributed import run_ranks, share_one_gpu
from tests.support.parity import bf16_rule, max_err, sdpa_case
from tests.support.roundings import dense_partials, packed_partials, roundings
from tests.support.thd_parity import cu_of, doc_reference, packed_case, random_lengths

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# (batch, q heads, kv heads, global seq, head dim): Llama-like GQA, batch 2 (no batched block calls), MHA.
SHAPES = {"gqa": (1, 8, 2, 768, 64), "gqa-b2": (2, 4, 2, 384, 128), "mha": (1, 4, 4, 384, 64)}
KERNELS = ("auto", "cudnn", "flash")
DENSE_COMMS = [n for n, c in COMMS.items() if c.serves("sdpa") and not c.capabilities.levels]  # 1-D groups
CASES = [(layout, comm) for layout in sorted(LAYOUTS) for comm in DENSE_COMMS]


def _rank_setup() -> None:
    """Each spawned rank: tracebacks on a crash, the one GPU, collectives through host memory."""
    share_one_gpu()


def _reference(q, k, v, dout, causal, dtype):
    leaves = [t.detach().to("cuda", dtype).requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=True)
    out.backward(dout.to("cuda", dtype))
    return [out.detach()] + [t.grad for t in leaves]


def _cp(q, k, v, dout, *, layout, comm, kernel, causal):
    shard = lambda t: cpcompile.shard(t.to("cuda", torch.bfloat16), strategy=layout, seq_dim=2)  # noqa: E731
    leaves = [shard(t).detach().requires_grad_() for t in (q, k, v)]
    be = cpcompile.backend(strategy=layout, comm=comm, kernel=kernel, inner="aot_eager")

    def attn(a, b, c):
        return F.scaled_dot_product_attention(a, b, c, is_causal=causal, enable_gqa=True)

    torch._dynamo.reset()
    out = torch.compile(attn, backend=be, fullgraph=True)(*leaves)
    out.backward(shard(dout))
    assert len(be.plans) == 1 and be.plans[0].kernel == ("cudnn" if kernel == "auto" else kernel)
    return [out.detach()] + [t.grad for t in leaves]


def _sweep(rank, world, cases):
    _rank_setup()
    failures, worst = [], {}
    for shape_name, shape in SHAPES.items():
        for causal in (True, False):
            q, k, v, dout = sdpa_case(7, *shape)
            exact = _reference(q, k, v, dout, causal, torch.float64)
            low = _reference(q, k, v, dout, causal, torch.bfloat16)
            for layout, comm in cases:
                shard = lambda t: cpcompile.shard(t, strategy=layout, seq_dim=2)  # noqa: E731, B023
                partials = dense_partials(layout, comm, world, causal, shape[1], shape[2])
                for kernel in KERNELS:
                    got = _cp(q, k, v, dout, layout=layout, comm=comm, kernel=kernel, causal=causal)
                    for name, g, e, lo in zip(("out", "dq", "dk", "dv"), got, exact, low):
                        err = max_err(g, shard(e))
                        ref_err = max_err(shard(lo), shard(e))
                        allowed = bf16_rule(err, ref_err, torch.bfloat16, roundings(partials[name]))
                        case = f"{layout}/{comm}/{kernel} {shape_name} causal={causal} {name}"
                        worst[case] = err / allowed
                        if not err <= allowed:
                            failures.append(
                                f"rank {rank} {layout}/{comm}/{kernel} {shape_name} causal={causal} {name}: "
                                f"error {err:.3g} > allowed {allowed:.3g}"
                            )
    return failures, worst


@pytest.mark.multirank
@pytest.mark.parametrize("comm", DENSE_COMMS)
@pytest.mark.parametrize("world", [2, 4])
def test_gpu_parity(world, comm):
    per_rank = run_ranks(_sweep, world, [c for c in CASES if c[1] == comm], timeout=600)
    ratios: dict[str, float] = {}
    for _, worst in per_rank:
        for case, r in worst.items():
            ratios[case] = max(r, ratios.get(case, 0.0))
    print(f"\nworld {world}: largest error / allowed:", *sorted(ratios.items(), key=lambda kv: -kv[1])[:6], sep="\n  ")
    failures = [f for fs, _ in per_rank for f in fs]
    assert not failures, "\n".join(failures)


# Packed documents (varlen_attn under thd / thd_zigzag) on the CUDA varlen provider: errors against per-document
# fp64 SDPA, allowed 2x the error of single-GPU bf16 varlen_attn (the replaced op) + floor.
THD_HEADS = {"gqa": (8, 2, 64), "mha": (4, 4, 128)}  # (q heads, kv heads, head dim)


def _varlen_fn(causal: bool, window: tuple[int, int] | None = None):
    """varlen_attn as the model calls it, across torch versions (2.11 has no enable_gqa: GQA by head counts)."""
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    kw = {"enable_gqa": True} if "enable_gqa" in params else {}
    if "window_size" in params:
        kw["window_size"] = window or ((-1, 0) if causal else (-1, -1))
    elif causal:
        kw["is_causal"] = True
    return lambda q, k, v, cu, longest: varlen_attn(q, k, v, cu, cu, longest, longest, **kw)


def _thd_mixes(world: int, gen: torch.Generator) -> dict[str, list[list[int]]]:
    """Document lengths per strategy: 1-token documents, documents spanning 3+ ranks, seeded random mixes."""
    local, unit = 64, 2 * world
    edge = [1, 1, world * local - 45, 5, 38]  # doc 2 spans every rank
    thd = [edge] + [random_lengths(gen, world * local) for _ in range(2)]
    zigzag = [[unit, 5 * unit, unit, world * 32 - 7 * unit]] + [random_lengths(gen, unit * 24, unit)]
    return {"thd": thd, "thd_zigzag": zigzag}


def _thd_cp(q, k, v, dout, cu, *, strategy, causal, comm="all_gather", window=None):
    shard = lambda t: cpcompile.shard(t, strategy=strategy, seq_dim=0, cu_seqlens=cu).to("cuda", torch.bfloat16)  # noqa: E731
    leaves = [shard(t).detach().requires_grad_() for t in (q, k, v)]
    # FA2 varlen by name, whatever kernel="auto" weighs at these shapes (cudnn_varlen's own tests:
    # tests/gpu/test_cudnn_varlen.py)
    be = cpcompile.backend(strategy=strategy, comm=comm, kernel="flash_varlen", inner="aot_eager")
    torch._dynamo.reset()
    longest = int((cu[1:] - cu[:-1]).max())
    out = torch.compile(_varlen_fn(causal, window), backend=be, fullgraph=True)(*leaves, cu.to("cuda"), longest)
    out.backward(shard(dout))
    assert len(be.plans) == 1 and be.plans[0].kernel == "flash_varlen" and be.plans[0].max_doc == longest
    return [out.detach()] + [t.grad for t in leaves]


# (strategy, comm, causal, window): all_gather runs thd and thd_zigzag, causal, full or sliding causal (w, 0);
# a2a (thd only) adds two-sided windows. Windows reach the kernel as FA2 window_size.
THD_CASES = [(s, "all_gather", c, None) for s in ("thd", "thd_zigzag") for c in (True, False)]
THD_CASES += [(s, "all_gather", True, (16, 0)) for s in ("thd", "thd_zigzag")]
THD_A2A_CASES = [("thd", "a2a", True, None), ("thd", "a2a", True, (16, 0)), ("thd", "a2a", False, (8, 4))]


def _varlen_reference(q, k, v, dout, cu, causal, window):
    """(out, dq, dk, dv) of single-GPU varlen_attn in bf16 over the whole packed sequence: the op cpcompile
    replaces, so its bf16 error is the baseline of the bf16 rule (per-document SDPA runs other kernels)."""
    leaves = [t.detach().to(torch.bfloat16).clone().requires_grad_() for t in (q, k, v)]
    longest = int((cu[1:] - cu[:-1]).max())
    out = _varlen_fn(causal, window)(*leaves, cu.to(q.device, torch.int32), longest)
    out.backward(dout.to(torch.bfloat16))
    return [out.detach()] + [t.grad for t in leaves]


def _thd_sweep(rank, world, cases):
    _rank_setup()
    failures, worst = [], {}
    all_mixes = _thd_mixes(world, torch.Generator().manual_seed(2000 + world))
    for strategy, comm, causal, window in cases:
        for i, lengths in enumerate(all_mixes[strategy]):
            cu = cu_of(lengths)
            for heads_name, heads in THD_HEADS.items():
                partials = packed_partials(strategy, comm, world, heads[0], heads[1])
                q, k, v, dout = packed_case(i, int(cu[-1]), *heads)
                args = [t.to("cuda") for t in (q, k, v, dout)]
                exact = doc_reference(*args, cu, causal, torch.float64, window)
                low = _varlen_reference(*args, cu, causal, window)
                kw = dict(strategy=strategy, causal=causal, comm=comm, window=window)
                got = _thd_cp(q, k, v, dout, cu, **kw)
                shard = lambda t: cpcompile.shard(t.cpu(), strategy=strategy, seq_dim=0, cu_seqlens=cu)  # noqa: E731, B023
                for name, g, e, lo in zip(("out", "dq", "dk", "dv"), got, exact, low):
                    err = max_err(g.cpu(), shard(e))
                    ref_err = max_err(shard(lo), shard(e))
                    allowed = bf16_rule(err, ref_err, torch.bfloat16, roundings(partials[name]))
                    case = f"{strategy}/{comm} window={window} mix{i} {heads_name} causal={causal} {name}"
                    worst[case] = err / allowed
                    if not err <= allowed:
                        failures.append(f"rank {rank} {case}: error {err:.3g} > allowed {allowed:.3g}")
    return failures, worst


@pytest.mark.multirank
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("cases", [THD_CASES, THD_A2A_CASES], ids=["all_gather", "a2a"])
def test_gpu_thd_parity(world, cases):
    per_rank = run_ranks(_thd_sweep, world, cases, timeout=600)
    ratios: dict[str, float] = {}
    for _, worst in per_rank:
        for case, r in worst.items():
            ratios[case] = max(r, ratios.get(case, 0.0))
    print(
        f"\nTHD world {world}: largest error / allowed:", *sorted(ratios.items(), key=lambda kv: -kv[1])[:6], sep="\n  "
    )
    failures = [f for fs, _ in per_rank for f in fs]
    assert not failures, "\n".join(failures)


def test_flash_varlen_backward_zero_fills_unseen_keys():
    """The executor skips key masks for blocks that vouch every key lies in a range (`covers_keys`), trusting the
    provider to write 0 for keys of a range that no row sees. Poison the allocator with NaN, then check that FA2
    varlen writes exact zeros there (window + bottom-right: the first keys of each range are out of reach)."""
    from cpcompile.kernels import get_varlen_kernel

    impl = get_varlen_kernel("flash_varlen")
    tq, tk, h, d = 64, 256, 4, 64
    for _ in range(3):  # leave NaN-filled blocks of the needed sizes in the caching allocator
        torch.full((8 * tk * h * d,), float("nan"), device="cuda", dtype=torch.bfloat16)
    q, do = (torch.randn(tq, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(tk, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    ranges = torch.tensor([[0, 32], [32, 64], [0, 128], [128, 256]], device="cuda")  # q 32 rows vs 128 keys, twice
    out, lse = impl.forward(q, k, v, ranges, 32, 128, True, 0.125, window=(8, 0))
    torch.full((8 * tk * h * d,), float("nan"), device="cuda", dtype=torch.bfloat16)  # poison again, freed at once
    _, dk, dv = impl.backward(do, q, k, v, out, lse, ranges, 32, 128, True, 0.125, window=(8, 0))
    unseen = torch.cat((torch.arange(0, 128 - 32 - 8), torch.arange(128, 256 - 32 - 8))).cuda()
    assert torch.isfinite(dk).all() and torch.isfinite(dv).all()
    assert dk[unseen].abs().max().item() == 0 and dv[unseen].abs().max().item() == 0
    seen = torch.arange(128 - 32, 128).cuda()
    assert dk[seen].abs().max().item() > 0
