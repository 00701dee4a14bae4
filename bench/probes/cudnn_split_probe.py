"""Would a mixed packed block (whole documents plus cut pieces) reach cuDNN's top-left speed as two compact calls?

cuDNN 9.19's bottom-right causal kernel runs 1.6-1.8x slower than its top-left one on the same square mask, and a
block holding one cut piece (rows [a, b) of a document against keys [0, b)) must run every range bottom-right.
A cut piece is the square [a, b) x [a, b) (top-left causal) plus the rectangle [a, b) x [0, a) (no mask), so the
block can run as:
  square  every range's last n keys against its n rows, top-left causal (whole documents unchanged);
  rect    the cut pieces' rectangles, unmasked; every other range zero rows and zero keys;
then the rows of cut pieces merged by log-sum-exp, dq summed there, and dk/dv selected (the two calls' keys are
disjoint). rect_split_probe timed this through the adjacent cu_seqlens encoding (gap sequences, a grid as large as
the block's, wrong results on thd_balanced). Here both calls address their ranges directly with cuDNN's ragged
offsets (each sequence its own start and length, no gap sequence), through kernels/cudnn_graph's ops.

Per case (layout:mix:S:cp), every rank, GPU time of fwd+bwd (CUDA events, interleaved), the slowest rank of:
  one     the block as the region runs it (cudnn_varlen; bottom-right unless every range is square), its
          metadata prepared before the timed calls for every column
  fa2     the same block on flash_varlen
  split   the two compact calls with the merge and gradient combination compiled by Inductor (the provider's
          own pieces: kernels/cudnn_split's parts, prepare_split, merge, combine)
against ideal = cuDNN top-left over the whole packed sequence / cp. Checks split's out/lse/dq/dk/dv against one's
on the rows and keys of the ranges. Also host ms a call of one and split (queued behind a GPU sleep).

    python -m bench.probes.cudnn_split_probe [--cases thd_balanced:docs-median-1K:32768:8,...] [--iters 5]
"""

from __future__ import annotations

import contextlib

import torch

from bench import thd_cases
from bench.common import queued_host_ms, time_many_ms
from cpcompile.comms.all_gather.varlen import attend_gathered
from cpcompile.executor import decode_varlen
from cpcompile.kernels import cudnn_graph, cudnn_split, cudnn_varlen, get_varlen_kernel
from cpcompile.kernels.base import range_ids

CASES = (
    ",".join(
        f"{layout}:{mix}:{s}:{cp}"
        for layout in ("thd_balanced",)
        for mix in ("docs-median-1K", "docs-median-8K")
        for s, cp in ((32768, 8), (131072, 8), (32768, 2), (131072, 4))
    )
    + ",thd:docs-median-1K:32768:8,thd:docs-median-8K:131072:8"
)


def direct_slots(r: torch.Tensor, tq: int, max_q: int) -> list[torch.Tensor]:
    """The padded stats' slots where range i is sequence i (what the backward reads unless its stats are ragged)."""
    return cudnn_varlen.lse_slots(r, tq, r.shape[1], max(max_q, 1), True)


merge = torch.compile(cudnn_split.merge, fullgraph=True)
combine = torch.compile(cudnn_split.combine, fullgraph=True)
"""The provider's merge and gradient combination, compiled by Inductor as in a region's traced graph."""


def split_fn(q, k, v, dout, r, b, scale: float, check=None):
    impl = get_varlen_kernel("cudnn_varlen")
    square, rect = cudnn_split.parts(r)
    tq, tk = q.shape[0], k.shape[0]
    extra = cudnn_split.prepare_split(r, tq, tk, lambda sq: direct_slots(sq, tq, b.max_q))  # the provider's tensors
    slots, (rows, rkeys, dark) = extra[8:10], extra[10:13]  # range i is sequence i in both calls
    sq_prep = extra[:4] + slots
    rc_prep = extra[4:8] + slots
    sq_args = (square, b.max_q, min(b.max_q, b.max_k), True, scale)
    rc_args = (rect, b.max_q, b.max_k, False, scale)

    def run():
        o1, l1 = impl.forward(q, k, v, *sq_args, square=True, prepared=sq_prep)
        o2, l2 = impl.forward(q, k, v, *rc_args, prepared=rc_prep)
        out, lse = merge(o1, l1, o2, l2, rows, dark)
        g1 = impl.backward(dout, q, k, v, out, lse, *sq_args, square=True, prepared=sq_prep)
        g2 = impl.backward(dout, q, k, v, out, lse, *rc_args, prepared=rc_prep)
        dq, dk, dv = combine(g1, g2, rows, rkeys, dark)
        if check is not None:
            check.update(out=out, lse=lse, dq=dq, dk=dk, dv=dv)

    return run


