"""GPU tests of the cuDNN THD provider (cudnn_varlen) and of MLA head dims on the CUDA kernels, bf16 fwd+bwd.

Needs CUDA and cudnn-frontend's torch ops (`pip install 'cpcompile[cudnn]'`); skipped otherwise, with the reason.
As in tests/gpu/test_gpu.py, gloo ranks share one GPU and the collectives hop through host memory (kernel
correctness, not comm timing). Every case runs even after one fails, failures carry their error, and each test
prints its largest error / allowed, so one run diagnoses:
- THD parity: every layout x comm on cudnn_varlen (named: at these 64-token ranks kernel="auto" rightly takes
  flash_varlen, the cost model weighing cuDNN's ~1.2 ms host time a call; tests/unit/test_cost_ranking.py), causal, full
  and windows (top-left bands where a block's ranges are square: a2a, thd's rank 0),
  GQA, MHA and MLA (q/k 192, v 128), 1-token and empty documents; errors against per-document fp64 SDPA,
  allowed by the rounding-aware bf16 rule against single-GPU cudnn_varlen over the whole packed sequence.
- dense MLA: flat/zigzag x all_gather/a2a on aten's cuDNN kernel (auto), against single-GPU aten cuDNN.
- one block against FA2 varlen and an fp32 reference, keys out of a window exactly 0 (NaN-poisoned allocator).
- new documents build no cuDNN graph.
- the provider's graph ops (kernels/cudnn_graph) equal cudnn-frontend's own torch ops bit for bit.
"""

from __future__ import annotations

import math
import time
import traceback

import pytest
import torch

import cpcompile
from cpcompile.executor import encode_varlen, prepare_blocks
from cpcompile.kernels import get_kernel, get_varlen_kernel
from cpcompile.layouts.block import NO_WINDOW
from cpcompile.layouts.thd import THD_LAYOUTS, whole_sequence_blocks
from cpcompile.testing.distributed import run_ranks
from tests.gpu.test_gpu import _cp, _rank_setup, _reference, _varlen_fn
from tests.support.parity import bf16_rule, max_err, sdpa_case
from tests.support.roundings import dense_partials, packed_partials, roundings
from tests.support.thd_parity import cu_of, doc_reference, random_lengths

CUDA = torch.device("cuda")
OPS = torch.ops.cpcompile


def _unavailable() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    return get_varlen_kernel("cudnn_varlen").supports(CUDA, torch.bfloat16)


pytestmark = pytest.mark.skipif(_unavailable() is not None, reason=f"cudnn_varlen unavailable: {_unavailable()}")

HEADS = {"gqa": (8, 2, 64, 64), "mha": (4, 4, 128, 128), "mla": (4, 2, 192, 128)}  # hq, hkv, qk dim, v dim
# (strategy, comm, causal, varlen window_size or None, head configs)
CASES = [
    ("thd", "all_gather", True, None, ("gqa", "mha", "mla")),
    ("thd", "all_gather", False, None, ("gqa", "mla")),
    ("thd_zigzag", "all_gather", True, None, ("gqa", "mha", "mla")),
    ("thd_zigzag", "all_gather", False, None, ("gqa",)),
    ("thd", "all_gather", True, (16, 0), ("gqa", "mla")),
    ("thd_zigzag", "all_gather", True, (16, 0), ("gqa",)),
    ("thd", "a2a", True, None, ("gqa", "mha", "mla")),
    ("thd", "a2a", True, (16, 0), ("gqa",)),
    ("thd", "a2a", False, (8, 4), ("gqa", "mla")),
]


def _mixes(world: int) -> dict[str, list[list[int]]]:
    """Document lengths per strategy: 1-token and empty documents (padded cu_seqlens), one spanning every rank,
    and a seeded random mix."""
    gen, unit = torch.Generator().manual_seed(3000 + world), 2 * world
    thd = [[1, 0, 1, world * 64 - 45, 5, 38, 0], random_lengths(gen, world * 64)]
    zigzag = [[unit, 0, 5 * unit, unit, world * 32 - 7 * unit, 0], random_lengths(gen, unit * 24, unit)]
    return {"thd": thd, "thd_zigzag": zigzag}


