"""Measured kernel rates: what a kernel call and a region's own copies cost on the benchmark GPU.

`rates.json` (next to this module) is generated from bench/results/single_gpu.json by `python -m
bench.cost_rates`: per kernel, the least-squares coefficients (non-negative, relative error) of

    ms = heads * (d * (tile * tiles + rect * (rect_tiles - tiles) + br * br_tiles) + cta * ctas
         + grid_q * grid_q + grid_k * grid_k) + call * calls,     d = (head_dim + v_head_dim) / 256

over every measured rank (cost/work.py counts the terms; d scales the per-tile terms from the benchmark's head
dim 128, an assumption for other head dims), and per region (comm, kernel) the time beyond its kernel calls,
`a * exchanged_bytes + b`. Kernels without measurements (the CPU kernels, flash_attn, te) borrow the rates of a
measured kernel of their kind (`proxy`), and say so. Shipping the table keeps the planner and the tests
independent of bench/.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path

from .work import CallWork

TABLE = Path(__file__).with_name("rates.json")
PROXY = {"dense": "flash", "varlen": "flash_varlen"}
"""The measured kernel whose rates stand in for an unmeasured one of the same kind."""


@dataclass(frozen=True)
class KernelRate:
    """One kernel's fitted coefficients (milliseconds per unit; see the module docstring)."""

    name: str
    tile: float = 0.0
    rect: float = 0.0
    cta: float = 0.0
    grid_q: float = 0.0
    grid_k: float = 0.0
    br: float = 0.0
    """Extra per tile of a masked call anchored bottom-right (cuDNN THD's slower kernel)."""
    call: float = 0.0
    proxy_for: str | None = None
    """Set when these are another kernel's rates standing in for `proxy_for` (no measurement of its own)."""

    def ms(self, work: CallWork, q_heads: int, head_dim: int, v_head_dim: int) -> float:
        d = (head_dim + v_head_dim) / 256
        per_head = d * (self.tile * work.tiles + self.rect * (work.rect_tiles - work.tiles))
        per_head += d * self.br * work.br_tiles
        per_head += self.cta * work.ctas + self.grid_q * work.grid_q + self.grid_k * work.grid_k
        return q_heads * per_head + self.call * work.calls


@functools.cache
def table() -> dict:
    """The shipped table (rates.json)."""
    return json.loads(TABLE.read_text())


def kernel_rate(kernel: str, kind: str) -> KernelRate:
    """The measured rates of `kernel`, or its kind's proxy's (KernelRate.proxy_for then names `kernel`)."""
    kernels = table()["kernels"]
    if kernel in kernels:
        return KernelRate(kernel, **kernels[kernel]["coefficients"])
    proxy = PROXY[kind]
    return KernelRate(proxy, **kernels[proxy]["coefficients"], proxy_for=kernel)


def region_overhead_ms(comm: str, kernel: str, exchanged_bytes: int) -> tuple[float, str]:
    """(ms a region spends beyond its kernel calls: packs, copies, masks, folds; which measurement it uses)."""
    overheads = table()["region_overhead"]
    for key in (f"{comm}/{kernel}", f"{comm}/*"):
        if key in overheads:
            entry = overheads[key]
            return entry["ms_per_byte"] * exchanged_bytes + entry["ms"], key
    return 0.0, "none measured"


def host_call_ms(kernel: str) -> float:
    """Host ms a forward + backward call of `kernel` costs beyond flash_varlen's (rates.json "host", measured in
    the compiled packed layer); 0 for kernels not measured there (ATen's ops: tens of microseconds)."""
    return table().get("host", {}).get("kernels", {}).get(kernel, {}).get("call_ms", 0.0)


def link_gbps() -> float:
    """The link bandwidth the comm estimates assume, GB/s a rank sends (CPCOMPILE_LINK_GBPS overrides the
    table's assumption; give every rank the same value, or rank agreement stops the compile)."""
    return float(os.environ.get("CPCOMPILE_LINK_GBPS", table()["link"]["GBps"]))


def inter_gbps() -> float:
    """The inter-node bandwidth a 2-D CP mesh's cross-node level is costed at, GB/s a rank sends
    (CPCOMPILE_INTER_GBPS overrides the table's assumption; the intra-node level uses `link_gbps`)."""
    link = table()["link"]
    return float(os.environ.get("CPCOMPILE_INTER_GBPS", link["inter_GBps"]))


def provenance() -> str:
    """One line: what the rates were measured on, and what is assumed."""
    t = table()
    return (
        f"kernel rates measured on {t['device']} ({t['source']}, {t['measured']}); link {link_gbps():g} GB/s "
        f"per rank {'assumed' if t['link']['assumed'] and 'CPCOMPILE_LINK_GBPS' not in os.environ else 'given'}"
    )
