"""Run a rank's independent kernel calls on two CUDA streams, so one call's last wave overlaps the next call.

A zigzag rank at small per-rank work (e.g. 32K tokens, cp=8: 2K-token chunks) issues 3-4 kernel calls of a
few waves each; on one stream every call ends with a partly idle wave of SMs. The executor's calls are
independent (they only meet in the merge), so they can run side by side: calls go to the current stream or
one side stream, balanced by their work, and the current stream waits for the side stream before the merge.
The side stream first waits for the current one, so it sees every input; every tensor made on the side stream
is recorded on the current stream, so the caching allocator never hands its memory out while it is in use.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import torch

ENABLED = True
"""Module switch for A/B measurements (python -m bench.single_gpu --streams-ab); off, the calls run in order."""

_side: dict[int, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _side:
        _side[index] = torch.cuda.Stream(device=index)
    return _side[index]


def assign(work: Sequence[float]) -> list[int]:
    """Stream (0 = current, 1 = side) of each call: largest first onto the less loaded stream."""
    load = [0.0, 0.0]
    lane = [0] * len(work)
    for i in sorted(range(len(work)), key=lambda i: -work[i]):
        lane[i] = 0 if load[0] <= load[1] else 1
        load[lane[i]] += work[i]
    return lane


def _record(result: Any, stream: torch.cuda.Stream) -> None:
    if isinstance(result, torch.Tensor):
        result.record_stream(stream)
    elif isinstance(result, (tuple, list)):
        for r in result:
            _record(r, stream)


def run_calls(device: torch.device, lanes: Sequence[int], calls: Sequence[Callable[[], Any]]) -> list[Any]:
    """Results of `calls` (thunks), each on the stream `assign` gave it (`lanes`) when on CUDA with more than
    one call, else in order."""
    if device.type != "cuda" or len(calls) < 2 or not ENABLED or torch.cuda.is_current_stream_capturing():
        return [c() for c in calls]
    main = torch.cuda.current_stream(device)
    side = _side_stream(device)
    side.wait_stream(main)
    results = []
    for lane, call in zip(lanes, calls):
        with torch.cuda.stream(side) if lane else nullcontext():
            result = call()
        if lane:
            _record(result, main)
        results.append(result)
    main.wait_stream(side)
    return results