def _tensors(seed: int, total: int, hq: int, hkv: int, d: int, dv: int):
    g = torch.Generator().manual_seed(seed)
    shapes = [(total, hq, d), (total, hkv, d), (total, hkv, dv), (total, hq, dv)]
    return [torch.randn(s, generator=g, dtype=torch.float64).to(CUDA) for s in shapes]


def _mask_of(causal: bool, window) -> tuple[bool, tuple[int, int]]:
    """(causal, block window) as the planner derives them from varlen_attn's window_size."""
    if window is None:
        return causal, NO_WINDOW
    causal = causal or window[1] == 0
    return causal, (window[0], -1 if causal else window[1])


def _single_gpu(q, k, v, dout, cu, causal, window):
    """(out, dq, dk, dv) of cudnn_varlen over the whole packed sequence on one GPU, bf16: the kernel one GPU runs."""
    leaves = [t.to(torch.bfloat16).requires_grad_() for t in (q, k, v)]
    causal, win = _mask_of(causal, window)
    cu = cu.to(CUDA)
    (b,) = whole_sequence_blocks(cu, q.shape[0], causal, win, int((cu[1:] - cu[:-1]).max()))
    scale = 1 / math.sqrt(q.shape[-1])
    spec, n = encode_varlen([b]), q.shape[0]
    meta = prepare_blocks([b.ranges], spec, n, [n], "cudnn_varlen")
    out, _ = OPS.attend_varlen_blocks(
        leaves[0], [leaves[1]], [leaves[2]], [b.ranges], spec, scale, "cudnn_varlen", meta
    )
    out.backward(dout.to(torch.bfloat16))
    return [out.detach()] + [t.grad for t in leaves]


def _dense_single_gpu(q, k, v, dout, causal, kernel="cudnn"):
    """(out, dq, dk, dv) of aten's cuDNN kernel over the whole sequence on one GPU, bf16 (the kernel CP runs)."""
    impl, scale = get_kernel(kernel), 1 / math.sqrt(q.shape[-1])
    qb, kb, vb, db = (t.to(CUDA, torch.bfloat16) for t in (q, k, v, dout))
    out, lse = impl.forward(qb, kb, vb, causal, scale)
    return [out, *impl.backward(db, qb, kb, vb, out, lse, causal, scale)]


def _cp_varlen(q, k, v, dout, cu, *, strategy, comm, causal, window):
    shard = lambda t: cpcompile.shard(t, strategy=strategy, seq_dim=0, cu_seqlens=cu).to(torch.bfloat16)  # noqa: E731
    leaves = [shard(t).detach().requires_grad_() for t in (q, k, v)]
    # named on every comm: at these 64-token ranks kernel="auto" rightly prefers FA2 (cuDNN's measured host time a
    # call, cost/rates.host_call_ms, outweighs its GPU time here); where auto takes cuDNN is the cost model's test
    # (tests/unit/test_cost_ranking.py)
    be = cpcompile.backend(strategy=strategy, comm=comm, kernel="cudnn_varlen", inner="aot_eager")
    torch._dynamo.reset()
    longest = int((cu[1:] - cu[:-1]).max())
    out = torch.compile(_varlen_fn(causal, window), backend=be, fullgraph=True)(*leaves, cu.to(CUDA), longest)
    out.backward(shard(dout))
    assert len(be.plans) == 1 and be.plans[0].kernel == "cudnn_varlen", [p.kernel for p in be.plans]
    return [out.detach()] + [t.grad for t in leaves]


def _compare(failures, worst, case, got, exact, low, shard, partials):
    for name, g, e, lo in zip(("out", "dq", "dk", "dv"), got, exact, low):
        err, ref_err = max_err(g.cpu(), shard(e)), max_err(shard(lo), shard(e))
        allowed = bf16_rule(err, ref_err, torch.bfloat16, roundings(partials[name]))
        worst[f"{case} {name}"] = err / allowed
        if not err <= allowed:  # NaN fails here too
            failures.append(f"{case} {name}: error {err:.3g} > allowed {allowed:.3g} (single GPU {ref_err:.3g})")


def _failed(failures, case):
    failures.append(f"{case} raised:\n{traceback.format_exc(limit=-4)}")


