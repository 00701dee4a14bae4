"""cudnn_varlen traced into a region's graph, on CPU: cpcompile's graph ops run by the stand-in of their contract
(tests/support/cudnn_stand_in.py) registered as the ops' CPU kernels, the region's metadata built inside the graph
as the regions build it (executor.prepare_blocks).

Where the backward reads the stats ragged (cudnn_graph.reads_ragged_stats), the traced graphs must hold no padded
scatter: the padded form costs ~8 kernels a call on the GPU (bench/probes/step_launches.py). The same results
either way."""

from __future__ import annotations

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

from cpcompile import executor
from cpcompile.executor import encode_varlen, prepare_blocks
from cpcompile.kernels import cudnn_graph as cg
from tests.support.cudnn_stand_in import CuDNNStandIn
from tests.unit.test_varlen_executor import SCALE, _case


@pytest.fixture
def ops_on_cpu():
    """cpcompile::cudnn_thd_fwd/_bwd with CPU kernels: the stand-in (the real kernels are CUDA only)."""
    stand_in = CuDNNStandIn()

    def as_allocated(fn):  # the fakes' (and the real kernels') outputs are fresh contiguous tensors
        return lambda *args: tuple(t.contiguous() for t in fn(*args))

    lib = torch.library.Library("cpcompile", "IMPL")
    lib.impl("cudnn_thd_fwd", as_allocated(stand_in.cudnn_thd_fwd), "CPU")
    lib.impl("cudnn_thd_bwd", as_allocated(stand_in.cudnn_thd_bwd), "CPU")
    yield stand_in
    lib._destroy()


def _traced(fn, *inputs):
    """(fn's output and input gradients through aot_autograd, the call targets of its forward and backward graphs)."""
    seen: list[str] = []

    def record(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=aot_autograd(fw_compiler=record, bw_compiler=record), fullgraph=True)
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = compiled(*leaves)
    out.backward(torch.ones_like(out))
    return [out.detach(), *(t.grad for t in leaves)], seen


@pytest.mark.parametrize("strategy", ["thd", "thd_zigzag"])
def test_ragged_stats_leave_no_padded_scatter_in_the_traced_backward(ops_on_cpu, strategy, monkeypatch):
    q, keys, _, block = _case(strategy, True)
    q, k, v = (t.float() for t in (q, keys[:, 0].contiguous(), keys[:, 1].contiguous()))
    ranges, spec = [block.ranges], encode_varlen([block])

    def fn(q, k, v):
        meta = prepare_blocks(ranges, spec, q.shape[0], [k.shape[0]], "cudnn_varlen")  # in the graph, as regions do
        return executor.attend_varlen(q, [k], [v], ranges, spec, SCALE, "cudnn_varlen", meta)[0]

    runs = {}
    for ragged in (False, True):
        monkeypatch.setattr(cg, "reads_ragged_stats", lambda device, ragged=ragged: ragged)
        runs[ragged] = _traced(fn, q, k, v)
    padded_ops, ragged_ops = runs[False][1], runs[True][1]
    # lse_slots' sequence ids (a scatter_add and a cumsum) and padded_at's index_put: in the padded form's graphs,
    # dropped as dead code from the ragged form's (prepare still returns the slots; nothing reads them)
    for op in ("aten.scatter_add.default", "aten.cumsum.default"):  # the block's own masks may use some too
        assert ragged_ops.count(op) < padded_ops.count(op), (op, ragged_ops)
    assert "aten.index_put.default" in padded_ops and "aten.index_put.default" not in ragged_ops, ragged_ops
    assert ragged_ops.count("aten.clone.default") == padded_ops.count("aten.clone.default") + 1  # the transpose
    assert len(ragged_ops) < len(padded_ops)
    for got, want in zip(runs[True][0], runs[False][0]):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
