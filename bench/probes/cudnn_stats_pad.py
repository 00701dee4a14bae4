"""What does cuDNN's THD backward read of the stats beyond each sequence's rows? A hypothesis for the ragged-stats
NaN (bench/results/logs/cudnn_view_bwd_h100.txt): the last q tile of a sequence covers rows past its length, and
the backward reads their stats too. Ragged (token-major, the forward's layout), those are the next rows' (whose
final lse is -inf for rows outside every range) or, after the last sequence, memory past the tensor; padded
((B, Hq, max_q, 1), what the provider ships), they are the buffer's unwritten padding (`padded_at`: new_empty).
If the kernel masks those rows' scores to -inf before exp(score - lse), an lse of -inf or NaN there makes NaN.

Per case, the backward with each form of the same final lse, its surroundings filled on purpose:

  padded 0 / nan / -inf / +inf   the padded buffer, its padding filled with that value (0: the reference)
  ragged, nan past the end       token-major, the memory just past the last row NaN (the worst of what may lie
                                 past the provider's fresh contiguous copy)
  ragged, 0 past the end         the same with 0 there, the rows outside every range still -inf
  ragged, 0 past, -inf as 0      and the -inf rows read as 0 too

and prints the NaN count and max |difference| of dq, dk, dv against the reference on the rows and keys in ranges,
and the reference's own against fp32 math (SDPA per sequence), so a form wrong the reference's way shows too.

    python -m bench.probes.cudnn_stats_pad
"""

from __future__ import annotations

import torch

from cpcompile.kernels import cudnn_graph, cudnn_varlen
from cpcompile.kernels.base import range_ids

CUDA = torch.device("cuda")
PAST = 256
"""Rows of fill past the last row for the ragged forms (more than a q tile)."""
CASES = {
    "4 sequences (40, 0, 60, 60)": ([(0, 40), (40, 40), (40, 100), (100, 160)], 160),
    "4 sequences (300, 1000, 77, 2000)": ([(0, 300), (300, 1300), (1300, 1377), (1377, 3377)], 3377),
    "2 ranges, 50 rows between them in none": ([(0, 100), (150, 400)], 400),
    "3 ranges, 200 rows after the last in none": ([(0, 130), (130, 515), (515, 700)], 900),
}


def _padded(lse: torch.Tensor, ranges: torch.Tensor, max_q: int, fill: float) -> torch.Tensor:
    """`cudnn_varlen.padded_at`'s buffer with its padding filled with `fill` instead of left unwritten."""
    n = ranges.shape[1]
    slots = cudnn_varlen.lse_slots(ranges, lse.shape[1], n, max_q, True)
    padded = lse.new_full((n + 1, lse.shape[0], max_q), fill, dtype=torch.float32)
    padded[slots[0], :, slots[1]] = lse.t().float()
    return padded[:n].unsqueeze(-1)


def _ragged(lse: torch.Tensor, past: float, neg_inf_as: float | None) -> torch.Tensor:
    """(Tq, Hq, 1) token-major stats, a prefix of a buffer whose next PAST rows hold `past`."""
    t, hq = lse.shape[1], lse.shape[0]
    buf = lse.new_full((t + PAST, hq), past, dtype=torch.float32)
    rows = lse.t().float()
    buf[:t] = rows if neg_inf_as is None else torch.where(rows == float("-inf"), neg_inf_as, rows)
    return buf[:t].unsqueeze(-1)


def _fp32(q, k, v, do, spans, causal: bool, scale: float) -> list[torch.Tensor]:
    """(dq, dk, dv) in fp32 by SDPA per sequence (GQA by repeating kv heads), the rows of no range 0."""
    grads = [torch.zeros(t.shape, device=CUDA) for t in (q, k, v)]
    rep = q.shape[1] // k.shape[1]
    for s, e in spans:
        if e == s:
            continue
        qs, ks, vs = (t[s:e].float().transpose(0, 1).requires_grad_() for t in (q, k, v))
        kx, vx = (t.repeat_interleave(rep, 0) for t in (ks, vs))
        out = torch.nn.functional.scaled_dot_product_attention(qs, kx, vx, is_causal=causal, scale=scale)
        out.backward(do[s:e].float().transpose(0, 1))
        for g, leaf in zip(grads, (qs, ks, vs)):
            g[s:e] = leaf.grad.transpose(0, 1)
    return grads


