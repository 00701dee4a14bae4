"""Where cpcompile's collectives run: on their tensors' device (real runs), or through host memory.

Several ranks sharing one GPU can only talk over gloo (NCCL refuses two ranks on one device), and gloo's
all-gather and reduce-scatter of CUDA tensors crash the process (SIGSEGV on torch 2.11, seen on the H200 without
cpcompile: `python -m bench.probes.gloo_cuda`). `through_host()` makes every collective cpcompile issues copy its
input to the CPU, complete there, and copy the result back: the same results, nothing overlapped. For tests and
the GPU check (`cpcompile.testing.distributed.share_one_gpu`), never for training.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_ON_HOST = [False]


def through_host(enabled: bool = True) -> None:
    """Route this process's cpcompile collectives through host memory (read when a graph is traced)."""
    _ON_HOST[0] = bool(enabled)


def on_host() -> bool:
    """Whether collectives hop through host memory (`through_host`)."""
    return _ON_HOST[0]


def hop(complete: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """`complete(x)` (a collective issued and waited for) run on a CPU copy of `x`, the result back on `x`'s
    device."""
    return complete(x.cpu()).to(x.device)
