"""GPU: sliding windows on the dense layouts (cpcompile.attention) on the CUDA kernels, fwd+bwd in bf16, gloo
ranks sharing one GPU (collectives hop through host memory: tests/gpu/test_gpu.py). Each rank compares its
output and q/k/v gradients with masked fp64 attention over the full sequence under the bf16 rule of
tests/support/parity.py, the roundings counted from the windowed blocks themselves; and softcapped scores on a
named kernel that takes none are one CPCompileError (tests/gpu/test_softcap.py runs them on flex_softcap)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import cpcompile
from cpcompile.comms.a2a.dense import buffer_blocks
from cpcompile.comms.registry import comms_that
from cpcompile.comms.ring.schedule import held_rank, ring_blocks
from cpcompile.layouts import LAYOUTS, get_layout
from cpcompile.layouts.heads import HeadSplit
from cpcompile.layouts.window import band
from cpcompile.testing.distributed import run_ranks
from tests.gpu.test_gpu import _rank_setup
from tests.support.parity import bf16_rule, max_err, sdpa_case
from tests.support.roundings import roundings

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SHAPE = (1, 8, 2, 768, 64)  # (batch, q heads, kv heads, global seq, head dim)
WINDOW_COMMS = comms_that(  # on a 1-D group (hierarchical: tests/gpu/test_hierarchical.py)
    lambda c: c.serves("sdpa") and "window" in c.capabilities.dense_features and not c.capabilities.levels
)
WINDOWS = [(True, (100, 0)), (True, (300, 0)), (True, (0, 0)), (False, (64, 200)), (False, (-1, 40))]


def _mask(seq: int, causal: bool, window) -> torch.Tensor:
    lo, hi = band(causal, window)
    rel = torch.arange(seq)[None, :] - torch.arange(seq)[:, None]
    mask = torch.ones(seq, seq, dtype=torch.bool)
    if lo is not None:
        mask &= rel >= lo
    if hi is not None:
        mask &= rel <= hi
    return mask


def _reference(q, k, v, dout, mask, dtype):
    leaves = [t.detach().to("cuda", dtype).requires_grad_() for t in (q, k, v)]
    out = torch.nn.functional.scaled_dot_product_attention(*leaves, attn_mask=mask.cuda(), enable_gqa=True)
    out.backward(dout.to("cuda", dtype))
    return [out.detach()] + [t.grad for t in leaves]


def _partials(layout: str, comm: str, cp: int, causal: bool, window, seq: int) -> dict[str, int]:
    """Most kernel partials summed into one q row (out, dq) and one key (dk, dv), from the windowed blocks."""
    lay = get_layout(layout)
    rows, keys = Counter(), Counter()
    if comm == "all_gather":
        chunk = seq // lay.num_chunks(cp)
        for rank in range(cp):
            own = lay.shard_index(seq, cp, rank).tolist()
            sources = [own] + [
                [c * chunk + t for c in lay.source_chunks(s, cp) for t in range(chunk)]
                for s in range(lay.chunks_per_rank)
            ]
            for b in lay.blocks(cp, rank, chunk, causal, window):
                rows.update(own[b.q_start : b.q_start + b.q_len])
                keys.update(sources[b.source][b.kv_start : b.kv_start + b.kv_len])
    elif comm == "ring":  # every step's blocks against the held rank's K/V (in its local order)
        chunk = seq // lay.num_chunks(cp)
        for rank in range(cp):
            for step, blocks in enumerate(ring_blocks(lay, cp, rank, chunk, causal, window)):
                held = held_rank(rank, step, cp)
                rows.update((rank, r) for b in blocks for r in range(b.q_start, b.q_start + b.q_len))
                keys.update((held, j) for b in blocks for j in range(b.kv_start, b.kv_start + b.kv_len))
    else:
        for q_buf, blocks in enumerate(buffer_blocks(layout, causal, cp, seq // cp, window)):
            rows.update((q_buf, r) for b in blocks for r in range(b.q_start, b.q_start + b.q_len))
            keys.update((b.source, j) for b in blocks for j in range(b.kv_start, b.kv_start + b.kv_len))
    q_side, k_side = max(rows.values()), max(keys.values())
    if comm == "a2a":  # a replicated kv head's gradient also sums over the ranks holding it
        k_side *= HeadSplit(SHAPE[1], SHAPE[2], cp).kv_replicas
    return {"out": q_side, "dq": q_side, "dk": k_side, "dv": k_side}


def _cp(q, k, v, dout, *, layout, comm, causal, window):
    shard = lambda t: cpcompile.shard(t.to("cuda", torch.bfloat16), strategy=layout, seq_dim=2)  # noqa: E731
    leaves = [shard(t).detach().requires_grad_() for t in (q, k, v)]
    be = cpcompile.backend(strategy=layout, comm=comm, inner="aot_eager")

    def attn(a, b, c):
        return cpcompile.attention(a, b, c, is_causal=causal, window=window)

    torch._dynamo.reset()
    out = torch.compile(attn, backend=be, fullgraph=True)(*leaves)
    out.backward(shard(dout))
    assert len(be.plans) == 1 and be.plans[0].kernel == "flash", be.plans  # auto: the windowed CUDA kernel
    return [out.detach()] + [t.grad for t in leaves]


def _sweep(rank, world):
    _rank_setup()
    failures, worst = [], {}
    q, k, v, dout = sdpa_case(11, *SHAPE)
    seq = SHAPE[3]
    for causal, window in WINDOWS:
        mask = _mask(seq, causal, window)
        exact = _reference(q, k, v, dout, mask, torch.float64)
        low = _reference(q, k, v, dout, mask, torch.bfloat16)
        for layout in sorted(LAYOUTS):
            shard = lambda t: cpcompile.shard(t, strategy=layout, seq_dim=2)  # noqa: E731, B023
            for comm in WINDOW_COMMS:  # the comms whose dense regions take windows: all of them
                partials = _partials(layout, comm, world, causal, window, seq)
                got = _cp(q, k, v, dout, layout=layout, comm=comm, causal=causal, window=window)
                for name, g, e, lo in zip(("out", "dq", "dk", "dv"), got, exact, low):
                    err, ref_err = max_err(g, shard(e)), max_err(shard(lo), shard(e))
                    allowed = bf16_rule(err, ref_err, torch.bfloat16, roundings(partials[name]))
                    case = f"{layout}/{comm} causal={causal} window={window} {name}"
                    worst[case] = err / allowed
                    if not err <= allowed:
                        failures.append(f"rank {rank} {case}: error {err:.3g} > allowed {allowed:.3g}")
    return failures, worst


@pytest.mark.multirank
@pytest.mark.parametrize("world", [2, 4])
def test_gpu_windowed_parity(world):
    per_rank = run_ranks(_sweep, world, timeout=600)
    ratios: dict[str, float] = {}
    for _, worst in per_rank:
        for case, r in worst.items():
            ratios[case] = max(r, ratios.get(case, 0.0))
    print(f"\nworld {world}: largest error / allowed:", *sorted(ratios.items(), key=lambda kv: -kv[1])[:6], sep="\n  ")
    failures = [f for fs, _ in per_rank for f in fs]
    assert not failures, "\n".join(failures)


def test_gpu_flash_window_block_matches_masked_sdpa():
    """One windowed block on aten's dense FA2 (bottom-right window, Sq != Sk) against masked fp64 SDPA."""
    from cpcompile.kernels import PROVIDERS
    from cpcompile.kernels.cpu_flash import window_mask

    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 8, 96, 64, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 160, 64, generator=g, dtype=torch.float64) for _ in range(2))
    dout = torch.randn(2, 8, 96, 64, generator=g, dtype=torch.float64)
    impl = PROVIDERS["flash"]
    for window in ((10, 0), (0, -1), (30, 50), (-1, 5)):
        mask = window_mask(96, 160, window, torch.device("cpu"))
        exact = _reference(q, k, v, dout, mask, torch.float64)
        low = _reference(q, k, v, dout, mask, torch.bfloat16)
        qb, kb, vb, db = (t.to("cuda", torch.bfloat16) for t in (q, k, v, dout))
        out, lse = impl.forward(qb, kb, vb, False, 64**-0.5, window=window)
        grads = impl.backward(db, qb, kb, vb, out, lse, False, 64**-0.5, window=window)
        for name, got, e, lo in zip(("out", "dq", "dk", "dv"), (out, *grads), exact, low):
            err, allowed = max_err(got, e), bf16_rule(0.0, max_err(lo, e), torch.bfloat16)
            assert err <= allowed, f"window={window} {name}: error {err:.3g} > allowed {allowed:.3g}"


def test_gpu_softcap_on_a_named_kernel_without_it_is_refused():
    """kernel="auto" runs softcapped sites on flex_softcap (tests/gpu/test_softcap.py); naming cuDNN is one error."""
    from tests.support.fake_pg import fake_group

    q = torch.randn(1, 4, 64, 64, device="cuda", dtype=torch.bfloat16)
    with fake_group(0, 2), pytest.raises(Exception) as excinfo:
        be = cpcompile.backend(strategy="zigzag", kernel="cudnn", inner="eager")
        torch.compile(lambda a: cpcompile.attention(a, a, a, is_causal=True, softcap=50.0), backend=be)(q)
    assert "its scores are softcapped (softcap=50.0" in str(excinfo.value), excinfo.value
