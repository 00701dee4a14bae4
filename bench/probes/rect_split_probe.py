"""Would cuDNN THD reach its top-left speed on a rank's packed block if the block's cut pieces were split into a
square and a rectangle? A causal piece that starts inside its document (rows [a, b) against keys [0, b)) is the
square [a, b) x [a, b) (top-left causal, cuDNN's fast anchor) plus the rectangle [a, b) x [0, a) (no mask). So a
rank's block becomes two calls: every range's square part top-left (whole documents included), and the cut
pieces' rectangles unmasked, their rows merged by log-sum-exp and their gradients summed.

Per case (layout:mix:S:cp), every rank, kernels alone (fwd+bwd, CUDA events, interleaved), the slowest rank of:
  one        the block as the region runs it (cudnn_varlen: bottom-right unless every range is square)
  fa2        the same block on flash_varlen
  split      bench/thd_cases.split_kernels_fn: square ranges top-left, the rest bottom-right
  rect       the square parts top-left + the rectangles unmasked, with the merge and gradient sums (torch ops)
  fa2_rect   the same two calls on flash_varlen (what the split costs a kernel with one anchor)
against ideal = cuDNN top-left over the whole packed sequence / cp (the single-GPU reference). Prints one line a
case and checks rect's out/lse/dq/dk/dv against one's (bf16 tolerance). Nothing is written; log it by hand.

    python -m bench.probes.rect_split_probe [--cases thd_balanced:docs-median-1K:32768:8,...] [--iters 5]
"""

from __future__ import annotations

import torch

from bench import thd_cases
from bench.common import time_many_ms
from cpcompile.comms.all_gather.varlen import attend_gathered
from cpcompile.executor import decode_varlen
from cpcompile.kernels import get_varlen_kernel
from cpcompile.kernels.base import range_ids

CASES = ",".join(
    f"{layout}:{mix}:{s}:{cp}"
    for layout in ("thd_balanced", "thd")
    for mix in ("docs-median-1K", "docs-median-8K")
    for s, cp in ((32768, 8), (131072, 8), (32768, 2))
)


def square_and_rect(r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(square ranges, rectangle ranges, the rectangles' own key ranges) of a causal block whose q ranges tile the rows:
    each range's last n keys against its n rows, and its other keys against the same rows with no mask. A range
    without a rectangle keeps its keys in the rectangle call with no rows, so no gap sequence of the adjacent
    encoding gets both rows and keys (it would attend them)."""
    qs, qe, ks, ke = r
    n = qe - qs
    cut = ke - ks > n
    square = torch.stack((qs, qe, ke - n, ke))
    rect = torch.stack((qs, torch.where(cut, qe, qs), ks, torch.where(cut, ke - n, ke)))
    return square, rect, torch.stack((ks, torch.where(cut, ke - n, ks)))


def rect_fn(q, keys, dout, r, b, kernel: str, scale: float, check=None):
    impl = get_varlen_kernel(kernel)
    k, v = keys[:, 0], keys[:, 1]
    square, rect, rect_keys = square_and_rect(r)
    rows = (range_ids(rect[0], rect[1], q.shape[0]) >= 0)[:, None, None]
    rkeys = (range_ids(rect_keys[0], rect_keys[1], k.shape[0]) >= 0)[:, None, None]
    sq_prep = impl.prepare(square, q.shape[0], k.shape[0], b.max_q, square=True)
    rc_prep = impl.prepare(rect, q.shape[0], k.shape[0], b.max_q)
    sq_args = (square, b.max_q, b.max_q, True, scale)
    rc_args = (rect, b.max_q, b.max_k, False, scale)

    def run():
        o1, l1 = impl.forward(q, k, v, *sq_args, square=True, prepared=sq_prep)
        o2, l2 = impl.forward(q, k, v, *rc_args, prepared=rc_prep)
        l2 = torch.where(rows[:, 0, 0][None], l2, float("-inf"))
        lse = torch.logaddexp(l1, l2)
        w1, w2 = (torch.exp(x - lse).t()[:, :, None] for x in (l1, l2))
        out = (o1.float() * w1 + torch.where(rows, o2.float(), 0) * w2).to(q.dtype)
        g1 = impl.backward(dout, q, k, v, out, lse, *sq_args, square=True, prepared=sq_prep)
        g2 = impl.backward(dout, q, k, v, out, lse, *rc_args, prepared=rc_prep)
        dq = g1[0].float() + torch.where(rows, g2[0].float(), 0)
        dk = g1[1].float() + torch.where(rkeys, g2[1].float(), 0)
        dv = g1[2].float() + torch.where(rkeys, g2[2].float(), 0)
        if check is not None:
            check.update(out=out, lse=lse, dq=dq, dk=dk, dv=dv)

    return run


def one_fn(q, keys, dout, r, b, kernel: str, scale: float, check=None):
    impl = get_varlen_kernel(kernel)
    k, v = keys[:, 0], keys[:, 1]
    kw = b.kernel_kwargs()
    args = (r, b.max_q, b.max_k, b.causal, scale)

    def run():
        out, lse = impl.forward(q, k, v, *args, **kw)
        dq, dk, dv = impl.backward(dout, q, k, v, out, lse, *args, **kw)
        if check is not None:
            check.update(out=out, lse=lse, dq=dq, dk=dk, dv=dv)

    return run


def main() -> None:
    scale = thd_cases.SCALE
    for spec, layout, lengths, cp, ideal, iters in thd_cases.probe_cases(CASES):
        worst = {m: 0.0 for m in ("one", "fa2", "split", "rect", "fa2_rect")}
        err = 0.0
        for rank in range(cp):
            q, gathered, key_maps, dout, ranges, enc = thd_cases.rank_case(layout, lengths, cp, rank)
            (b,), (r,) = decode_varlen(enc), ranges
            tensors = thd_cases.block_tensors(q, gathered, key_maps[0], ranges, enc, "cudnn_varlen")
            keys = attend_gathered(q, gathered, key_maps[0], tensors, enc, scale, "cudnn_varlen")[2]
            fns = [
                one_fn(q, keys, dout, r, b, "cudnn_varlen", scale),
                one_fn(q, keys, dout, r, b, "flash_varlen", scale),
                thd_cases.split_kernels_fn(q, gathered, key_maps, dout, ranges, enc, "cudnn_varlen"),
                rect_fn(q, keys, dout, r, b, "cudnn_varlen", scale),
                rect_fn(q, keys, dout, r, b, "flash_varlen", scale),
            ]
            for m, t in zip(worst, time_many_ms(fns, iters, 2)):
                worst[m] = max(worst[m], t)
            want, got = {}, {}
            one_fn(q, keys, dout, r, b, "cudnn_varlen", scale, want)()
            rect_fn(q, keys, dout, r, b, "cudnn_varlen", scale, got)()
            for name in want:
                ref, x = want[name].float(), got[name].float()
                err = max(err, float((ref - x).abs().max() / ref.abs().max().clamp(min=1e-6)))
            del q, gathered, keys, fns
            torch.cuda.empty_cache()
        effs = " ".join(f"{m} {t:.2f} ms ({ideal / t:.3f})" for m, t in worst.items())
        print(f"{spec}: ideal {ideal:.2f} ms; slowest rank: {effs}; rect vs one max rel err {err:.1e}", flush=True)


if __name__ == "__main__":
    main()
