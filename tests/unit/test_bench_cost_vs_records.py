"""bench/probes/cost_vs_records: auto's tie rule, and a wrong pick reported as wrong (one measured pair, then the
same pair with its measured times swapped)."""

from __future__ import annotations

import json
from pathlib import Path

from bench.probes import cost_vs_records as probe

RECORDS = Path(__file__).resolve().parents[2] / "bench/results/single_gpu_thd_h100.json"


def test_auto_pick_keeps_the_first_kernel_within_tie():
    assert probe.auto_pick({"cudnn_varlen": 1.0, "flash_varlen": 1.04}) == "flash_varlen"
    assert probe.auto_pick({"cudnn_varlen": 1.0, "flash_varlen": 1.2}) == "cudnn_varlen"


def _pair() -> list[dict]:
    key = ("thd", "a2a", "docs-median-8K", 32768, 2)
    recs = [r for r in json.loads(RECORDS.read_text()) if (r["layout"], r["comm"], r["mix"], r["S"], r["cp"]) == key]
    assert sorted(r["kernel"] for r in recs) == ["cudnn_varlen", "flash_varlen"]
    return recs


def test_a_pair_ranked_as_measured_and_the_swapped_pair_wrong(tmp_path, capsys):
    recs = _pair()  # measured: cuDNN 8.22 ms, FA2 13.25 ms; the model ranks cuDNN first
    path = tmp_path / "pair.json"
    path.write_text(json.dumps(recs))
    probe.main(str(path))
    out = capsys.readouterr().out
    assert "1 pairs ranked, 0 ties; auto picks the slower kernel at 0\n" in out
    a, b = recs
    a["slowest_rank_ms"], b["slowest_rank_ms"] = b["slowest_rank_ms"], a["slowest_rank_ms"]
    path.write_text(json.dumps(recs))
    probe.main(str(path))
    out = capsys.readouterr().out
    assert "| cudnn_varlen | WRONG: 1.61x |" in out
    assert "auto picks the slower kernel at 1, the worst 1.61x" in out


def test_gpu_only_leaves_the_host_term_out(tmp_path, capsys):
    """4K tokens a rank under a2a (one call over all documents): cuDNN's GPU time is the shorter (measured 1.32
    against 2.21 ms, steps back to back), but the host time its call adds in the model makes auto take FA2;
    --gpu-only weighs the GPU side alone and ranks it as measured."""
    key = ("thd", "a2a", "docs-median-1K", 32768, 8)
    records = json.loads((RECORDS.parent / "single_gpu_thd_prepared_h100.json").read_text())
    recs = [r for r in records if (r["layout"], r["comm"], r["mix"], r["S"], r["cp"]) == key]
    path = tmp_path / "pair.json"
    path.write_text(json.dumps(recs))
    probe.main(str(path))
    assert "| flash_varlen | WRONG: 1.68x |" in capsys.readouterr().out
    probe.main(str(path), "--gpu-only")
    assert "| cudnn_varlen | right |" in capsys.readouterr().out
