"""Run-time guards the pass inserts next to the regions: checks every rank makes together, so a bad input is
an error on every rank (never a hang on one rank waiting for another, never a silently wrong answer).

Each guard gathers a few int64 values from every rank of the CP group (one small collective) and asserts on
device (`torch._assert_async`: no host sync; on CPU it raises at once, on CUDA it fails the stream) that
they agree, before the region's own collectives run.
"""

from __future__ import annotations

import torch

from ..comm.collectives import all_gather_dim0


def _agreed(values: torch.Tensor, group_name: str, message: str) -> torch.Tensor:
    """All-gather the int64 vector `values` (same length on every rank) and assert every rank sent the same."""
    gathered = all_gather_dim0(values.reshape(1, -1), group_name)
    torch._assert_async((gathered == gathered[:1]).all(), message)
    return gathered


def agree_condition(pred: torch.Tensor, *, group_name: str, world: int) -> torch.Tensor:
    """`pred` of a torch.cond whose branches hold CP regions, once every rank has the same value: ranks taking
    different branches would issue different collectives."""
    del world
    _agreed(pred.reshape(()).to(torch.int64), group_name, "cpcompile: the condition of a torch.cond around "
            "attention differs between CP ranks; make it the same on every rank (e.g. a Python bool)")  # fmt: skip
    return pred