def _thd_sweep(rank, world):
    _rank_setup()
    failures, worst, start = [], {}, time.time()
    for strategy, comm, causal, window, heads in CASES:
        for i, lengths in enumerate(_mixes(world)[strategy]):
            cu = cu_of(lengths)
            for name in heads if i == 0 else heads[:1]:  # the random mix on the first head config only
                hq, hkv, d, dv = HEADS[name]
                case = f"rank {rank} {strategy}/{comm} causal={causal} window={window} mix{i} {name}"
                try:
                    q, k, v, dout = _tensors(i, int(cu[-1]), hq, hkv, d, dv)
                    exact = doc_reference(q, k, v, dout, cu, causal, torch.float64, window)
                    low = _single_gpu(q, k, v, dout, cu, causal, window)
                    got = _cp_varlen(q, k, v, dout, cu, strategy=strategy, comm=comm, causal=causal, window=window)
                    shard = lambda t: cpcompile.shard(t.cpu(), strategy=strategy, seq_dim=0, cu_seqlens=cu)  # noqa: E731, B023
                    _compare(
                        failures, worst, case, got, exact, low, shard, packed_partials(strategy, comm, world, hq, hkv)
                    )
                except Exception:
                    _failed(failures, case)
    return failures, worst, time.time() - start


def _dense_mla_sweep(rank, world):
    _rank_setup()
    failures, worst, start = [], {}, time.time()
    hq, hkv, s, d, dv = 4, 2, 128 * world, 192, 128
    for layout in ("flat", "zigzag"):
        for comm in ("all_gather", "a2a"):
            for causal in (True, False):
                case = f"rank {rank} {layout}/{comm} causal={causal} mla"
                try:
                    q, k, _, _ = sdpa_case(11, 1, hq, hkv, s, d)
                    _, _, v, dout = sdpa_case(12, 1, hq, hkv, s, dv)
                    exact = _reference(q, k, v, dout, causal, torch.float64)
                    low = _dense_single_gpu(q, k, v, dout, causal)
                    got = _cp(q, k, v, dout, layout=layout, comm=comm, kernel="auto", causal=causal)
                    shard = lambda t: cpcompile.shard(t.cpu(), strategy=layout, seq_dim=2)  # noqa: E731, B023
                    partials = dense_partials(layout, comm, world, causal, hq, hkv)
                    _compare(failures, worst, case, got, exact, low, shard, partials)
                except Exception:
                    _failed(failures, case)
    return failures, worst, time.time() - start


def _report(title, per_rank):
    ratios: dict[str, float] = {}
    for _, worst, _ in per_rank:
        for case, r in worst.items():
            ratios[case] = max(r, ratios.get(case, 0.0))
    seconds = max(s for *_, s in per_rank)
    print(f"\n{title}: {len(ratios)} comparisons in {seconds:.0f} s, largest error / allowed:")
    print(*(f"  {r:.3f} {c}" for c, r in sorted(ratios.items(), key=lambda kv: -kv[1])[:8]), sep="\n")
    failures = [f for fs, _, _ in per_rank for f in fs]
    print(f"{len(failures)} failure(s)", *failures[:40], sep="\n")
    assert not failures, "\n".join(failures[:40])


@pytest.mark.parametrize("world", [2, 4])
def test_gpu_cudnn_varlen_thd_parity(world):
    _report(f"cudnn_varlen THD world {world}", run_ranks(_thd_sweep, world, timeout=540))


@pytest.mark.parametrize("world", [2, 4])
def test_gpu_dense_mla_parity(world):
    _report(f"dense MLA (aten cuDNN) world {world}", run_ranks(_dense_mla_sweep, world, timeout=300))


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest error relative to the reference's largest magnitude (NaN stays NaN: it fails every bound)."""
    return max_err(got, want) / max(want.abs().max().item(), 1e-6)


def _poison(n: int) -> None:
    """Leave NaN-filled blocks in the caching allocator, so a buffer the kernel does not write shows up."""
    for _ in range(3):
        torch.full((n,), float("nan"), device=CUDA, dtype=torch.bfloat16)


