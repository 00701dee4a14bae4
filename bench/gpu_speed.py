"""The GPU check's speed rows: one CP rank of the compiled attention layer on a fake process group (collectives move
no data, so this is the rank's compute) against the single-GPU layer / cp, measured side by side in one process.
"""

from __future__ import annotations

import contextlib
import time
import traceback

import torch
import torch.distributed as dist

import cpcompile
from bench.common import back_to_back_ms, host_and_gpu_ms, time_many_ms
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


def check_layer(seq: int = SPEED_SEQ) -> tuple:
    """(the GPU check's layer, its dense input (1, seq, hidden), the cu_seqlens of its documents): what a probe of
    the check's rows builds first (Dynamo's cache raised for the many compiles a probe makes)."""
    torch._dynamo.config.cache_size_limit = 256
    layer = build(LLAMA3_8B, DTYPE)
    dense_x = torch.randn(1, seq, LLAMA3_8B.hidden, device="cuda", dtype=DTYPE)
    return layer, dense_x, cu_of(documents(seq, seed=3, unit=2 * SPEED_CP))


def warm_rank_step(layer, case: str, dense_x: torch.Tensor, cu: torch.Tensor, rank: int, kernel: str = "auto"):
    """`rank_step` for a "comm:layout" case (packed layouts take the dense input's one sequence), run three times
    so compiles and first calls are behind it: (step, the kernel it resolved to)."""
    comm, layout = case.split(":")
    step, resolved = rank_step(layer, layout, comm, dense_x[0] if layout in PACKED else dense_x, cu, rank, kernel)
    for _ in range(3):
        step()
    return step, resolved


def refused_by_design(comm: str, layout: str) -> bool:
    """The combinations the comm registry refuses by design (one CPCompileError each): its capabilities."""
    from cpcompile.comms.registry import refuses_layout

    return refuses_layout(comm, layout)


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


def host_floor(layer, dense_x, packed_x, cu) -> dict[str, dict[str, float]]:
    """The same layer compiled without cpcompile on one rank's share of the tokens (S / cp; packed: the documents
    clipped there): its host and GPU time a step. No CP region runs, so its host time is what Inductor's code, the
    projections and autograd cost a step: the floor a rank's host time cannot go below."""
    tokens = SPEED_SEQ // SPEED_CP
    clipped = torch.cat([cu[cu < tokens], cu.new_tensor([tokens])])
    longest = int((clipped[1:] - clipped[:-1]).max())
    steps = {
        "dense": _single(layer, dense_x[:, :tokens].contiguous(), None, 0),
        "packed": _single(layer, packed_x[:tokens].contiguous(), clipped, longest),
    }
    floor = {}
    for kind, step in steps.items():
        for _ in range(3):
            step()
        host, gpu = host_and_gpu_ms(step)
        floor[kind] = dict(tokens=tokens, host_ms=round(host, 3), gpu_ms=round(gpu, 3))
    return floor


def rank_step(layer, layout, comm, x, cu, rank, kernel: str = "auto", **options):
    """(the compiled rank step, the kernel `kernel` resolved to) for `rank` of SPEED_CP on a fake group;
    `options`: more cpcompile.backend keywords (e.g. deferred_merge=True)."""
    local, model_cu, longest = layer_inputs(layout, x, cu)
    be = cpcompile.backend(strategy=layout, comm=comm, kernel=kernel, inner="inductor", **options)
    fn = torch.compile(layer, backend=be, fullgraph=True, dynamic=False)
    extra = () if model_cu is None else (model_cu, longest)
    step = _step(fn, local, extra, torch.randn(local.shape, device="cuda", dtype=DTYPE))
    step()  # compile (and plan) now
    return step, ",".join(sorted({p.kernel for p in be.plans}))


def _cases_for(cases, rank):
    return [(c, lay) for c, lay in cases if rank == 0 or (lay == "thd" and not refused_by_design(c, lay))]


