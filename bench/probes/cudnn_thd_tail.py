"""Does cpcompile's cuDNN THD forward or backward (kernels/cudnn_graph) read past the last token of its tensors?

The ragged-stats backward gave NaN gradients in some runs of bench/probes/cudnn_view_bwd.py and not in others, and
its `--where-nan` mode hit an illegal memory access in its first case (padded stats, an empty document). A kernel
that reads whole tiles past a tensor's end would do both: what lies there is whatever the allocator left (NaN
times a masked-out probability of 0 is NaN), or unmapped memory. Here every tensor the graphs read (q, k, v, the
output, its gradient and ragged stats) is the first T rows of a buffer whose next GUARD rows hold NaN, then the
same with 0 there. Contiguous tensors, so views play no part. If the outputs or gradients differ between the two,
or hold NaN with the NaN guard, the kernel read the guard.

    python -m bench.probes.cudnn_thd_tail
"""

from __future__ import annotations

import itertools

import torch

from cpcompile.kernels import cudnn_graph, cudnn_varlen

CUDA = torch.device("cuda")
GUARD = 128
"""Rows past each tensor's end: one tile of the largest block size the kernels use."""


def _guarded(x: torch.Tensor, fill: float) -> torch.Tensor:
    """`x` copied into the first rows of a buffer whose GUARD rows after them hold `fill`."""
    buf = torch.full((x.shape[0] + GUARD, *x.shape[1:]), fill, device=x.device, dtype=x.dtype)
    buf[: x.shape[0]] = x
    return buf[: x.shape[0]]


def _run(lengths: tuple[int, ...], hq: int, hkv: int, d: int, causal: bool, ragged: bool, fill: float, seed: int):
    """(out, dq, dk, dv) of one forward + backward on guarded tensors."""
    g = torch.Generator(device=CUDA).manual_seed(seed)
    cu = torch.tensor([0, *itertools.accumulate(lengths)], device=CUDA, dtype=torch.int32)
    t = int(cu[-1])
    q, do = (torch.randn(t, hq, d, device=CUDA, generator=g, dtype=torch.bfloat16) for _ in "qo")
    k, v = (torch.randn(t, hkv, d, device=CUDA, generator=g, dtype=torch.bfloat16) for _ in "kv")
    q, k, v, do = (_guarded(x, fill) for x in (q, k, v, do))
    columns = cudnn_graph.sequence_columns(cu, cu)
    mask = cudnn_varlen.band_args(causal, (-1, -1), True)
    bounds = (max(lengths), max(lengths))
    meta = cudnn_graph.ragged_metadata(columns, (hq * d, hq * d, hq), (hkv * d, hkv * d))
    with torch.no_grad():
        out, stats = torch.ops.cpcompile.cudnn_thd_fwd(q, k, v, meta, [hq * d, hkv * d, hkv * d], 0.1, *bounds, *mask)
        out_g = _guarded(out, fill)
        if ragged:
            lse, q_extra = _guarded(stats.contiguous(), fill), (hq,)
        else:
            ranges = torch.stack((cu[:-1], cu[1:], cu[:-1], cu[1:])).long()
            lse, q_extra = cudnn_varlen.padded_lse(stats.squeeze(-1).t(), ranges, len(lengths), bounds[0], True), ()
        bmeta = cudnn_graph.ragged_metadata(columns, (hq * d, hq * d, hq * d, *q_extra),
                                            (hkv * d, hkv * d, hkv * d, hkv * d))  # fmt: skip
        tokens = [hq * d, hq * d, hkv * d, hkv * d]
        dq, dk, dv = torch.ops.cpcompile.cudnn_thd_bwd(do, q, k, v, out_g, lse, bmeta, tokens, 0.1, *bounds, *mask,
                                                       False)  # fmt: skip
    torch.cuda.synchronize()
    return out.clone(), dq.clone(), dk.clone(), dv.clone()


def main() -> None:
    import cudnn

    cudnn_graph.RAGGED_STATS_ON = True  # the op takes ragged stats only while it is on (this process only)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN backend {cudnn.backend_version()}")
    forms = (False, True) if cudnn_graph.reads_ragged_stats(CUDA) else (False,)
    for lengths in ((40, 60, 60), (100, 28, 32), (40, 0, 60, 60)):  # the last: an empty document
        for hq, hkv, d in ((8, 8, 128), (8, 2, 128)):
            for causal, ragged in itertools.product((True, False), forms):
                runs = {name: _run(lengths, hq, hkv, d, causal, ragged, fill, seed=1)
                        for name, fill in (("nan", float("nan")), ("zero", 0.0))}  # fmt: skip
                flags = (
                    f"{n}:{'NaN' if x.isnan().any() else '-'}" for n, x in zip(("o", "dq", "dk", "dv"), runs["nan"])
                )
                nan = " ".join(flags)
                diff = [(a.float() - b.float()).abs().max().item() for a, b in zip(*runs.values())]
                print(f"docs {lengths} heads {hq}/{hkv} dim {d} causal={causal} ragged_stats={ragged}: NaN guard "
                      f"{nan}; NaN vs 0 guard max|diff| o/dq/dk/dv {diff}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