def _block(ranges, tq, tk, hq, hkv, d, dv, seed=0):
    g = torch.Generator(device=CUDA).manual_seed(seed)
    q, do = (torch.randn(tq, hq, s, device=CUDA, generator=g, dtype=torch.bfloat16) for s in (d, dv))
    k = torch.randn(tk, hkv, d, device=CUDA, generator=g, dtype=torch.bfloat16)
    v = torch.randn(tk, hkv, dv, device=CUDA, generator=g, dtype=torch.bfloat16)
    return q, k, v, do, torch.tensor(ranges, device=CUDA)


def test_gpu_cudnn_varlen_block_against_fa2_and_reference(monkeypatch):
    """One block, adjacent (gaps: thd's shape), tiled and square (top-left band), causal/windowed: cudnn_varlen's
    relative errors (out, lse, dq, dk, dv) against an fp32 reference are within 2x FA2's (MLA, which FA2 cannot run: within bf16
    noise), keys no row sees get exact zeros, and what the raw op writes there is printed. "cudnn views" runs the
    same inputs as token-major views of fused buffers (a projection's q, all_gather's (T, 2, H, D) keys), which the
    backward reads in place (k and v; q is copied); its errors meet the same bound. "cudnn split" runs with the
    split rule's row threshold at 0, so the causal blocks with cut pieces (adjacent, tiled) run as cudnn_split's two
    calls; the same bound. The backward's stats form (ragged or padded, cudnn_graph.reads_ragged_stats) is
    printed: every row runs in it."""
    import cudnn

    from cpcompile.kernels import cudnn_graph, cudnn_varlen

    form = "ragged" if cudnn_graph.reads_ragged_stats(CUDA) else "padded"
    print(f"backward stats: {form} (cuDNN backend {cudnn.backend_version()}, SM {torch.cuda.get_device_capability()})")

    impl, fa2, ref = (get_varlen_kernel(n) for n in ("cudnn_varlen", "flash_varlen", "cpu_varlen_ref"))
    shipped = cudnn_varlen.SPLIT_MIN_ROWS
    blocks = {  # name: (ranges, tq, tk, kwargs); q ranges end their key ranges (bottom-right)
        "adjacent": ([[0, 32], [32, 64], [0, 160], [128, 256]], 64, 288, {}),
        "tiled": ([[0, 40], [40, 64], [0, 40], [40, 64]], 64, 64, {"tiled": True}),
        # whole documents (1 token, empty, 40, 23): square ranges, cuDNN's top-left band (FA2: the same mask)
        "square": ([[0, 1, 1, 41], [1, 1, 41, 64]] * 2, 64, 64, {"tiled": True, "square": True}),
    }
    problems = []
    for heads in ((4, 2, 64, 64), (4, 2, 192, 128)):
        for name, (ranges, tq, tk, kw) in blocks.items():
            for causal, window in ((True, NO_WINDOW), (True, (8, -1)), (False, NO_WINDOW), (False, (8, 4))):
                args = dict(kw, **({"window": window} if window != NO_WINDOW else {}))
                q, k, v, do, r = _block(ranges, tq, tk, *heads)
                bounds = (int((r[1] - r[0]).max()), int((r[3] - r[2]).max()))
                f32 = [t.float() for t in (q, k, v, do)]
                want_o, want_l = ref.forward(*f32[:3], r, *bounds, causal, 0.125, **args)
                want = ref.backward(f32[3], *f32[:3], want_o, want_l, r, *bounds, causal, 0.125, **args)
                kernels = {"cudnn": impl, "cudnn views": impl, "cudnn split": impl}
                kernels |= {"fa2": fa2} if heads[2] == heads[3] else {}
                views = _as_views(q, k, v)
                errs = {}
                for kname, kern in kernels.items():
                    qq, kk, vv = views if kname == "cudnn views" else (q, k, v)
                    monkeypatch.setattr(cudnn_varlen, "SPLIT_MIN_ROWS", 0 if kname == "cudnn split" else shipped)
                    _poison(8 * tk * heads[1] * heads[2])
                    o, lse = kern.forward(qq, kk, vv, r, *bounds, causal, 0.125, **args)
                    _poison(8 * tk * heads[1] * heads[2])
                    grads = kern.backward(do, qq, kk, vv, o, lse.float().contiguous(), r, *bounds, causal, 0.125,
                                          **args)  # fmt: skip
                    rows = torch.isfinite(want_l).all(0)
                    errs[kname] = [_rel(o[rows], want_o[rows]), _rel(lse[:, rows], want_l[:, rows])]
                    errs[kname] += [_rel(grads[0][rows], want[0][rows])]
                    keys = cudnn_varlen.unseen_keys(r, tk, window[0]) if window[0] >= 0 else None
                    live = torch.zeros(tk, dtype=torch.bool, device=CUDA)
                    for a, z, qn in zip(r[2].tolist(), r[3].tolist(), (r[1] - r[0]).tolist()):
                        live[a:z] = qn > 0
                    errs[kname] += [_rel(g[live], w[live]) for g, w in zip(grads[1:], want[1:])]
                    if keys is not None and keys.any() and kname == "cudnn":
                        assert bool((grads[1][keys] == 0).all() and (grads[2][keys] == 0).all()), "unseen keys not 0"
                case = f"{name} heads={heads} causal={causal} window={window}"
                print(case, {k: [f"{e:.2e}" for e in v] for k, v in errs.items()})
                bound = [2 * e + 1e-3 for e in errs["fa2"]] if "fa2" in errs else [2e-2] * 6  # MLA: bf16 noise
                for kname in ("cudnn", "cudnn views", "cudnn split"):
                    bad = [i for i, (e, b) in enumerate(zip(errs[kname], bound)) if not e <= b]
                    if bad:
                        problems.append(f"{case}: {kname} errors {errs[kname]} exceed {bound} at {bad}")
    _raw_unseen_report()
    assert not problems, "\n".join(problems)


