"""bench/window_stack.py on CPU: the Gemma-3-like stack runs end to end on a fake group (tiny shapes), the ring
row measured (no error row), and the ring's windowed layers visit only the steps their window reaches."""

from __future__ import annotations

import json

from bench import window_stack


def test_smoke_run_writes_a_row_per_comm(tmp_path):
    out = tmp_path / "w.json"
    argv = ["--device", "cpu", "--seq", "128", "--cp", "4", "--window", "8", "--local", "1", "--iters", "1"]
    window_stack.main([*argv, "--comms", "ring", "--out", str(out)])
    got = json.loads(out.read_text())
    recs = got["records"]
    assert [r["comm"] for r in recs] == ["ring"]
    assert all("error" not in r and r["step_ms"] > 0 and r["efficiency"] > 0 for r in recs), recs
    # zigzag, 16-token chunks, an 8-token window: a rank reads its own chunks and its two neighbours' (3 of 4)
    assert recs[0]["ring_steps_windowed"] == 3
    assert got["single_gpu"]["step_ms"] > 0
