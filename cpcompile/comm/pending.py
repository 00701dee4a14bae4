"""Collectives issued now and waited for later, so the kernels between the two run while the bytes travel.

funcol's wrappers wait right after the collective when traced (`_maybe_wrap_tensor`), which leaves Inductor
nothing to overlap. These call the functional ops themselves and return the un-waited tensor; `wait` is placed
where the result is first needed. The same ops trace under Dynamo/AOT (they are what funcol records), run
eagerly (the work is registered by the op and waited by wait_tensor), and exist on torch 2.11 and 2.13.

The ring shift is an all-to-all whose only non-empty split goes to rank + 1 (and comes from rank - 1): a
peer-to-peer exchange in a collective that traces, on gloo and NCCL alike (funcol's permute_tensor does the
same, but splits by numel on dim 0, so it only works for 1-D tensors).

A collective in a backward whose input is a forward value (the ring's K/V, the all-gather's re-gather) would
be moved into the forward by AOT autograd's partitioner, which never recomputes a collective: it runs it in
the forward and saves its result, the very memory the backward meant to save (the joint graph's CSE even
merges it with the forward's identical collective). `in_backward(x, token)` ties x to a backward value (the
output gradient): a copy of x the partitioner can only compute in the backward.
"""

from __future__ import annotations

import torch

from .route import hop, on_host

_c10d = torch.ops._c10d_functional


@torch.library.custom_op("cpcompile::in_backward", mutates_args=())
def in_backward(x: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """A copy of `x`, computed once `token` (a backward value) exists; `token` is not read."""
    return x.clone()


@in_backward.register_fake
def _in_backward_fake(x, token):
    return torch.empty_like(x)


def wait(pending: torch.Tensor) -> torch.Tensor:
    """The result of a collective issued by one of the `start_*` functions (through the host: already done)."""
    return pending if on_host() else _c10d.wait_tensor(pending)


def _start(issue, x: torch.Tensor) -> torch.Tensor:
    """`issue(x)` un-waited, or through the host (comm/route.py) completed at once."""
    if on_host():
        return hop(lambda c: _c10d.wait_tensor(issue(c)), x)
    return issue(x)


def start_shift(x: torch.Tensor, group_name: str, rank: int, world: int, offset: int = 1) -> torch.Tensor:
    """Send `x` to rank + offset and receive rank - offset's tensor of the same shape (un-waited, flat: view it
    after `wait`). The ring shifts by 1; by more where it skips steps no rank needs (windows)."""
    flat = x.contiguous().view(-1)
    send, recv = [0] * world, [0] * world
    send[(rank + offset) % world] = flat.numel()
    recv[(rank - offset) % world] = flat.numel()
    return _start(lambda t: _c10d.all_to_all_single(t, recv, send, group_name), flat)


def shift(x: torch.Tensor, group_name: str, rank: int, world: int) -> torch.Tensor:
    """start_shift + wait, viewed as `x`."""
    return wait(start_shift(x, group_name, rank, world)).view(x.shape)


def start_all_gather(x: torch.Tensor, group_name: str, world: int) -> torch.Tensor:
    """Rank-major all-gather along dim 0 (un-waited)."""
    return _start(lambda t: _c10d.all_gather_into_tensor(t, world, group_name), x.contiguous())


def start_reduce_scatter(x: torch.Tensor, group_name: str, world: int) -> torch.Tensor:
    """Sum over ranks, this rank's slice of dim 0 (un-waited)."""
    return _start(lambda t: _c10d.reduce_scatter_tensor(t, "sum", world, group_name), x.contiguous())
