"""GPU: causal sliding windows of packed documents under comm="ring" (layouts/packed_band.py) on flash_varlen and
cudnn_varlen, bf16 fwd+bwd, gloo ranks sharing one GPU (collectives hop through host memory: tests/gpu/test_gpu.py).

thd and thd_zigzag at cp 2 and 4, windows shorter than a rank's piece (thd: the ring visits the neighbour's step
only), between, and longer than most documents; 1-token, empty and rank-crossing documents. Errors against
per-document fp64 SDPA, allowed by the rounding-aware bf16 rule against the same kernel on one GPU over the whole
packed sequence with the same window (varlen_attn, i.e. FA2, for flash_varlen; cudnn_varlen's one block), one
rounding per block a row or key is in. Every case runs even after one fails; the largest error / allowed prints.
cudnn_varlen cases are skipped (reported) where cudnn-frontend's torch ops are absent.
"""

from __future__ import annotations

import time
import traceback

import pytest
import torch

import cpcompile
from cpcompile.kernels import get_varlen_kernel
from cpcompile.testing.distributed import run_ranks
from tests.gpu.test_gpu import _rank_setup, _varlen_fn, _varlen_reference
from tests.support.parity import bf16_rule, max_err
from tests.support.roundings import roundings
from tests.support.thd_parity import cu_of, doc_reference, random_lengths

CUDA = torch.device("cuda")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

HEADS = {"gqa": (8, 2, 64), "mha": (4, 4, 128)}  # q heads, kv heads, head dim
WINDOWS = [(5, 0), (40, 0), (100, 0)]  # thd's pieces are 64 tokens: shorter, between, longer than most documents


def _mixes(world: int) -> dict[str, list[list[int]]]:
    gen, unit = torch.Generator().manual_seed(4000 + world), 2 * world
    thd = [[1, 0, 1, world * 64 - 45, 5, 38, 0], random_lengths(gen, world * 64)]
    zigzag = [[unit, 0, 5 * unit, unit, world * 32 - 7 * unit, 0], random_lengths(gen, unit * 24, unit)]
    return {"thd": thd, "thd_zigzag": zigzag}


def _blocks_a_row_or_key_is_in(strategy: str, world: int) -> int:
    """Each block returns its out / gradients rounded to bf16 before the fp32 merge: thd's row (key) is in its
    diagonal square and, at every later step, the band and the unmasked block; thd_zigzag's back chunk in up to
    two band pairs a step (front and back held chunks), each two blocks."""
    return 2 * world - 1 if strategy == "thd" else 4 * world - 1


def _single_gpu(kernel, q, k, v, dout, cu, window):
    if kernel == "flash_varlen":
        return _varlen_reference(q, k, v, dout, cu, True, window)
    from tests.gpu.test_cudnn_varlen import _single_gpu as cudnn_single_gpu

    return cudnn_single_gpu(q, k, v, dout, cu, True, window)


def _ring(q, k, v, dout, cu, *, strategy, kernel, window):
    shard = lambda t: cpcompile.shard(t.cpu(), strategy=strategy, seq_dim=0, cu_seqlens=cu).to(CUDA, torch.bfloat16)  # noqa: E731
    leaves = [shard(t).detach().requires_grad_() for t in (q, k, v)]
    be = cpcompile.backend(strategy=strategy, comm="ring", kernel=kernel, inner="aot_eager")
    torch._dynamo.reset()
    longest = int((cu[1:] - cu[:-1]).max())
    out = torch.compile(_varlen_fn(True, window), backend=be, fullgraph=True)(*leaves, cu.to(CUDA), longest)
    out.backward(shard(dout))
    assert len(be.plans) == 1 and (be.plans[0].comm, be.plans[0].kernel) == ("ring", kernel)
    return [out.detach()] + [t.grad for t in leaves]


def _sweep(rank, world, kernel):
    _rank_setup()
    failures, worst, start = [], {}, time.time()
    for strategy, mixes in _mixes(world).items():
        for window in WINDOWS:
            for i, lengths in enumerate(mixes):
                cu = cu_of(lengths)
                for name in HEADS if i == 0 else list(HEADS)[:1]:
                    hq, hkv, d = HEADS[name]
                    case = f"rank {rank} {strategy}/ring {kernel} window={window} mix{i} {name}"
                    try:
                        g = torch.Generator().manual_seed(i)
                        q, k, v, dout = (
                            torch.randn(int(cu[-1]), h, d, generator=g, dtype=torch.float64).to(CUDA)
                            for h in (hq, hkv, hkv, hq)
                        )
                        exact = doc_reference(q, k, v, dout, cu, True, torch.float64, window)
                        low = _single_gpu(kernel, q, k, v, dout, cu, window)
                        got = _ring(q, k, v, dout, cu, strategy=strategy, kernel=kernel, window=window)
                        shard = lambda t: cpcompile.shard(t.cpu(), strategy=strategy, seq_dim=0, cu_seqlens=cu)  # noqa: E731, B023
                        blocks = _blocks_a_row_or_key_is_in(strategy, world)
                        for tensor, got_t, e, lo in zip(("out", "dq", "dk", "dv"), got, exact, low):
                            err, ref_err = max_err(got_t.cpu(), shard(e)), max_err(shard(lo), shard(e))
                            allowed = bf16_rule(err, ref_err, torch.bfloat16, roundings(blocks))
                            worst[f"{case} {tensor}"] = err / allowed
                            if not err <= allowed:  # NaN fails here too
                                failures.append(f"{case} {tensor}: error {err:.3g} > allowed {allowed:.3g}")
                    except Exception:
                        failures.append(f"{case} raised:\n{traceback.format_exc(limit=-4)}")
    return failures, worst, time.time() - start


@pytest.mark.multirank
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("kernel", ["flash_varlen", "cudnn_varlen"])
def test_gpu_packed_ring_windows(world, kernel):
    reason = get_varlen_kernel(kernel).supports(CUDA, torch.bfloat16)
    if reason is not None:
        pytest.skip(f"{kernel} unavailable: {reason}")
    per_rank = run_ranks(_sweep, world, kernel, timeout=540)
    ratios: dict[str, float] = {}
    for _, worst, _ in per_rank:
        for case, r in worst.items():
            ratios[case] = max(r, ratios.get(case, 0.0))
    seconds = max(s for *_, s in per_rank)
    print(f"\n{kernel} packed ring windows, world {world}: {len(ratios)} comparisons in {seconds:.0f} s, worst:")
    print(*(f"  {r:.3f} {c}" for c, r in sorted(ratios.items(), key=lambda kv: -kv[1])[:8]), sep="\n")
    failures = [f for fs, _, _ in per_rank for f in fs]
    assert not failures, "\n".join(failures[:40])
