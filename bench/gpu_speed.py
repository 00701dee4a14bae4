"""The GPU check's speed rows: one CP rank of the compiled attention layer on a fake process group (collectives move
no data, so this is the rank's compute) against the single-GPU layer / cp, measured side by side in one process.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

import cpcompile
from bench.common import time_many_ms
from bench.gpu_layer import LLAMA3_8B, PACKED, build, cu_of, documents, layer_inputs

SPEED_SEQ, SPEED_CP = 32768, 8
DTYPE = torch.bfloat16


@contextlib.contextmanager
def fake_group(rank: int, world: int):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def refused_by_design(comm: str, layout: str) -> bool:
    """The combinations the comm registry refuses for packed layouts (one CPCompileError each)."""
    from cpcompile.comm.registry import COMMS

    return layout in COMMS[comm].varlen_refusals


def _step(fn, x, extra, dout):
    x = x.detach().requires_grad_()

    def run():
        fn(x, *extra).backward(dout)

    return run


def _single(layer, x, cu, longest):
    fn = torch.compile(layer, fullgraph=True, dynamic=False)
    extra = () if cu is None else (cu.to("cuda"), longest)
    out_shape = x.shape
    return _step(fn, x, extra, torch.randn(out_shape, device="cuda", dtype=DTYPE))


def _rank_run(layer, layout, comm, x, cu, rank):
    """(the compiled rank step, the kernel "auto" chose) for `rank` of SPEED_CP on a fake group."""
    local, model_cu, longest = layer_inputs(layout, x, cu)
    be = cpcompile.backend(strategy=layout, comm=comm, kernel="auto", inner="inductor")
    fn = torch.compile(layer, backend=be, fullgraph=True, dynamic=False)
    extra = () if model_cu is None else (model_cu, longest)
    step = _step(fn, local, extra, torch.randn(local.shape, device="cuda", dtype=DTYPE))
    step()  # compile (and plan) now
    return step, ",".join(sorted({p.kernel for p in be.plans}))


def layer_speeds(cases: list[tuple[str, str]]) -> list[tuple[str, bool, str]]:
    rows = []
    layer = build(LLAMA3_8B, DTYPE)
    dense_x = torch.randn(1, SPEED_SEQ, LLAMA3_8B.hidden, device="cuda", dtype=DTYPE)
    packed_x = dense_x[0]
    cu = cu_of(documents(SPEED_SEQ, seed=3, unit=2 * SPEED_CP))
    longest = int((cu[1:] - cu[:-1]).max())
    single = {
        "dense": _single(layer, dense_x, None, 0),
        "packed": _single(layer, packed_x, cu, longest),
    }
    for comm, layout in cases:
        name = f"layer speed {comm}/{layout}"
        kind = "packed" if layout in PACKED else "dense"
        x = packed_x if kind == "packed" else dense_x
        ranks = (0, SPEED_CP - 1) if layout == "thd" else (0,)  # thd's work is unbalanced: both ends
        if refused_by_design(comm, layout):
            try:
                with fake_group(0, SPEED_CP):
                    _rank_run(layer, layout, comm, x, cu, 0)
                rows.append((name, False, "ran, but the registry says this comm refuses this layout"))
            except cpcompile.CPCompileError as e:
                rows.append((name, True, f"refused as documented: {str(e).splitlines()[0][:90]}..."))
            continue
        effs, kernels = [], set()
        for rank in ranks:
            with fake_group(rank, SPEED_CP):
                step, kernel = _rank_run(layer, layout, comm, x, cu, rank)
                ref_ms, rank_ms = time_many_ms([single[kind], step], iters=10, warmup=3)
            torch._dynamo.reset()
            effs.append((rank, ref_ms / SPEED_CP / rank_ms, rank_ms))
            kernels.add(kernel)
        detail = ", ".join(f"rank {r}: {e:.3f} ({ms:.2f} ms)" for r, e, ms in effs)
        rows.append((name, True, f"kernel {'/'.join(sorted(kernels))}; efficiency {detail}"))
    return rows