def _as_views(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q, k, v copied into fused buffers and handed back as their token-major views: q as one of a projection's
    (T, 2, Hq, D) outputs, k and v as all_gather's (T, 2, Hkv, max(D, Dv)) key buffer."""
    fused_q = torch.empty(q.shape[0], 2, *q.shape[1:], device=q.device, dtype=q.dtype)
    fused_q[:, 1] = q
    d, dv = k.shape[-1], v.shape[-1]
    keys = torch.empty(k.shape[0], 2, k.shape[1], max(d, dv), device=k.device, dtype=k.dtype)
    keys[:, 0, :, :d], keys[:, 1, :, :dv] = k, v
    return fused_q[:, 1], keys[:, 0, :, :d], keys[:, 1, :, :dv]


def _raw_unseen_report() -> None:
    """Print whether the raw op (no provider masking) writes zeros for keys a left window hides."""
    from cpcompile.kernels import cudnn_varlen

    q, k, v, do, r = _block([[0, 32], [32, 64], [0, 128], [128, 256]], 64, 256, 4, 4, 64, 64)
    args = dict(cu_seqlens_q=torch.tensor([0, 32, 64], device=CUDA, dtype=torch.int32), max_seqlen_q=32)
    args |= dict(cu_seqlens_kv=torch.tensor([0, 128, 256], device=CUDA, dtype=torch.int32), max_seqlen_kv=128)
    args |= cudnn_varlen.band(True, (8, -1))
    import cudnn.sdpa.fwd.torch_op  # noqa: F401  (registers the frontend's own op: the raw kernel, no provider)

    ops = torch.ops.cudnn
    o, stats = ops.sdpa_fwd(q, k, v, 0.125, return_lse=True, **args)
    padded = cudnn_varlen.padded_lse(stats.squeeze(-1).t().contiguous(), r, 2, 32, True)
    _poison(8 * 256 * 4 * 64)
    _, dk, _ = ops.sdpa_bwd(do, q, k, v, o, padded, 0.125, **args)
    unseen = cudnn_varlen.unseen_keys(r, 256, 8)
    print(f"raw cuDNN dK at {int(unseen.sum())} keys a window hides: NaN {bool(dk[unseen].isnan().any())}, "
          f"max |dK| {dk[unseen].float().nan_to_num(1e9).abs().max().item():.3g} (the provider zeroes them)")  # fmt: skip


def test_gpu_new_documents_build_no_cudnn_graph():
    """Two batches of different documents (same packed length and cu_seqlens length, a fixed max_doc): the second
    builds no graph (kernels/cudnn_graph.graph_keys does not grow); each batch's fwd+bwd time is printed."""
    from cpcompile.kernels import cudnn_graph

    total, cp, hq, hkv, d = 4096, 2, 8, 2, 128
    mixes = ([256] * 8 + [1024, 512, 512, 0], [64] * 4 + [2048, 1024, 512, 256, 0, 0, 0, 0])
    problems = []
    for layout_name, rank in (("thd", 0), ("thd", 1), ("thd_zigzag", 1), ("whole", 0)):
        times, sizes = [], []
        for lengths in (*mixes, mixes[0]):
            cu = cu_of(lengths).to(CUDA)
            local = total if layout_name == "whole" else total // cp
            if layout_name == "whole":
                (block,) = whole_sequence_blocks(cu, total, True, NO_WINDOW, 2048)
                keys = total
            else:
                lay = THD_LAYOUTS[layout_name]
                (block,) = lay.blocks(cu, local, cp, rank, True, 2048)
                index = (lay.key_buffer(cu, local, cp, rank, True) or (None, None))[0]
                keys = total if index is None else index.numel()
            q, k, v, do, _ = _block([[0], [0], [0], [0]], local, keys, hq, hkv, d, d)
            spec = encode_varlen([block])
            torch.cuda.synchronize()
            start = time.perf_counter()
            meta = prepare_blocks([block.ranges], spec, q.shape[0], [k.shape[0]], "cudnn_varlen")
            args = ([block.ranges], spec, 0.1, "cudnn_varlen", meta)
            out, lse = OPS.attend_varlen_blocks(q, [k], [v], *args)
            OPS.attend_varlen_blocks_backward(do, q, [k], [v], out, lse, *args)
            torch.cuda.synchronize()
            times.append(1e3 * (time.perf_counter() - start))
            sizes.append(cudnn_graph.graph_keys())
        built = len(sizes[1] - sizes[0])
        print(f"{layout_name} rank {rank}: fwd+bwd ms first/new documents/first again "
              f"{[round(t, 2) for t in times]}, graphs built by the new documents: {built}")  # fmt: skip
        if built:
            problems.append(f"{layout_name} rank {rank}: new documents built {built} graph(s)")
    assert not problems, "\n".join(problems)


def test_gpu_graph_ops_equal_the_frontend_ops_bit_for_bit():
    """cpcompile's graph ops (our graphs, metadata made by the caller) against cudnn-frontend's sdpa_fwd / sdpa_bwd on
    the same buffers: the same graphs, so the same bits: out, stats, dq, dk, dv. Strided k/v views of a (T, 2, H, D)
    buffer (all_gather's keys), GQA and MLA dims, causal bottom-right and top-left, windows, a right band. Where
    the GPU reads ragged stats (cudnn_graph.reads_ragged_stats), the backward on the forward's own token-major
    stats is run too and its largest difference from the padded one printed: another stats descriptor may pick
    another engine, so equal bits are not its contract (its accuracy is checked against the reference in
    test_gpu_cudnn_varlen_block_against_fa2_and_reference)."""
    import cudnn.sdpa.fwd.torch_op  # noqa: F401  (registers torch.ops.cudnn)

    from cpcompile.kernels import cudnn_graph, cudnn_varlen

    g = torch.Generator(device=CUDA).manual_seed(7)
    cu_q = torch.tensor([0, 32, 32, 95, 128], device=CUDA, dtype=torch.int32)  # an empty sequence too
    cu_k = torch.tensor([0, 64, 80, 200, 256], device=CUDA, dtype=torch.int32)
    problems = []
    for hq, hkv, d, dv in ((8, 2, 64, 64), (4, 2, 192, 128)):
        for causal, window, square in ((True, (-1, -1), False), (True, (8, -1), False), (False, (-1, -1), False),
                                       (False, (8, 4), False), (True, (-1, -1), True)):  # fmt: skip
            q, do = (torch.randn(128, hq, n, device=CUDA, generator=g, dtype=torch.bfloat16) for n in (d, dv))
            keys = torch.randn(256, 2, hkv, max(d, dv), device=CUDA, generator=g, dtype=torch.bfloat16)
            k, v = keys[:, 0, :, :d], keys[:, 1, :, :dv]  # strided views, as all_gather hands them
            kq, kk = (cu_q, cu_q) if square else (cu_q, cu_k)
            bounds = (63, 63) if square else (63, 120)
            band = cudnn_varlen.band(causal, window, square)
            want_o, want_s = torch.ops.cudnn.sdpa_fwd(q, k, v, 0.125, return_lse=True, cu_seqlens_q=kq,
                                                      cu_seqlens_kv=kk, max_seqlen_q=bounds[0],
                                                      max_seqlen_kv=bounds[1], **band)  # fmt: skip
            if square:
                k, v = k[:128], v[:128]
            columns = cudnn_graph.sequence_columns(kq, kk)
            meta = cudnn_graph.ragged_metadata(columns, (q.stride(0), hq * dv, hq), (k.stride(0), v.stride(0)))
            mask = cudnn_varlen.band_args(causal, window, square)
            tokens = [q.stride(0), k.stride(0), v.stride(0)]
            o, s = torch.ops.cpcompile.cudnn_thd_fwd(q, k, v, meta, tokens, 0.125, *bounds, *mask)
            stats = torch.full((4, hq, bounds[0], 1), 0.0, device=CUDA)
            for i in range(4):
                a, z = int(kq[i]), int(kq[i + 1])
                stats[i, :, : z - a, 0] = want_s[a:z, :, 0].t()
            kc, vc = k.contiguous(), v.contiguous()
            want = torch.ops.cudnn.sdpa_bwd(do, q, kc, vc, want_o, stats, 0.125, cu_seqlens_q=kq, cu_seqlens_kv=kk,
                                            max_seqlen_q=bounds[0], max_seqlen_kv=bounds[1], **band)  # fmt: skip
            bmeta = cudnn_graph.ragged_metadata(columns, (hq * d, hq * dv, hq * d), (hkv * d, hkv * dv, hkv * d,
                                                                                      hkv * dv))  # fmt: skip
            tokens = [hq * d, hq * dv, hkv * d, hkv * dv]
            got = torch.ops.cpcompile.cudnn_thd_bwd(do, q, kc, vc, want_o, stats, bmeta, tokens, 0.125, *bounds, *mask,
                                                    False)  # fmt: skip
            # compared where the contract defines them: rows of sequences with keys; keys of sequences with rows
            # that some row sees (both raw ops leave the rest as the kernel leaves it; the provider masks it)
            ranges = torch.stack((kq[:-1], kq[1:], kk[:-1], kk[1:])).long()
            rows = torch.zeros(128, dtype=torch.bool, device=CUDA)
            live = torch.zeros(k.shape[0], dtype=torch.bool, device=CUDA)
            for i in range(4):
                rows[int(kq[i]) : int(kq[i + 1])] = int(kk[i + 1]) > int(kk[i])
                live[int(kk[i]) : int(kk[i + 1])] = int(kq[i + 1]) > int(kq[i])
            if window[0] >= 0:
                live &= ~cudnn_varlen.unseen_keys(ranges, k.shape[0], window[0])
            pairs = {"out": (o[rows], want_o[rows]), "stats": (s[rows], want_s[rows])}
            pairs |= {n: (a[m], b[m]) for n, a, b, m in zip(("dq", "dk", "dv"), got, want, (rows, live, live))}
            if cudnn_graph.reads_ragged_stats(q.device):
                rmeta = cudnn_graph.ragged_metadata(columns, (hq * d, hq * dv, hq * d, hq),
                                                    (hkv * d, hkv * dv, hkv * d, hkv * dv))  # fmt: skip
                ragged = torch.ops.cpcompile.cudnn_thd_bwd(do, q, kc, vc, want_o, want_s.contiguous(), rmeta, tokens,
                                                           0.125, *bounds, *mask, False)  # fmt: skip
                names = ("dq", "dk", "dv")
                gap = {n: (a[m].float() - b[m].float()).abs().max().item() for n, a, b, m in
                       zip(names, ragged, want, (rows, live, live))}  # fmt: skip
                print(f"  ragged stats against padded: {gap}")
            case = f"heads {hq}/{hkv} dims {d}/{dv} causal={causal} window={window} square={square}"
            diff = {n: (a.float() - b.float()).abs().max().item() for n, (a, b) in pairs.items()}
            print(case, diff)
            bad = [n for n, (a, b) in pairs.items() if not torch.equal(a, b)]
            if bad:
                problems.append(f"{case}: {bad} differ ({diff})")
    assert not problems, "\n".join(problems)
