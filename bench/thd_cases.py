"""Packed-document (THD) pieces of the single-GPU benchmark: document-length mixes, rank inputs, timed fns.

A mix draws document lengths from a log-normal (long tail: many short documents, a few of tens of thousands of
tokens), rounded to multiples of 16 so one mix is valid for thd_zigzag at every cp <= 8, the last document cut
to fill S exactly. thd_balanced's blocks come from its per-batch plan (`model_cu`: made on the host as
shard_batch makes it, its time recorded as `plan_ms`). The ideal is the fastest single-GPU fwd+bwd of every
document in full, divided by cp, among: cuDNN THD over the whole packed sequence with its top-left band (every
range square: `provider_full_fn`), the documents cut into <= 8K chunks (`chunked_full_fn`: the first chunks
top-left, the later ones bottom-right, where cuDNN is fast on rectangles) and FA2 varlen (`full_fn`). cuDNN's
bottom-right band over the whole documents is a column (`provider_full_fn(anchor="bottom_right")`, the old mask).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import time
from collections.abc import Iterator

import torch

from bench.common import DTYPE, HKV, HQ, D, time_many_ms
from cpcompile.comms.all_gather.varlen import attend_gathered, fold_key_grads
from cpcompile.executor import decode_varlen, encode_varlen, prepare_blocks  # (registers torch.ops.cpcompile.*)
from cpcompile.kernels import cudnn_split, cudnn_varlen, get_varlen_kernel
from cpcompile.kernels.base import range_ids
from cpcompile.kernels.varlen_ranges import adjacent_cu_seqlens
from cpcompile.layouts import get_packed_layout
from cpcompile.layouts.block import NO_WINDOW

torch._dynamo.config.cache_size_limit = 256  # the fold recompiles per key-buffer shape (layout x S x cp)
SCALE = 1 / math.sqrt(D)
UNIT = 16
DEVICE = "cuda"
"""Where the rank inputs live ("cpu" only to smoke-test the index math without a GPU)."""
MIXES = {"docs-median-1K": (1024, 1.5), "docs-median-8K": (8192, 1.0)}
"""name: (median document length, sigma of log length): means ~3.1K and ~13.5K tokens before the cut at S."""


def _compiled_outside_a_trace(fn):
    """`fn` compiled by Inductor with dynamic shapes (one compile for every case), and as itself inside a trace
    (a compiled region traces the provider: the region's own Inductor graph fuses it there)."""
    compiled = torch.compile(fn, dynamic=True, fullgraph=True)
    return lambda *args: fn(*args) if torch.compiler.is_compiling() else compiled(*args)


@contextlib.contextmanager
def fused_split_merge() -> Iterator[None]:
    """cudnn_varlen's split (kernels/cudnn_split.py) with its merge and gradient combination compiled, as in a
    region's traced graph, where the bench calls the provider eagerly (the executor ops, kernels alone): eagerly
    each of their torch ops is a launch of its own, which would understate the split against a region."""
    saved = cudnn_varlen.merge, cudnn_varlen.combine
    cudnn_varlen.merge, cudnn_varlen.combine = map(_compiled_outside_a_trace, (cudnn_split.merge, cudnn_split.combine))
    try:
        yield
    finally:
        cudnn_varlen.merge, cudnn_varlen.combine = saved


def doc_lengths(seq: int, mix: str, seed: int = 2) -> list[int]:
    median, sigma = MIXES[mix]
    g = torch.Generator().manual_seed(seed)
    lengths, left = [], seq
    while left:
        n = math.exp(math.log(median) + sigma * torch.randn(1, generator=g).item())
        n = min(left, max(UNIT, int(n) // UNIT * UNIT))
        lengths.append(n)
        left -= n
    return lengths


def cu_seqlens(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)


def doc_flops(lengths: list[int]) -> float:
    """fwd+bwd FLOPs of per-document causal attention at the Llama3-8B shape."""
    return sum(7 * 2 * n * n * HQ * D / 2 for n in lengths)


def packed(t: int, h: int) -> torch.Tensor:
    return torch.randn(t, h, D, device=DEVICE, dtype=DTYPE)


_PLANS: dict[tuple, tuple[torch.Tensor, float]] = {}


def model_cu(layout: str, lengths: list[int], cp: int) -> tuple[torch.Tensor, float]:
    """(what the model's varlen_attn gets as cu_seqlens, host ms to make it): the offsets, or thd_balanced's
    plan made from them on the host as shard_batch makes it (once per layout x mix x cp, then cached)."""
    key = (layout, tuple(lengths), cp, DEVICE)  # DEVICE: a CPU smoke test and a GPU run may share a process
    if key not in _PLANS:
        offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        t0 = time.perf_counter()
        cu = get_packed_layout(layout).prepare(offsets, sum(lengths), cp)
        _PLANS[key] = cu.to(DEVICE), (time.perf_counter() - t0) * 1e3
    return _PLANS[key]


def rank_case(layout: str, lengths: list[int], cp: int, rank: int):
    """A rank's packed q/dout, the gathered K/V exactly as the region's all-gather delivers them ((T, 2, Hkv, D),
    rank-major), the layout's key-buffer index (thd_zigzag, thd_balanced) and its block, bounded by the longest
    document as the region does with varlen_attn's max_q/max_k. Under thd the region reads only the slice of
    keys the rank reaches (layouts.thd.key_window), here too: `gathered` is then that slice (the region's
    zero-fill of the rest of the gradient before the reduce-scatter is not timed)."""
    total = sum(lengths)
    local = total // cp
    q, dout = packed(local, HQ), packed(local, HQ)
    gathered = torch.randn(total, 2, HKV, D, device=DEVICE, dtype=DTYPE)
    lay, cu = get_packed_layout(layout), model_cu(layout, lengths, cp)[0]
    blocks, read = lay.kernel_blocks(cu, local, cp, rank, True, max(lengths))
    key_maps = lay.key_buffer(cu, local, cp, rank, True) or (None, None)
    if read is not None:
        gathered = gathered[read[0] : read[1]]
    return q, gathered, key_maps, dout, [b.ranges for b in blocks], encode_varlen(blocks)


_fold = torch.compile(fold_key_grads, fullgraph=True)
"""Inductor-compiled, as in the region's backward graph under the default backend (one fused kernel)."""


def block_tensors(q, gathered, key_index, ranges, spec, kernel) -> list[torch.Tensor]:
    """The ranges and metadata `attend_gathered` takes (comms.all_gather.varlen.gathered_blocks' tensors)."""
    keys = gathered.shape[0] if key_index is None else key_index.shape[0]
    return list(ranges) + prepare_blocks(ranges, spec, q.shape[0], [keys], kernel)


def region_fn(q, gathered, key_maps, dout, ranges, spec, kernel):
    """The region's work between its collectives, in its order: the blocks' metadata (eager here; the region
    compiles it), the key-buffer copy, the executor ops (kernel call, masks; nothing to merge with one block)
    and the gradient fold/cast that feeds the reduce-scatter."""
    key_index, key_fold = key_maps
    ops = torch.ops.cpcompile

    def run():
        tensors = block_tensors(q, gathered, key_index, ranges, spec, kernel)
        out, lse, keys = attend_gathered(q, gathered, key_index, tensors, spec, SCALE, kernel)
        ks, vs, meta = [keys[:, 0]], [keys[:, 1]], tensors[len(ranges) :]
        args = (ranges, spec, SCALE, kernel, meta)
        _, (dk,), (dv,) = ops.attend_varlen_blocks_backward(dout, q, ks, vs, out, lse, *args)
        _fold(dk, dv, key_fold)  # attend_gathered_backward's fold, compiled as in the region

    return run


def kernels_only_fn(q, gathered, key_maps, dout, ranges, spec, kernel):
    """The executor's kernel calls alone, on a ready key buffer, each block's metadata prepared once beforehand as
    a region prepares it per batch (`prepared=`; records: `kernels_prepared`): no copy, mask, merge or fold."""
    impl = get_varlen_kernel(kernel)
    blocks = decode_varlen(spec)
    tensors = block_tensors(q, gathered, key_maps[0], ranges, spec, kernel)
    out, lse, keys = attend_gathered(q, gathered, key_maps[0], tensors, spec, SCALE, kernel)
    ks, vs = [keys[:, 0]], [keys[:, 1]]
    kwargs = [b.kernel_kwargs() for b in blocks]
    calls = [(r, b, {**kw, "prepared": impl.prepare(r, len(q), len(keys), b.max_q, **kw)})
             for r, b, kw in zip(ranges, blocks, kwargs)]  # fmt: skip

    def run():
        for r, b, kw in calls:
            impl.forward(q, ks[b.source], vs[b.source], r, b.max_q, b.max_k, b.causal, SCALE, **kw)
        for r, b, kw in calls:
            impl.backward(dout, q, ks[b.source], vs[b.source], out, lse, r, b.max_q, b.max_k, b.causal, SCALE, **kw)

    return run


def split_kernels_fn(q, gathered, key_maps, dout, ranges, spec, kernel):
    """A rank's one block split by shape into two calls each way, on a ready key buffer: its square ranges
    top-left, the rest bottom-right (the other call's rows and keys left out of each), with the selects that
    put the two calls' rows and keys together: the alternative to one bottom-right call over a mixed block. (On
    cudnn_varlen from SPLIT_MIN_ROWS q rows the bottom-right half is itself split: kernels/cudnn_split.py.)"""
    impl, (b,), (r,) = get_varlen_kernel(kernel), decode_varlen(spec), ranges
    tensors = block_tensors(q, gathered, key_maps[0], ranges, spec, kernel)
    out, lse, keys = attend_gathered(q, gathered, key_maps[0], tensors, spec, SCALE, kernel)
    k, v = keys[:, 0], keys[:, 1]
    qs, qe, ks, ke = r
    sq = qe - qs == ke - ks
    halves = [torch.stack((qs, torch.where(sq, qe, qs), ks, ke)), torch.stack((qs, torch.where(sq, qs, qe), ks, ke))]
    rows = (range_ids(halves[0][0], halves[0][1], q.shape[0]) >= 0)[:, None, None]
    live = torch.where(sq, ke, ks)  # keys of the square ranges
    key_rows = (range_ids(ks, live, k.shape[0]) >= 0)[:, None, None]
    kw = {"window": b.window} if b.window != NO_WINDOW else {}
    args = (b.max_q, b.max_k, b.causal, SCALE)

    def run():
        (o1, l1), (o2, l2) = (impl.forward(q, k, v, h, *args, square=i == 0, **kw) for i, h in enumerate(halves))
        torch.where(rows, o1, o2), torch.where(rows[:, 0, 0], l1, l2)
        g1, g2 = (impl.backward(dout, q, k, v, out, lse, h, *args, square=i == 0, **kw) for i, h in enumerate(halves))
        torch.where(rows, g1[0], g2[0]), torch.where(key_rows, g1[1], g2[1]), torch.where(key_rows, g1[2], g2[2])

    return run


def full_fn(lengths: list[int]):
    """Single-GPU fwd+bwd of per-document causal attention over the whole packed sequence: one FA2 varlen call
    each way with the true cu_seqlens and the longest document as max length (what a model's varlen_attn does)."""
    aten = torch.ops.aten
    total, longest = sum(lengths), max(lengths)
    q, k, v, dout = packed(total, HQ), packed(total, HKV), packed(total, HKV), packed(total, HQ)
    cu = cu_seqlens(lengths)
    rng, unused = torch.zeros(2, dtype=torch.uint64, device="cuda"), q.new_empty(0)

    def run():
        out, lse, *_ = aten._flash_attention_forward(q, k, v, cu, cu, longest, longest, 0.0, True, False, scale=SCALE)
        aten._flash_attention_backward(
            dout, q, k, v, out, lse, cu, cu, longest, longest, 0.0, True, rng, unused, scale=SCALE
        )

    return run


def provider_full_fn(lengths: list[int], kernel: str, anchor: str = "top_left", window=NO_WINDOW):
    """Single-GPU fwd+bwd over the whole packed sequence on a varlen provider: one call each way over the cp=1
    block (every document against itself, tiled, bounded by the longest document), as varlen_attn on one GPU.
    anchor="bottom_right" drops the block's square claim (cuDNN then anchors the band bottom-right)."""
    from cpcompile.layouts.thd import whole_sequence_blocks

    impl, total = get_varlen_kernel(kernel), sum(lengths)
    q, k, v, dout = packed(total, HQ), packed(total, HKV), packed(total, HKV), packed(total, HQ)
    (block,) = whole_sequence_blocks(cu_seqlens(lengths), total, True, window, max_doc=max(lengths))
    args = (block.ranges, block.max_q, block.max_k, True, SCALE)
    kw = dict(tiled=True, square=anchor == "top_left", **({"window": window} if window != NO_WINDOW else {}))

    def run():
        out, lse = impl.forward(q, k, v, *args, **kw)
        impl.backward(dout, q, k, v, out, lse, *args, **kw)

    return run


def _chunk_ranges(lengths: list[int], chunk: int) -> list[tuple[torch.Tensor, bool, int]]:
    """Per chunk index c, (ranges, square, bound): chunk c of every document that has one against its
    document's keys up to the chunk's end (c = 0: a square; later: a rectangle ending its key range). Key
    ranges of one call do not overlap (one chunk a document). Keys a call does not read get ranges without rows,
    so every gap between ranges is rows only (varlen_ranges' adjacent encoding); `bound` covers every sequence
    of that encoding, gaps included."""
    calls, c = [], 0
    while c * chunk < max(lengths):
        qs, qe, ks, ke, at = [], [], [], [], 0
        for n in lengths:
            end = min((c + 1) * chunk, n)
            if n > c * chunk:  # the chunk against its document's keys up to its end
                qs.append(at + c * chunk), qe.append(at + end), ks.append(at), ke.append(at + end)
            if n > end or n <= c * chunk:  # keys past the chunk (or a whole document without one): no rows
                first = at + end if n > c * chunk else at
                q = qe[-1] if qe else 0
                qs.append(q), qe.append(q), ks.append(first), ke.append(at + n)
            at += n
        ranges = torch.tensor([qs, qe, ks, ke])
        cu_q, cu_k = adjacent_cu_seqlens(ranges)
        bound = int(max((cu_q[1:] - cu_q[:-1]).max(), (cu_k[1:] - cu_k[:-1]).max()))
        calls.append((ranges.to(DEVICE), c == 0, bound))
        c += 1
    return calls


def chunked_full_fn(lengths: list[int], kernel: str, chunk: int = 8192):
    """Single-GPU fwd+bwd of the same documents cut into <= `chunk` chunks: one call per chunk index (the first
    chunks top-left, the rest bottom-right rectangles), each row in one call, so outputs are selected and dK/dV
    summed (those passes timed too). With no document longer than `chunk` it is the whole-sequence call."""
    impl, total = get_varlen_kernel(kernel), sum(lengths)
    q, k, v, dout = packed(total, HQ), packed(total, HKV), packed(total, HKV), packed(total, HQ)
    calls = []
    for ranges, square, bound in _chunk_ranges(lengths, chunk):
        bounds = (bound, bound)
        rows = range_ids(ranges[0], ranges[1], total) >= 0
        keys = range_ids(ranges[2], ranges[3], total) >= 0
        calls.append((ranges, bounds, square, rows[:, None, None], keys[:, None, None]))

    def run():
        out = lse = dq = dk = dv = None
        parts = []
        for ranges, bounds, square, rows, _ in calls:
            o, l = impl.forward(q, k, v, ranges, *bounds, True, SCALE, square=square)
            parts.append((o, l))
            out = o if out is None else torch.where(rows, o, out)
            lse = l if lse is None else torch.where(rows[:, 0, 0], l, lse)
        for (ranges, bounds, square, rows, keys), (o, l) in zip(calls, parts):
            g = impl.backward(dout, q, k, v, o, l, ranges, *bounds, True, SCALE, square=square)
            if dq is None:
                dq, dk, dv = g
            else:
                dq = torch.where(rows, g[0], dq)
                dk, dv = dk + torch.where(keys, g[1], 0), dv + torch.where(keys, g[2], 0)

    return run


def rank_work(ranges: list[torch.Tensor], causal: bool = True) -> int:
    """Score entries a rank's blocks compute (per head): per sequence q_len * k_len, less the masked triangle
    when causal (bottom-right: q rows are the last of their key range). The balance ceiling is mean / max."""
    work = 0
    for r in ranges:
        qn, kn = (r[1] - r[0]).tolist(), (r[3] - r[2]).tolist()
        work += sum(a * b - (a * (a - 1) // 2 if causal else 0) for a, b in zip(qn, kn))
    return work


def _identity_exchange(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return x  # one GPU: the all-to-all delivers buffers of the same shape; timing excludes communication


def a2a_rank_case(lengths: list[int], cp: int, layout: str = "thd"):
    """A rank's local q/k/v (T/cp tokens, every head, as leaves) and dout, and what the model passes as
    cu_seqlens (`model_cu`: thd_balanced's plan). Every rank does the same work under a2a (all T tokens, Hq/cp
    heads), so one rank stands for all."""
    total = sum(lengths)
    leaves = [packed(total // cp, h).requires_grad_() for h in (HQ, HKV, HKV)]
    return (*leaves, packed(total // cp, HQ), model_cu(layout, lengths, cp)[0])


def a2a_region_fn(q, k, v, dout, cu, cp: int, kernel: str, compiled: bool = False, layout: str = "thd"):
    """The a2a region itself (comms/a2a/varlen.py, eager: its head pack, thd_balanced's reorder into global order
    and back, the varlen executor ops over the whole packed sequence with Hq/cp heads, the output unpack, and
    their backward), with the all-to-alls replaced by identity: what a rank does besides communicating. Eager
    (compiled=False) runs every pack as its own copy, an upper bound; compiled=True runs it under Inductor."""
    from cpcompile.comms.a2a import head_parallel, heads
    from cpcompile.comms.a2a import varlen as a2a_varlen

    # every all-to-all of the region: the q/k/v one (head_parallel), the output's and the lse's (heads)
    head_parallel.exchange_first = heads.exchange_first = _identity_exchange
    offsets = get_packed_layout(layout).offsets(cu, cp)
    longest = int((offsets[1:] - offsets[:-1]).max())  # varlen_attn's max_q/max_k, which the planner hands it

    def region(q, k, v, cu):
        return a2a_varlen.a2a_varlen_attention(
            q, k, v, cu, layout=layout, causal=True, scale=SCALE, kernel=kernel, group_name="", rank=0, world=cp,
            return_lse=False, max_doc=longest,
        )[0]  # fmt: skip

    # compiled: the region's own ops under Inductor (its packs and unpacks become Inductor kernels, as inside a
    # model's graph; a model's graph would also fuse them into the neighbouring RoPE / projection kernels)
    attend = torch.compile(region, fullgraph=True, dynamic=False) if compiled else region

    def run():
        attend(q, k, v, cu).backward(dout)
        q.grad = k.grad = v.grad = None

    return run


def a2a_kernels_only_fn(q, k, v, dout, cu, cp: int, kernel: str, layout: str = "thd"):
    """The one varlen call each way an a2a rank makes: all T tokens, Hq/cp and Hkv/cp heads, metadata prepared."""
    from cpcompile.layouts.thd import whole_sequence_blocks

    impl, total = get_varlen_kernel(kernel), q.shape[0] * cp
    cu = get_packed_layout(layout).offsets(cu, cp)
    qh, kh, vh, dh = (
        packed(total, HQ // cp),
        packed(total, HKV // cp),
        packed(total, HKV // cp),
        packed(total, HQ // cp),
    )
    longest = int((cu[1:] - cu[:-1]).max())
    (block,) = whole_sequence_blocks(cu, total, True, max_doc=longest)
    args = (block.ranges, block.max_q, block.max_k, True, SCALE)
    kw = decode_varlen(encode_varlen([block]))[0].kernel_kwargs()  # as the executor calls it: tiled, square
    kw["prepared"] = impl.prepare(block.ranges, total, total, block.max_q, **kw)  # once, as the region does
    out, lse = impl.forward(qh, kh, vh, *args, **kw)

    def run():
        impl.forward(qh, kh, vh, *args, **kw)
        impl.backward(dh, qh, kh, vh, out, lse, *args, **kw)

    return run


def selective_region_fn(layout: str, lengths: list[int], cp: int, rank: int, kernel: str):
    """comm="selective"'s region itself for rank `rank` (comms/selective/varlen.py, eager: the slots it sends,
    its held buffer, its key buffer (thd: the slice it reaches), the kernel call, the fold and the sum of the
    returned gradient, forward and backward) with its all-to-all replaced by identity (the slots it sends come
    back as the ones it receives: the same shapes, other values): what a rank does besides communicating."""
    from cpcompile.comms.selective import varlen as selective

    selective.exchange_slots = lambda x, splits, group_name: x
    total = sum(lengths)
    q, k, v = (packed(total // cp, h).requires_grad_() for h in (HQ, HKV, HKV))
    dout, cu = packed(total // cp, HQ), model_cu(layout, lengths, cp)[0]
    kw = dict(layout=layout, causal=True, scale=SCALE, kernel=kernel, group_name="", rank=rank, world=cp)

    def run():
        selective.selective_varlen_attention(q, k, v, cu, **kw, max_doc=max(lengths))[0].backward(dout)
        q.grad = k.grad = v.grad = None

    return run


def probe_cases(default: str) -> Iterator[tuple[str, str, list[int], int, float, int]]:
    """The cases a kernel probe runs (`--cases layout:mix:S:cp,...`, `--iters`), each as (spec, layout, lengths,
    cp, ideal ms, iters): ideal = cuDNN top-left over the whole packed sequence / cp, timed first."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=default)
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args()
    for spec in args.cases.split(","):
        layout, mix, seq, cp = spec.split(":")
        lengths = doc_lengths(int(seq), mix)
        ideal = time_many_ms([provider_full_fn(lengths, "cudnn_varlen")], args.iters, 2)[0] / int(cp)
        yield spec, layout, lengths, int(cp), ideal, args.iters
