"""Does cpcompile's cuDNN THD backward (kernels/cudnn_graph) give the same gradients on strided q/k/v views as on
their contiguous copies? The provider read copies until the H200 had given wrong dq/dk on such views through
the frontend's op; it now reads token-major k and v views in place (cudnn_varlen.token_major: all_gather's key
buffer), declaring each view's real strides and making its offsets from them, and copies q (a strided q gives
wrong dq here). This prints the evidence, beside tests/gpu's accuracy check of the same path.

    python -m bench.probes.cudnn_view_bwd
    python -m bench.probes.cudnn_view_bwd --where-nan views|copies|kv-views  # one form a process

Per case (a fused projection's views; head-major buffers, which the provider still copies), the largest
|difference| of dq, dk, dv (views against copies) over every row and key (all are defined here), and whether
they are equal bit for bit; a layout cuDNN refuses prints its error.
"""

from __future__ import annotations

import itertools
import sys

import torch

from cpcompile.kernels import cudnn_graph, cudnn_varlen

CUDA = torch.device("cuda")
FORMS = ("views", "copies", "kv views")
"""The q/k/v forms a case compares, in the order it runs them."""


def _grads(
    hq: int,
    hkv: int,
    d: int,
    causal: bool,
    ragged_stats: bool,
    head_major: bool,
    g: torch.Generator,
    lengths: tuple[int, ...] = (40, 0, 60, 60),
    forms: tuple[str, ...] = FORMS,
) -> dict[str, tuple[torch.Tensor, ...]]:
    """dq, dk, dv of one THD backward per form of q/k/v in `forms`: "views", "copies" (all contiguous), "kv views"
    (q copied, as the provider does)."""
    cu_q = torch.tensor([0, *itertools.accumulate(lengths)], device=CUDA, dtype=torch.int32)
    cu_k = cu_q
    t = int(cu_q[-1])
    if head_major:  # (H, T, D) buffers seen as (T, H, D): token stride d, head stride T * d
        q = torch.randn(hq, t, d, device=CUDA, generator=g, dtype=torch.bfloat16).transpose(0, 1)
        k, v = (torch.randn(hkv, t, d, device=CUDA, generator=g, dtype=torch.bfloat16).transpose(0, 1) for _ in "kv")
    else:  # a fused QKV output's views: token stride 3 * hq * d
        fused = torch.randn(t, 3, hq, d, device=CUDA, generator=g, dtype=torch.bfloat16)
        q, k, v = fused[:, 0], fused[:, 1, :hkv], fused[:, 2, :hkv]
    do = torch.randn(t, hq, d, device=CUDA, generator=g, dtype=torch.bfloat16)
    columns = cudnn_graph.sequence_columns(cu_q, cu_k)
    mask = cudnn_varlen.band_args(causal, (-1, -1), True)
    bounds = (max(lengths), max(lengths))
    meta = cudnn_graph.ragged_metadata(columns, (q.stride(0), hq * d, hq), (k.stride(0), v.stride(0)))
    with torch.no_grad():
        out, stats = torch.ops.cpcompile.cudnn_thd_fwd(q, k, v, meta, [q.stride(0), k.stride(0), v.stride(0)], 0.1,
                                                       *bounds, *mask)  # fmt: skip
        if ragged_stats:
            lse, q_extra = stats.contiguous(), (hq,)
        else:
            lse, q_extra = (
                cudnn_varlen.padded_lse(stats.squeeze(-1).t(), _ranges(cu_q), len(lengths), bounds[0], True),
                (),
            )
        grads = {}
        given = {
            "views": lambda: (q, k, v),
            "copies": lambda: (q.contiguous(), k.contiguous(), v.contiguous()),
            "kv views": lambda: (q.contiguous(), k, v),
        }  # only the forms asked for are made
        for name in forms:
            qq, kk, vv = given[name]()
            bmeta = cudnn_graph.ragged_metadata(columns, (qq.stride(0), hq * d, hq * d, *q_extra),
                                                (kk.stride(0), vv.stride(0), hkv * d, hkv * d))  # fmt: skip
            tokens = [qq.stride(0), hq * d, kk.stride(0), vv.stride(0)]
            grads[name] = torch.ops.cpcompile.cudnn_thd_bwd(do, qq, kk, vv, out, lse, bmeta, tokens, 0.1, *bounds,
                                                            *mask, False)  # fmt: skip
    return grads


