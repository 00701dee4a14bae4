"""The measured numbers README.md quotes ("What is measured") are the records' (bench/results/*.json): each claim
below is computed from the records and must appear in README word for word. A re-run that moves a number fails
here until the README says the new one (issue 43: the README and the docs quoted three different packed paths
as the fastest, one of them from superseded records)."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"


def _records(name: str) -> list[dict]:
    data = json.loads((RESULTS / f"{name}.json").read_text())
    return data["records"] if isinstance(data, dict) and "records" in data else data


def _span(values: list[float], digits: int = 2) -> str:
    return f"{min(values):.{digits}f}-{max(values):.{digits}f}"


def _kilo(tokens: list[int]) -> str:
    return f"{min(tokens) // 1024}K-{max(tokens) // 1024}K"


def _single_gpu(layout: str, kernel: str, comm: str = "all_gather", **match) -> list[dict]:
    return [
        r
        for r in _records("single_gpu")
        if (r["layout"], r["kernel"], r.get("comm", "all_gather")) == (layout, kernel, comm)
        and all(r.get(k) == v for k, v in match.items())
    ]


def dense_claims() -> list[str]:
    zigzag, flat = _single_gpu("zigzag", "cudnn"), _single_gpu("flat", "cudnn")
    sizes, cps = [r["S"] for r in zigzag], [r["cp"] for r in zigzag]
    return [
        f"zigzag on cuDNN runs at {_span([r['efficiency'] for r in zigzag])} of the ideal",
        f"S = {_kilo(sizes)} and cp = {min(cps)}-{max(cps)}",
        f"flat, whose last rank does most of the causal work, at {_span([r['efficiency'] for r in flat])}",
    ]


THD_PATHS = {"thd + a2a": ("thd", "a2a"), "thd_zigzag + all_gather": ("thd_zigzag", "all_gather"),
             "thd_balanced + all_gather": ("thd_balanced", "all_gather"), "thd + all_gather": ("thd", "all_gather")}  # fmt: skip


def packed_claims() -> list[str]:
    rows = {name: _single_gpu(layout, "cudnn_varlen", comm) for name, (layout, comm) in THD_PATHS.items()}
    claims = [f"{name} {_span([r['efficiency'] for r in found])}" for name, found in rows.items()]
    points: dict[tuple, dict[str, float]] = defaultdict(dict)
    for name, found in rows.items():
        for r in found:
            points[(r["mix"], r["S"], r["cp"])][name] = r["efficiency"]
    best = {point: max(p, key=p.get) for point, p in points.items()}
    a2a = sum(name == "thd + a2a" for name in best.values())
    claims.append(f"thd + a2a is the fastest at {a2a} of the {len(points)} measured points")
    zigzag = {point[1] for point, name in best.items() if name == "thd_zigzag + all_gather"}
    assert len(zigzag) == 1 and len(best) - a2a == sum(name == "thd_zigzag + all_gather" for name in best.values())
    claims.append(f"thd_zigzag + all_gather at the other {len(best) - a2a} (all at S = {zigzag.pop() // 1024}K)")
    long_docs = [r["efficiency"] for r in rows["thd + a2a"] if r["mix"] == "docs-median-8K" and r["S"] >= 65536]
    claims.append(f"{_span(long_docs)} with documents of ~8K tokens at S >= 64K")
    fa2 = {(lay, comm, r["mix"], r["S"], r["cp"]): r["efficiency"] for lay, comm in THD_PATHS.values()
           for r in _single_gpu(lay, "flash_varlen", comm)}  # fmt: skip
    both = {(lay, comm, r["mix"], r["S"], r["cp"]): (fa2[(lay, comm, r["mix"], r["S"], r["cp"])], r["efficiency"])
            for name, (lay, comm) in THD_PATHS.items() for r in rows[name] if (lay, comm, r["mix"], r["S"], r["cp"]) in fa2}  # fmt: skip
    faster = [f / c for f, c in both.values() if f > c]
    margin = f"{math.ceil(100 * (max(faster) - 1))}%" if faster else "0%"
    claims.append(f"is faster at {len(faster)} of the {len(both)} points, by at most {margin}")
    return claims


def multi_gpu_claims() -> list[str]:
    records = [r for r in _records("multi_gpu") if not r.get("dry_run")]
    assert {r["cp"] for r in records} == {2}, "README says only cp = 2 was measured on real GPUs"
    claims = []
    for tokens in (32768, 8192):
        (row,) = [r for r in records if (r.get("layout"), r.get("comm"), r["tokens_per_gpu"]) == ("zigzag", "all_gather", tokens)]  # fmt: skip
        claims.append(
            f"{tokens // 1024}K tokens a GPU: zigzag + all_gather at {row['efficiency']:.3f} of the ideal, "
            f"{row['speedup_vs_pytorch_cp']:.2f}x"
        )
    (step,) = [r for r in records if r.get("kind") == "train_step" and r["tokens_per_gpu"] == 32768]
    claims.append(
        f"{step['cpcompile_zigzag_ms']:.0f} ms over 2 GPUs against {step['no_cp_full_sequence_per_gpu_ms']:.0f} ms"
    )
    return claims


def flex_claims() -> list[str]:
    rows = json.loads((RESULTS / "flex.json").read_text())["rows"]
    causal = [r["efficiency"] for r in rows if r["mask"] == "causal"]
    documents = [r["efficiency"] for r in rows if r["mask"] == "document"]
    return [f"FlexAttention with causal masks at {_span(causal)}", f"unbalanced ({_span(documents)})"]


def compiled_layer_claims() -> list[str]:
    """The GPU check's compiled layer (compiled_layer.json: one rank, 4K tokens, one step at a time) and the CUDA
    graphs probe on the traced executor (cudagraph_layer_h100.json)."""
    rows = _records("compiled_layer")
    zigzag = {r["comm"]: r["efficiency"] for r in rows if r["layout"] == "zigzag" and r["rank"] == 0}
    packed = [r["efficiency"] for r in rows if r["layout"] != "zigzag"]
    ratios = [r["host_ratio"] for r in rows]
    graphs = _records("cudagraph_layer_h100")
    skips = sum(r["cudagraph_skips"] for r in graphs if r["mode"] != "default")
    return [
        f"zigzag + a2a at {zigzag['a2a']:.2f}, all_gather {zigzag['all_gather']:.2f}, ring {zigzag['ring']:.2f}",
        f"packed documents {_span(packed)}",
        f"host time {_span(ratios)} of the GPU time",
        f"{skips} cudagraph skips on {len({(r['comm'], r['layout']) for r in graphs})} rows",
    ]


@pytest.mark.parametrize("claims", [dense_claims, packed_claims, multi_gpu_claims, flex_claims, compiled_layer_claims])
def test_readme_quotes_the_records(claims):
    readme = " ".join((ROOT / "README.md").read_text().split())  # line breaks as spaces
    missing = [claim for claim in claims() if claim not in readme]
    assert not missing, f"README.md does not say (computed from bench/results): {missing}"
