"""A fake process group in one process: trace and rewrite as rank r of w without any peers."""

from __future__ import annotations

import contextlib
import re

import torch
import torch.distributed as dist
from torch._dynamo.backends.common import aot_autograd
from torch.testing._internal.distributed.fake_pg import FakeStore


@contextlib.contextmanager
def fake_group(rank: int, world: int):
    """Initialise the default group as the fake backend for the duration of the block."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()


def normalize_gm(code: str) -> str:
    """Drop source-location comments, blank lines and `x = None` frees: snapshots show only the computation."""
    lines = [re.sub(r";\s+[\w\s=]+= None$", "", ln.rstrip()) for ln in code.splitlines()]
    return "\n".join(ln for ln in lines if ln.strip() and not ln.strip().startswith("#")) + "\n"


def rewritten_graph(fn, *args, **backend_kwargs) -> str:
    """The Dynamo graph after the cpcompile pass, normalised."""
    import cpcompile

    be = cpcompile.backend(inner="eager", **backend_kwargs)
    graphs = []

    def capture(gm, example_inputs):
        compiled = be(gm, example_inputs)
        graphs.append(gm.print_readable(print_output=False))
        return compiled

    torch._dynamo.reset()
    torch.compile(fn, backend=capture, fullgraph=True)(*args)
    assert len(graphs) == 1
    return normalize_gm(graphs[0])


def aot_graphs(fn, *args, **backend_kwargs) -> tuple[str, str]:
    """The aot_autograd forward and backward graphs of the rewritten program, normalised."""
    from functorch.compile import make_boxed_func

    import cpcompile

    graphs = []

    def record(gm, example_inputs):
        graphs.append(normalize_gm(gm.print_readable(print_output=False)))
        return make_boxed_func(gm.forward)

    be = cpcompile.backend(inner=aot_autograd(fw_compiler=record, bw_compiler=record), **backend_kwargs)
    torch._dynamo.reset()
    out = torch.compile(fn, backend=be, fullgraph=True)(*args)
    out.sum().backward()
    return graphs[0], graphs[1]


def count_ops(graph_code: str, pattern: str) -> int:
    return len(re.findall(pattern, graph_code))


def capture_graphs(fn, be, *inputs) -> dict:
    """Compile `fn` with cpcompile backend `be`, run forward and backward (of the first output); return the
    rewritten Dynamo graph and the AOT forward/backward graphs ("rewritten", "fw", "bw").

    The min-cut partitioner is the one aot_eager and Inductor use (the default partitioner would re-run
    the forward executor call inside the backward graph, dead code that only DCE would remove)."""
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    graphs = {}

    def keep(name):
        def compiler(gm, example_inputs):
            graphs[name] = gm
            return make_boxed_func(gm)

        return compiler

    def backend(gm, example_inputs):
        graphs["rewritten"] = be.transform(gm)
        aot = aot_autograd(
            fw_compiler=keep("fw"), bw_compiler=keep("bw"), partition_fn=min_cut_rematerialization_partition
        )
        return aot(gm, example_inputs)

    torch._dynamo.reset()
    result = torch.compile(fn, backend=backend, fullgraph=True)(*inputs)
    (result[0] if isinstance(result, tuple) else result).sum().backward()
    return graphs
