"""The executor's two ways to run one body (executor/dense.py, varlen.py): recorded into the caller's graph for a
traceable provider, or the opaque custom op. Both must give the same out, lse and gradients, and a trace of the
first must hold the kernels themselves, no opaque executor op."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

from cpcompile import executor
from cpcompile.executor import encode_dense, encode_varlen, prepare_blocks
from cpcompile.kernels import VARLEN_PROVIDERS
from cpcompile.layouts import get_layout
from tests.unit.test_varlen_executor import SCALE, _case

OPS = torch.ops.cpcompile


def _graph_targets(fn, *inputs) -> set[str]:
    """The call targets of fn's aot_autograd forward and backward graphs (fn's output summed, backward run)."""
    seen: set[str] = set()

    def record(gm, example_inputs):
        seen.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=aot_autograd(fw_compiler=record, bw_compiler=record), fullgraph=True)
    compiled(*inputs).sum().backward()
    return seen


def _dense_case(seed: int = 0):
    """A zigzag rank's blocks at cp 2 over its own K/V (causal squares batched, one rectangle), fp64, GQA."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 4, 8, 16, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(1, 2, 8, 16, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    blocks = get_layout("zigzag").blocks(2, 1, 4, True, None)
    local = [b for b in blocks if b.source == 0]
    return q, k, v, encode_dense(local)


@pytest.mark.parametrize("acc_out", [False, True])
def test_dense_traced_equals_the_opaque_op(acc_out):
    q, k, v, blocks = _dense_case()
    outs = []
    for run in (executor.attend, OPS.attend_blocks):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out, lse = run(leaves[0], [leaves[1]], [leaves[2]], blocks, 0.25, "cpu_flash", None, acc_out)
        out.sum().backward()
        outs.append([out.detach().to(torch.float64), lse, *(t.grad for t in leaves)])
    for got, want in zip(*outs):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_dense_trace_holds_kernels_not_the_op():
    q, k, v, blocks = _dense_case()

    def fn(q, k, v):
        return executor.attend(q, [k], [v], blocks, 0.25, "cpu_flash")[0]

    targets = _graph_targets(fn, q, k, v)
    assert "aten._scaled_dot_product_flash_attention_for_cpu.default" in targets
    assert "aten._scaled_dot_product_flash_attention_for_cpu_backward.default" in targets
    assert not any("cpcompile.attend_blocks" in t for t in targets), targets


@pytest.fixture
def traced_reference(monkeypatch):
    """The CPU varlen reference run the traced way (it is opaque by default: kernels/cpu_varlen_ref.py)."""
    monkeypatch.setattr(type(VARLEN_PROVIDERS["cpu_varlen_ref"]), "traceable", True)


def _varlen_inputs(strategy: str, causal: bool, split: bool):
    q, keys, dout, block = _case(strategy, causal)
    blocks = [block]
    if split:  # two blocks by sequences: the merge path
        half = block.ranges.shape[1] // 2
        blocks = [
            dataclasses.replace(block, ranges=r, covers_rows=False, covers_keys=False)
            for r in (block.ranges[:, :half], block.ranges[:, half:])
        ]
    ranges, spec = [b.ranges for b in blocks], encode_varlen(blocks)
    k, v = keys[:, 0].contiguous(), keys[:, 1].contiguous()
    meta = prepare_blocks(ranges, spec, q.shape[0], [k.shape[0]], "cpu_varlen_ref")
    return q, k, v, dout, ranges, spec, meta


@pytest.mark.parametrize(
    "strategy,causal,split", [("thd", True, False), ("thd_zigzag", True, True), ("thd", False, True)]
)
def test_varlen_traced_equals_the_opaque_op(traced_reference, strategy, causal, split):
    q, k, v, dout, ranges, spec, meta = _varlen_inputs(strategy, causal, split)
    results = []
    for traced in (True, False):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        args = (leaves[0], [leaves[1]], [leaves[2]], ranges, spec, SCALE, "cpu_varlen_ref", meta)
        out, lse = executor.attend_varlen(*args) if traced else OPS.attend_varlen_blocks(*args)
        out.backward(dout)
        results.append([out.detach(), lse, *(t.grad for t in leaves)])
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_varlen_trace_holds_kernels_not_the_op(traced_reference):
    q, k, v, _, ranges, spec, meta = _varlen_inputs("thd_zigzag", True, True)

    def fn(q, k, v):
        return executor.attend_varlen(q, [k], [v], ranges, spec, SCALE, "cpu_varlen_ref", meta)[0]

    targets = _graph_targets(fn, *(t.detach().requires_grad_() for t in (q, k, v)))
    assert not any("cpcompile.attend_varlen" in t for t in targets), targets
    assert "aten.logsumexp.default" in targets  # the reference's own math, recorded


def test_traced_merge_matches_sdpa_over_the_union():
    """executor.merged as a trace records it: the LSE merge of two key halves is attention over all keys."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 6, 8, generator=g, dtype=torch.float64) for _ in range(3))
    halves = [
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k[:, :, s], v[:, :, s], 0.0, False)
        for s in (slice(0, 3), slice(3, 6))
    ]
    out, _ = torch.compile(executor.merged, backend="aot_eager")(
        [h[0] for h in halves], [h[1] for h in halves], q.dtype
    )
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v))
