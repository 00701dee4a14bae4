"""The all_gather packed-document (THD) region compiled by Inductor, as a model runs it: a single-GPU bench fn.

thd_cases.region_fn runs a rank's region work eagerly: its blocks' metadata (executor.prepare_blocks) is rebuilt
in every timed call and every torch op around the kernel is a launch of its own, which inflates the region's
time most on many small documents (thd_balanced at cp 8). In a model all of it is traced into the region's graph
and compiled by Inductor. `compiled_region_fn` times that: comm="all_gather"'s varlen region itself
(comms/all_gather/varlen.all_gather_varlen_attention: the blocks and key-buffer index from cu_seqlens, their
metadata, the key-buffer copy, the executor ops, the gradient fold and cast), forward and backward, under
torch.compile(fullgraph=True, dynamic=False), with its two collectives replaced by local stand-ins that deliver
what the rank receives (`stand_in_collectives`), as thd_cases.a2a_region_fn replaces a2a's all-to-alls.

What differs from a model's region: no communication (the all-gather returns the case's buffer of every rank's
K/V; the reduce-scatter returns this rank's slice of its own gradient buffer, not the sum over ranks); the pack
of the local K/V the region sends (a copy of T/cp tokens) is left out by Inductor, since the stand-in all-gather
reads none of it; and the region is a graph of its own, so nothing fuses with a model's neighbouring ops.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

import cpcompile.comm.collectives as collectives
from bench import thd_cases
from bench.common import DTYPE, HKV, HQ, D
from cpcompile.comms.all_gather.varlen import all_gather_varlen_attention

# one compile of `region` per rank x case x kernel (hundreds in a sweep), each kept as a cache entry of its own:
# at Dynamo's default limits the region's code would stop compiling (fullgraph=True: an error) part way through
_dynamo_config = torch._dynamo.config
_dynamo_config.recompile_limit = max(_dynamo_config.recompile_limit, 4096)
_dynamo_config.accumulated_recompile_limit = max(_dynamo_config.accumulated_recompile_limit, 4096)


@torch.library.custom_op("cpbench::rank_slice", mutates_args=())
def rank_slice(x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """A copy of rank `rank`'s part of `x` (rank-major on dim 0): the reduce-scatter's stand-in. Opaque to Inductor
    as the collective is, so the region writes the whole gradient buffer it would send, not only this slice."""
    n = x.shape[0] // world
    return x[rank * n : (rank + 1) * n].clone()


@rank_slice.register_fake
def _(x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    return x.new_empty((x.shape[0] // world, *x.shape[1:]))


@contextlib.contextmanager
def stand_in_collectives(gathered: torch.Tensor, rank: int, world: int) -> Iterator[None]:
    """cpcompile's all-gather returns `gathered` (every rank's packed K/V, rank-major, as the collective delivers
    it) and its reduce-scatter rank `rank`'s slice of its input, while inside (read when the region is traced)."""
    saved = collectives._all_gather, collectives._reduce_scatter
    collectives._all_gather = lambda x, dim, group_name: gathered
    collectives._reduce_scatter = lambda x, op, dim, group_name: rank_slice(x, rank, world)
    try:
        yield
    finally:
        collectives._all_gather, collectives._reduce_scatter = saved


@dataclass
class RankCase:
    """A rank's region inputs: q, k, v (leaves; k/v its rows of `gathered`), dout, the model's cu_seqlens
    (thd_cases.model_cu: thd_balanced's plan), every rank's K/V as the all-gather delivers them ((T, 2, Hkv, D),
    rank-major) and the region's arguments (max_doc: the longest document, varlen_attn's max_q/max_k)."""

    layout: str
    cp: int
    rank: int
    max_doc: int
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor
    cu: torch.Tensor
    gathered: torch.Tensor


def rank_case(layout: str, lengths: list[int], cp: int, rank: int) -> RankCase:
    """Rank `rank`'s inputs for these documents, random, on thd_cases.DEVICE."""
    total = sum(lengths)
    local = total // cp
    gathered = torch.randn(total, 2, HKV, D, device=thd_cases.DEVICE, dtype=DTYPE)
    k, v = (gathered[rank * local : (rank + 1) * local, i].clone().requires_grad_() for i in (0, 1))
    q, dout = thd_cases.packed(local, HQ).requires_grad_(), thd_cases.packed(local, HQ)
    cu = thd_cases.model_cu(layout, lengths, cp)[0]
    return RankCase(layout, cp, rank, max(lengths), q, k, v, dout, cu, gathered)


def compiled_region_fn(case: RankCase, kernel: str, compiled: bool = True) -> Callable[[], tuple[torch.Tensor, ...]]:
    """A call: the region's forward and backward on `case` (Inductor-compiled; compiled=False: eager), returning
    (out, dq, dk, dv), dk/dv as the reduce-scatter stand-in returns them (this rank's part of its own gradient)."""
    kw = dict(layout=case.layout, causal=True, scale=thd_cases.SCALE, kernel=kernel, group_name="")
    kw.update(rank=case.rank, world=case.cp, max_doc=case.max_doc)

    def region(q, k, v, cu):
        return all_gather_varlen_attention(q, k, v, cu, **kw)[0]

    attend = torch.compile(region, fullgraph=True, dynamic=False) if compiled else region
    leaves = case.q, case.k, case.v

    def run():
        with stand_in_collectives(case.gathered, case.rank, case.cp):
            out = attend(*leaves, case.cu)
            out.backward(case.dout)
        grads = tuple(t.grad for t in leaves)
        for t in leaves:
            t.grad = None
        return (out.detach(), *grads)

    return run
