"""Measured step times of the compiled attention layer on a stand-in link (bench/overlap.py on one GPU), shipped as
`measured.json` next to this module by `python -m bench.overlap_fit`: where a site is exactly a measured point
(layout, tokens a rank, cp, heads, head dim, the 2-D mesh or one node, the link bandwidths the model assumes),
comm="auto" ranks the measured options by their measured step time, communication and its overlap included,
instead of the model's estimate (cost/choose.py), and the comms "auto" otherwise never considers (the ring:
Comm.auto_option) compete there (families/auto.py). Everywhere else nothing changes. No table: no measured point.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from .rates import inter_gbps, link_gbps

TABLE = Path(__file__).with_name("measured.json")


@functools.cache
def rows() -> dict[tuple, dict[str, float]]:
    """{point: {(comm, kernel): step ms with the link}} from the shipped table (cached: `rows.cache_clear()`
    after changing TABLE)."""
    if not TABLE.exists():
        return {}
    out: dict[tuple, dict] = {}
    for r in json.loads(TABLE.read_text())["rows"]:
        out.setdefault(point_of_record(r), {})[(r["comm"], r["kernel"])] = r["step_ms_link"]
    return out


def point_of_record(r: dict) -> tuple:
    """The key of a bench/overlap.py record: what a site must equal for the measurement to apply."""
    return (r["layout"], r["S"], r["cp"], r["hq"], r["hkv"], r["head_dim"], r["levels"], r.get("max_doc"),
            float(r["intra_gbps"]), float(r["inter_gbps"]))  # fmt: skip


def point_of_site(shape, layout: str, intra: float, inter: float) -> tuple | None:
    """The key of a site (cost/shape.SiteShape) under `layout`, or None where no measurement could apply (the
    bench measures batch 1, bf16, causal, no window, every layout's heads whole)."""
    if shape.batch != 1 or shape.elt != 2 or not shape.causal or shape.block_window is not None:
        return None
    levels = f"{shape.levels[0]}x{shape.levels[1]}" if shape.levels else f"1x{shape.world}"
    return (layout, shape.tokens, shape.world, shape.q_heads, shape.kv_heads, shape.head_dim, levels, shape.max_doc,
            float(intra), float(inter))  # fmt: skip


def measured_ms(point: tuple | None, comm: str, kernel: str) -> float | None:
    """The measured step time of (comm, kernel) at `point`, or None."""
    if point is None:
        return None
    return rows().get(point, {}).get((comm, kernel))


def measured_at(shape, layout: str, comm: str, kernel: str) -> float | None:
    """The measured step time of (comm, kernel) at the site `shape` under `layout`, on the links the cost model
    assumes (cost/rates.py), or None."""
    return measured_ms(point_of_site(shape, layout, link_gbps(), inter_gbps()), comm, kernel)
