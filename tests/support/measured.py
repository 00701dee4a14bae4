"""The benchmark records the cost-model tests replay (measured_cases.json, written by `python -m bench.cost_rates`
from bench/results): each as the SiteShape and cu_seqlens the cost model takes, with its measured times."""

from __future__ import annotations

import functools
import itertools
import json
from pathlib import Path

import torch

from cpcompile.cost import SiteShape
from cpcompile.families.sdpa.costing import DENSE
from cpcompile.families.varlen.costing import PACKED

FILE = Path(__file__).with_name("measured_cases.json")


@functools.cache
def cases() -> dict:
    """{"single_gpu": [...], "multi_gpu": [...]}: the records as cases."""
    return json.loads(FILE.read_text())


def is_packed(case: dict) -> bool:
    return case["layout"] in ("thd", "thd_zigzag")


def shape_of(case: dict) -> SiteShape:
    """A single-GPU record's site: Llama3-8B attention (its hq/hkv/head_dim), bf16, causal, batch 1."""
    tokens = case["S"] // case["cp"]
    return SiteShape(
        costing=PACKED if is_packed(case) else DENSE, batch=1, tokens=tokens, q_heads=case["hq"],
        kv_heads=case["hkv"], head_dim=case["head_dim"], v_head_dim=case["head_dim"], elt=2, acc_elt=4, causal=True,
        world=case["cp"], max_doc=max(case["documents"]) if is_packed(case) else None, return_lse=False,
    )  # fmt: skip


def cu_of(case: dict) -> torch.Tensor | None:
    """The record's document offsets (packed records), as the benchmark built them."""
    if not is_packed(case):
        return None
    return torch.tensor([0, *itertools.accumulate(case["documents"])], dtype=torch.int64)


def measured_ms(case: dict) -> float:
    """The slowest rank's measured time (what the benchmark reports)."""
    return max(case["per_rank_ms"])