def one_fn(q, k, v, dout, r, b, kernel: str, scale: float, check=None, direct: bool = False, split: bool = False):
    """The block through the provider: one call (`split` False: cudnn_varlen's split rule switched off around
    it), or as the provider splits it (`split`: its row threshold at 0), its metadata prepared before the timed
    call, as a region prepares it once a batch (logs before 2026-12-07's review prepared it inside every call for
    all but "direct"). Where the provider addresses ranges directly (cudnn_graph.range_columns), "one" and
    "direct" are the same call."""
    impl = get_varlen_kernel(kernel)
    kw = b.kernel_kwargs()
    args = (r, b.max_q, b.max_k, b.causal, scale)
    rule = getattr(cudnn_varlen, "splits", None)
    if direct:  # the same call with each range addressed by its own offsets (no gap sequences)
        kw["prepared"] = cudnn_graph.range_columns(r) + direct_slots(r, q.shape[0], b.max_q)
    else:
        with _rule(rule, split):  # the split's extra tensors only where the rule may split
            kw["prepared"] = impl.prepare(r, q.shape[0], k.shape[0], b.max_q, **kw)

    def run():
        with _rule(rule, split):
            out, lse = impl.forward(q, k, v, *args, **kw)
            dq, dk, dv = impl.backward(dout, q, k, v, out, lse, *args, **kw)
        if check is not None:
            check.update(out=out, lse=lse, dq=dq, dk=dk, dv=dv)

    return run


@contextlib.contextmanager
def _rule(rule, on: bool):
    """cudnn_varlen's split rule with its row threshold at 0 (`on`) or off (trees before it have none)."""
    if rule is None:
        yield
        return
    if on:
        rows = cudnn_varlen.SPLIT_MIN_ROWS
        cudnn_varlen.SPLIT_MIN_ROWS = 0
        try:
            yield
        finally:
            cudnn_varlen.SPLIT_MIN_ROWS = rows
        return
    cudnn_varlen.splits = lambda window, square, rows=None: False
    try:
        yield
    finally:
        cudnn_varlen.splits = rule


def rel_err(want: dict, got: dict, rows: torch.Tensor, keys: torch.Tensor) -> float:
    err = 0.0
    for name, ref in want.items():
        if name == "lse":
            sel = (ref.float()[:, rows], got[name].float()[:, rows])
        else:
            mask = keys if name in ("dk", "dv") else rows
            sel = (ref.float()[mask], got[name].float()[mask])
        err = max(err, float((sel[0] - sel[1]).abs().max() / sel[0].abs().max().clamp(min=1e-6)))
    return err


def main() -> None:
    ragged = getattr(cudnn_graph, "reads_ragged_stats", lambda device: False)(torch.device("cuda"))  # trees before
    print(f"backward stats: {'ragged' if ragged else 'padded'}")
    scale = thd_cases.SCALE
    for spec, layout, lengths, cp, ideal, iters in thd_cases.probe_cases(CASES):
        worst = {m: 0.0 for m in ("one", "fa2", "split", "direct", "provider")}
        host = {"one": 0.0, "split": 0.0, "provider": 0.0}
        err, err_direct, err_provider, cut = 0.0, 0.0, 0.0, 0
        for rank in range(cp):
            q, gathered, key_maps, dout, ranges, enc = thd_cases.rank_case(layout, lengths, cp, rank)
            (b,), (r,) = decode_varlen(enc), ranges
            tensors = thd_cases.block_tensors(q, gathered, key_maps[0], ranges, enc, "cudnn_varlen")
            keys = attend_gathered(q, gathered, key_maps[0], tensors, enc, scale, "cudnn_varlen")[2]
            k, v = keys[:, 0], keys[:, 1]
            fns = [
                one_fn(q, k, v, dout, r, b, "cudnn_varlen", scale),
                one_fn(q, k, v, dout, r, b, "flash_varlen", scale),
                split_fn(q, k, v, dout, r, b, scale),
                one_fn(q, k, v, dout, r, b, "cudnn_varlen", scale, direct=True),
                one_fn(q, k, v, dout, r, b, "cudnn_varlen", scale, split=True),
            ]
            for m, t in zip(worst, time_many_ms(fns, iters, 2)):
                worst[m] = max(worst[m], t)
            host["one"] = max(host["one"], queued_host_ms(fns[0], 1))
            host["split"] = max(host["split"], queued_host_ms(fns[2], 1))
            host["provider"] = max(host["provider"], queued_host_ms(fns[4], 1))
            want, got = {}, {}
            one_fn(q, k, v, dout, r, b, "cudnn_varlen", scale, want)()
            split_fn(q, k, v, dout, r, b, scale, got)()
            direct: dict = {}
            one_fn(q, k, v, dout, r, b, "cudnn_varlen", scale, direct, direct=True)()
            provider: dict = {}
            one_fn(q, k, v, dout, r, b, "cudnn_varlen", scale, provider, split=True)()
            rows = range_ids(r[0], r[1], q.shape[0]) >= 0
            in_keys = range_ids(r[2], r[3], k.shape[0]) >= 0
            err = max(err, rel_err(want, got, rows, in_keys))
            err_direct = max(err_direct, rel_err(want, direct, rows, in_keys))
            err_provider = max(err_provider, rel_err(want, provider, rows, in_keys))
            cut += int(((r[3] - r[2]) > (r[1] - r[0])).logical_and(r[1] > r[0]).sum())
            del q, gathered, keys, k, v, fns
            torch.cuda.empty_cache()
        effs = " ".join(f"{m} {t:.2f} ms ({ideal / t:.3f})" for m, t in worst.items())
        hosts = " ".join(f"{m} {t:.2f}" for m, t in host.items())
        errs = f"max rel err vs one: split {err:.1e}, direct {err_direct:.1e}, provider {err_provider:.1e}"
        print(f"{spec}: ideal {ideal:.2f} ms; {cut} cut pieces; slowest rank GPU: {effs}; host ms: {hosts}; {errs}",
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