def _case(
    hq: int, hkv: int, d: int, causal: bool, ragged_stats: bool, head_major: bool, g: torch.Generator
) -> dict[str, float]:
    views, copies, kv_views = _grads(hq, hkv, d, causal, ragged_stats, head_major, g).values()
    return {n: (a.float() - b.float()).abs().max().item() for n, a, b in zip(("dq", "dk", "dv"), views, copies)} | {
        "bit_equal": all(torch.equal(a, b) for a, b in zip(views, copies)),
        "kv_views_bit_equal": all(torch.equal(a, b) for a, b in zip(kv_views, copies)),
    }


def _ranges(cu: torch.Tensor) -> torch.Tensor:
    return torch.stack((cu[:-1], cu[1:], cu[:-1], cu[1:])).long()


def main() -> None:
    g = torch.Generator(device=CUDA).manual_seed(0)
    import cudnn

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN backend {cudnn.backend_version()}")
    forms = (False, True) if cudnn_graph.reads_ragged_stats(CUDA) else (False,)
    for hq, hkv, d in ((8, 8, 128), (8, 2, 128), (4, 1, 64)):
        for causal in (True, False):
            for ragged in forms:
                for head_major in (False, True):
                    try:
                        result = _case(hq, hkv, d, causal, ragged, head_major, g)
                    except Exception as e:  # a layout cuDNN refuses is an answer too
                        result = f"refused: {type(e).__name__}: {str(e)[:300]}"
                    print(f"heads {hq}/{hkv} dim {d} causal={causal} ragged_stats={ragged} "
                          f"views={'head-major' if head_major else 'fused QKV'}: {result}", flush=True)  # fmt: skip


def where_nan(form: str, repeats: int = 3) -> None:
    """Which gradients come out NaN for one q/k/v form, per stats form and document list, each case `repeats` times
    (the ragged form's NaN was seen in one run of two). One form a process: a run that faults or writes out of
    bounds would otherwise taint the forms after it (the first such run, all forms in one process, hit an illegal
    memory access in its first case)."""
    if form not in FORMS:
        raise SystemExit(f"--where-nan takes one of {', '.join(f.replace(' ', '-') for f in FORMS)}, not {form!r}")
    cudnn_graph.RAGGED_STATS_ON = True  # the op takes the ragged form only while it is on (this process only)
    g = torch.Generator(device=CUDA).manual_seed(0)
    for lengths in ((40, 60, 60), (40, 0, 60, 60)):
        for hq, hkv, d in ((8, 8, 128), (8, 2, 128)):
            for causal, ragged, head_major in itertools.product((True, False), (False, True), (False, True)):
                seen = []
                for _ in range(repeats):
                    (grads,) = _grads(hq, hkv, d, causal, ragged, head_major, g, lengths, (form,)).values()
                    torch.cuda.synchronize()  # a fault surfaces here, at its case
                    seen.append("".join(n for n, t in zip("qkv", grads) if t.isnan().any()) or "-")
                print(f"{form}: docs {lengths} heads {hq}/{hkv} dim {d} causal={causal} ragged_stats={ragged} "
                      f"views={'head-major' if head_major else 'fused QKV'}: NaN in d[qkv] per run: "
                      f"{' | '.join(seen)}", flush=True)  # fmt: skip


if __name__ == "__main__":
    if sys.argv[1:2] == ["--where-nan"]:
        where_nan(" ".join(sys.argv[2:]).replace("-", " "))
    else:
        main()
