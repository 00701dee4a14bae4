"""bench/memory.py on CPU: the script runs a case end to end (tiny shapes, fake group, no allocator stats),
and its target arithmetic is the issue's (single-GPU activations / cp + the comm's allowance)."""

from __future__ import annotations

import json

from bench import memory
from bench.memory_stack import LLAMA3_8B


def test_smoke_run_writes_records(tmp_path):
    out = tmp_path / "memory.json"
    argv = ["--device", "cpu", "--inner", "aot_eager", "--layers", "1", "--comms", "ring,all_gather+regather"]
    memory.main([*argv, "--out", str(out)])
    recs = json.loads(out.read_text())
    assert [(r["name"], r["S"], r["cp"]) for r in recs] == [("ring", 64, 2), ("all_gather+regather", 64, 2)]
    assert all("skipped" not in r and r["compile_s"] > 0 for r in recs), recs


def test_targets_are_single_gpu_activations_per_cp_plus_the_allowance():
    seq, cp = 128 * 1024, 8
    kv_chunk = seq // cp * 2 * 2 * LLAMA3_8B.hkv * LLAMA3_8B.head_dim  # K and V of S/cp tokens, bf16
    args = memory.parse(["--seqs", "128K", "--cps", "8"])
    single = {"peak_bytes": 10 * 2**30 + 800, "static_bytes": 800}
    for name, extra in (("ring", 2 * kv_chunk), ("all_gather+regather", cp * kv_chunk)):
        rec = {"name": name, "S": seq, "cp": cp, "peak_bytes": 3 * 2**30, "static_bytes": 2**30}
        got = memory.targets(rec, single, args)
        assert got["target_bytes"] == 2**30 + 10 * 2**30 // cp + extra
        assert got["activation_bytes"] == 2 * 2**30
        assert got["meets_target"] == (3 * 2**30 <= got["target_bytes"])


def test_sweep_fills_the_targets_from_the_measured_peak(tmp_path, monkeypatch):
    """Each record's target fields come from its own measured peak (a run once recorded them all as None)."""
    peaks = {1: 8 * 2**20, 2: 5 * 2**20}  # bytes by cp: the single-GPU run, then the rank

    def fake_run(blocks, seq, cp, name, args):
        return {"peak_bytes": peaks[cp], "static_bytes": 2**20, "compile_s": 1.0, "step_s": 0.1}

    monkeypatch.setattr(memory, "run_case", fake_run)
    out = tmp_path / "memory.json"
    memory.main(["--device", "cpu", "--layers", "1", "--comms", "ring", "--out", str(out)])
    (rec,) = json.loads(out.read_text())
    assert rec["target_bytes"] == 2**20 + 7 * 2**20 // 2 + rec["allowance_bytes"], rec
    assert rec["meets_target"] == (5 * 2**20 <= rec["target_bytes"])