def _case(spans: list[tuple[int, int]], t: int, causal: bool, ragged_ok: bool, g: torch.Generator) -> dict[str, str]:
    hq, hkv, d = 8, 2, 128
    starts, ends = (torch.tensor(x, device=CUDA) for x in zip(*spans))
    ranges = torch.stack((starts, ends, starts, ends)).long()
    max_q = int((ends - starts).max())
    q, do = (torch.randn(t, hq, d, device=CUDA, generator=g, dtype=torch.bfloat16) for _ in "qo")
    k, v = (torch.randn(t, hkv, d, device=CUDA, generator=g, dtype=torch.bfloat16) for _ in "kv")
    columns = cudnn_graph.range_columns(ranges)
    mask = cudnn_varlen.band_args(causal, (-1, -1), True)
    bounds = (max_q, max_q)
    meta = cudnn_graph.ragged_metadata(columns, (hq * d, hq * d, hq), (hkv * d, hkv * d))
    rows = range_ids(ranges[0], ranges[1], t) >= 0
    with torch.no_grad():
        out, stats = torch.ops.cpcompile.cudnn_thd_fwd(q, k, v, meta, [hq * d, hkv * d, hkv * d], 0.1, *bounds, *mask)
        out = torch.where(rows[:, None, None], out, 0)  # as the executor returns them: rows in no range 0, -inf
        lse = torch.where(rows[None], stats.squeeze(-1).t(), float("-inf"))
        forms = {f"padded {f}": (_padded(lse, ranges, max_q, float(f)), False) for f in ("0", "nan", "-inf", "inf")}
        if ragged_ok:  # the GPU's THD backward takes ragged stats
            forms["ragged, nan past the end"] = (_ragged(lse, float("nan"), None), True)
            forms["ragged, 0 past the end"] = (_ragged(lse, 0.0, None), True)
            forms["ragged, 0 past, -inf as 0"] = (_ragged(lse, 0.0, 0.0), True)
        grads = {}
        for name, (st, ragged) in forms.items():
            q_side = (hq * d, hq * d, hq * d) + ((hq,) if ragged else ())
            bmeta = cudnn_graph.ragged_metadata(columns, q_side, (hkv * d, hkv * d, hkv * d, hkv * d))
            tokens = [hq * d, hq * d, hkv * d, hkv * d]
            grads[name] = torch.ops.cpcompile.cudnn_thd_bwd(do, q, k, v, out, st, bmeta, tokens, 0.1, *bounds, *mask,
                                                            False)  # fmt: skip
    want = grads["padded 0"]
    exact = _fp32(q, k, v, do, spans, causal, 0.1)
    report = {"padded 0 vs fp32": _diffs(want, exact, rows)}
    for name, got in grads.items():
        report[name] = _diffs(got, want, rows)
    return report


def _diffs(got, want, rows: torch.Tensor) -> str:
    """NaN count and max |got - want| of dq, dk, dv on the rows and keys in ranges (the same spans here)."""
    parts = []
    for label, a, b in zip(("dq", "dk", "dv"), got, want):
        a, b = a[rows].float(), b[rows].float()
        parts.append(f"{label} nan {int(a.isnan().sum())} diff {(a - b).abs().nan_to_num(float('inf')).max():.2e}")
    return ", ".join(parts)


def main() -> None:
    import cudnn

    g = torch.Generator(device=CUDA).manual_seed(0)
    cudnn_graph.RAGGED_STATS_ON = True  # the op takes the ragged form only while it is on (this process only)
    ragged_ok = cudnn_graph.reads_ragged_stats(CUDA)
    print(f"ragged stats taken on this GPU: {ragged_ok}")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN backend {cudnn.backend_version()}")
    for case, (spans, t) in CASES.items():
        for causal in (True, False):
            try:
                report = _case(spans, t, causal, ragged_ok, g)
            except (RuntimeError, ValueError) as e:  # a form cuDNN refuses is an answer too (a probe bug is not)
                report = {"refused": f"{type(e).__name__}: {str(e)[:300]}"}
            for form, line in report.items():
                print(f"{case}, causal={causal}, {form}: {line}", flush=True)


if __name__ == "__main__":
    main()
