"""bench/overlap.py on CPU (tiny shapes, aot_eager): every case compiles and runs as one rank on the link group,
on each of its topologies, and the link group counts exactly the bytes the comm registry says a rank sends
(dense; packed: plus the metadata check's 16-byte all-gather to each peer). The GPU run is the lead's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_cpu_smoke_rows_count_the_registry_bytes(tmp_path):
    out = tmp_path / "overlap.json"
    cmd = [sys.executable, "-m", "bench.overlap", "--device", "cpu", "--out", str(out)]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    rows = json.loads(out.read_text())
    assert not [r for r in rows if "error" in r or "skipped" in r], rows
    got = {(r["layout"], r["comm"], r["levels"]) for r in rows}
    assert got == {
        ("zigzag", "all_gather", "1x4"), ("zigzag", "all_gather", "2x2"), ("zigzag", "hierarchical", "2x2"),
        ("thd_balanced", "selective", "1x4"), ("thd_balanced", "selective", "2x2"),
    }  # fmt: skip
    for r in rows:
        assert r["wire_bytes_fwd"] > 0 and r["step_ms_link"] > 0 and r["step_ms_compute"] > 0, r
        assert r["unmodelled_bytes"] == (16 * (r["cp"] - 1) if r["layout"] == "thd_balanced" else 0), r
        assert r["link_ms"] > 0 and r["link_measured_ms"] == 0  # no GPU: counted, not slept
        assert r["waited"] == r["collectives"], r  # every result waited through the link group's Work
        assert r["planner_point"] is None  # fp32: no measured point could apply (the GPU rows are bf16)
    hier = next(r for r in rows if r["comm"] == "hierarchical")
    assert [lv["dim"] for lv in hier["level_bytes"]] == ["cp_intra", "cp_inter"]
    assert len(hier["bytes_by_group"]) == 2  # the a2a inside the node and the ring across, each on its group
    flat = {r["levels"]: r for r in rows if r["comm"] == "all_gather"}
    assert flat["2x2"]["link_ms"] > flat["1x4"]["link_ms"]  # the same bytes across nodes: the slower link