def layer_speeds(
    cases: list[tuple[str, str]],
    before_timing=lambda: None,
    deadline: float = float("inf"),
    records: list[dict] | None = None,
    floor: dict | None = None,
) -> list[tuple[str, bool, str]]:
    """Compile every case for rank 0 (and thd, whose work is unbalanced, for the last rank too), call
    `before_timing` (the check waits there for its other GPU work), then time each against the single-GPU layer.
    `records` (given): one dict a timed rank appended (bench/results/compiled_layer.json's rows); `floor` (given):
    filled with `host_floor`'s numbers, timed after the rows."""
    torch._dynamo.config.cache_size_limit = 256  # one module compiled with many backends
    torch._dynamo.config.accumulated_cache_size_limit = 1024
    rows: dict[tuple[str, str], list] = {}
    layer = build(LLAMA3_8B, DTYPE)
    dense_x = torch.randn(1, SPEED_SEQ, LLAMA3_8B.hidden, device="cuda", dtype=DTYPE)
    packed_x = dense_x[0]
    cu = cu_of(documents(SPEED_SEQ, seed=3, unit=2 * SPEED_CP))
    longest = int((cu[1:] - cu[:-1]).max())
    single = {"dense": _single(layer, dense_x, None, 0), "packed": _single(layer, packed_x, cu, longest)}
    for fn in single.values():
        fn()
    waited = False
    for rank in (0, SPEED_CP - 1):
        steps = {}
        with fake_group(rank, SPEED_CP):
            for comm, layout in _cases_for(cases, rank):
                kind = "packed" if layout in PACKED else "dense"
                x = packed_x if kind == "packed" else dense_x
                if refused_by_design(comm, layout):
                    try:
                        rank_step(layer, layout, comm, x, cu, rank)
                        rows[(comm, layout)] = [False, "ran, but the registry says this comm refuses this layout"]
                    except Exception as e:  # noqa: BLE001  (Dynamo wraps the backend's CPCompileError)
                        ok = isinstance(e, cpcompile.CPCompileError) or isinstance(
                            e.__cause__, cpcompile.CPCompileError
                        )
                        ok = ok or "CPCompileError: " in str(e)
                        rows[(comm, layout)] = [ok, f"{'refused as documented' if ok else 'crashed'}: "
                                                    f"{str(e).splitlines()[0][:90]}..."]  # fmt: skip
                    continue
                if time.perf_counter() > deadline - 45:  # leave the timing its time
                    if (comm, layout) in rows:  # an earlier rank's row stands; say this rank was not timed
                        rows[(comm, layout)][1] += f", rank {rank}: not compiled within the check's deadline"
                    else:
                        rows[(comm, layout)] = [False, "not compiled within the check's deadline"]
                    continue
                try:
                    steps[(comm, layout)] = (*rank_step(layer, layout, comm, x, cu, rank), kind)
                except Exception as e:  # noqa: BLE001  (a crash is this row's failure)
                    traceback.print_exc()
                    rows[(comm, layout)] = [False, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"]
            if not waited:
                before_timing()
                waited = True
            for key, (step, kernel, kind) in steps.items():
                ref_ms, rank_ms = time_many_ms([single[kind], step], iters=10, warmup=3)
                host_ms, gpu_ms = host_and_gpu_ms(step)
                piped_ms = back_to_back_ms(step)
                ideal = ref_ms / SPEED_CP
                eff = (
                    f"rank {rank}: {ideal / rank_ms:.3f} ({rank_ms:.2f} ms vs {ref_ms:.2f} / {SPEED_CP}), back to back "
                    f"{ideal / piped_ms:.3f}, host {host_ms:.2f} ms / GPU {gpu_ms:.2f} ms = {host_ms / gpu_ms:.2f}"
                )
                if records is not None:
                    records.append(
                        dict(layout=key[1], comm=key[0], S=SPEED_SEQ, cp=SPEED_CP, rank=rank, kernel=kernel,
                             efficiency=round(ideal / rank_ms, 4), rank_ms=round(rank_ms, 3),
                             single_gpu_ms=round(ref_ms, 3), back_to_back_efficiency=round(ideal / piped_ms, 4),
                             back_to_back_ms=round(piped_ms, 3), host_ms=round(host_ms, 3), gpu_ms=round(gpu_ms, 3),
                             host_ratio=round(host_ms / gpu_ms, 3))
                    )  # fmt: skip
                if key in rows:
                    rows[key][1] += f", {eff}"
                else:
                    rows[key] = [True, f"kernel {kernel}; efficiency {eff}"]
    if floor is not None and time.perf_counter() < deadline - 20:
        try:  # a reference, not a row: its failure is printed and leaves the rows standing
            floor.update(host_floor(layer, dense_x, packed_x, cu))
        except Exception:  # noqa: BLE001
            traceback.print_exc()
    return [(f"layer speed {c}/{lay}", *rows[(c, lay)]) for c, lay in cases if (c, lay) in rows]
