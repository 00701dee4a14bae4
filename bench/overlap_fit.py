"""Ship the overlap bench's measured step times to the cost model: bench/results/overlap.json (bench/overlap.py on
the GPU) -> cpcompile/cost/measured.json, read by cpcompile/cost/measured.py (comm="auto" at measured points).
Only rows measured with the link on are kept, one per (point, comm, kernel). CPU only:

    python -m bench.overlap_fit
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "bench/results/overlap.json"
TABLE = ROOT / "cpcompile/cost/measured.json"
KEEP = ("layout", "comm", "kernel", "S", "cp", "hq", "hkv", "head_dim", "levels", "max_doc", "intra_gbps",
        "inter_gbps", "step_ms_link", "step_ms_compute", "link_ms")  # fmt: skip


def table_of(records: list[dict]) -> dict:
    rows = [{k: r.get(k) for k in KEEP} for r in records if r.get("step_ms_link") is not None]
    first = next((r for r in records if r.get("step_ms_link") is not None), {})
    return {
        "source": "bench/results/overlap.json",
        "generated_by": "python -m bench.overlap_fit",
        "device": first.get("device"),
        "torch": first.get("torch"),
        "measured_at": first.get("measured_at"),
        "rows": rows,
    }


def main() -> None:
    table = table_of(json.loads(RECORDS.read_text()))
    TABLE.write_text(json.dumps(table, indent=1) + "\n")
    print(f"wrote {TABLE.relative_to(ROOT)} ({len(table['rows'])} rows)")


if __name__ == "__main__":
    main()
