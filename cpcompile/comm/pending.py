"""Collectives issued now and waited for later, so the kernels between the two run while the bytes travel.

funcol's wrappers wait right after the collective when traced (`_maybe_wrap_tensor`), which leaves Inductor
nothing to overlap. These call the functional ops themselves and return the un-waited tensor; `wait` is placed
where the result is first needed. The same ops trace under Dynamo/AOT (they are what funcol records), run
eagerly (the work is registered by the op and waited by wait_tensor), and exist on torch 2.11 and 2.13.

The ring shift is an all-to-all whose only non-empty split goes to rank + 1 (and comes from rank - 1): a
peer-to-peer exchange in a collective that traces, on gloo and NCCL alike (funcol's permute_tensor does the
same, but splits by numel on dim 0, so it only works for 1-D tensors).
"""

from __future__ import annotations

import torch

_c10d = torch.ops._c10d_functional


def wait(pending: torch.Tensor) -> torch.Tensor:
    """The result of a collective issued by one of the `start_*` functions."""
    return _c10d.wait_tensor(pending)


def start_shift(x: torch.Tensor, group_name: str, rank: int, world: int) -> torch.Tensor:
    """Send `x` to rank + 1 and receive rank - 1's tensor of the same shape (un-waited, flat: view it after
    `wait`)."""
    flat = x.contiguous().view(-1)
    send, recv = [0] * world, [0] * world
    send[(rank + 1) % world] = flat.numel()
    recv[(rank - 1) % world] = flat.numel()
    return _c10d.all_to_all_single(flat, recv, send, group_name)


def shift(x: torch.Tensor, group_name: str, rank: int, world: int) -> torch.Tensor:
    """start_shift + wait, viewed as `x`."""
    return wait(start_shift(x, group_name, rank, world)).view(x.shape)


def start_all_gather(x: torch.Tensor, group_name: str, world: int) -> torch.Tensor:
    """Rank-major all-gather along dim 0 (un-waited)."""
    return _c10d.all_gather_into_tensor(x.contiguous(), world, group_name)


def start_reduce_scatter(x: torch.Tensor, group_name: str, world: int) -> torch.Tensor:
    """Sum over ranks, this rank's slice of dim 0 (un-waited)."""
    return _c10d.reduce_scatter_tensor(x.contiguous(), "sum", world, group_name)
