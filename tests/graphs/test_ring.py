"""The ring region's graphs (fake process group, one process): the rewritten call, collectives per forward and
backward, what the forward saves for backward (never another rank's K/V), and Inductor's forward schedule (each
step's shift issued before the held chunk's blocks run, waited after)."""

from __future__ import annotations

import re

import expecttest
import pytest
import torch
import torch.nn.functional as F
from torch._inductor.utils import run_and_get_code

import cpcompile
from cpcompile.compat.versions import torch_minor
from cpcompile.testing.model import TinyConfig, TinyLlama
from tests.support.fake_pg import aot_graphs, capture_graphs, fake_group, rewritten_graph
from tests.support.graphs import _collectives
from tests.support.ring_order import launch_events, shifts_overlap_kernels


def gqa_attention(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def _qkv(s=16, requires_grad=True):
    return [torch.randn(1, h, s, 16, requires_grad=requires_grad) for h in (4, 2, 2)]


def test_rewritten_graph_snapshot():
    with fake_group(rank=1, world=4):
        code = rewritten_graph(gqa_attention, *_qkv(8, False), strategy="zigzag", comm="ring")
    assert "cpcompile_comms_ring_dense_ring_attention(l_q_, l_k_, l_v_, layout = 'zigzag', causal = True" in code
    assert "group_name = '0', rank = 1, world = 4)" in code


class TestRingSnapshot(expecttest.TestCase):
    def test_zigzag_aot_forward_backward(self):
        """cp=2 zigzag: forward issues the shift, runs step 0's blocks on the local K/V, waits, runs step 1, merges
        (saving only the local K/V); backward shifts the K/V (tied to dout) and sends each step's fp32 dK/dV on."""
        with fake_group(rank=1, world=2):
            fwd, bwd = aot_graphs(gqa_attention, *_qkv(8), strategy="zigzag", comm="ring", kernel="cpu_flash")
        self.assertExpectedInline(
            fwd,
            """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_1: "f32[1, 4, 8, 16]", primals_2: "f32[1, 2, 8, 16]", primals_3: "f32[1, 2, 8, 16]"):
        view: "f32[1, 2, 1, 8, 16]" = torch.ops.aten.view.default(primals_2, [1, 2, 1, 8, 16])
        permute: "f32[8, 1, 1, 2, 16]" = torch.ops.aten.permute.default(view, [3, 2, 0, 1, 4])
        view_1: "f32[1, 2, 1, 8, 16]" = torch.ops.aten.view.default(primals_3, [1, 2, 1, 8, 16])
        permute_1: "f32[8, 1, 1, 2, 16]" = torch.ops.aten.permute.default(view_1, [3, 2, 0, 1, 4])
        stack: "f32[8, 1, 2, 1, 2, 16]" = torch.ops.aten.stack.default([permute, permute_1], 2)
        view_2: "f32[512]" = torch.ops.aten.view.default(stack, [-1])
        all_to_all_single: "f32[512]" = torch.ops._c10d_functional.all_to_all_single.default(view_2, [512, 0], [512, 0], '0')
        select: "f32[8, 2, 1, 2, 16]" = torch.ops.aten.select.int(stack, 1, 0)
        select_1: "f32[8, 1, 2, 16]" = torch.ops.aten.select.int(select, 1, 0)
        select_2: "f32[8, 1, 2, 16]" = torch.ops.aten.select.int(select, 1, 1)
        permute_2: "f32[1, 2, 8, 16]" = torch.ops.aten.permute.default(select_1, [1, 2, 0, 3])
        permute_3: "f32[1, 2, 8, 16]" = torch.ops.aten.permute.default(select_2, [1, 2, 0, 3])
        _scaled_dot_product_flash_attention_for_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(primals_1, permute_2, permute_3, 0.0, True, scale = 0.25)
        getitem: "f32[1, 4, 8, 16]" = _scaled_dot_product_flash_attention_for_cpu[0]
        getitem_1: "f32[1, 4, 8]" = _scaled_dot_product_flash_attention_for_cpu[1]
        wait_tensor: "f32[512]" = torch.ops._c10d_functional.wait_tensor.default(all_to_all_single)
        view_3: "f32[8, 1, 2, 1, 2, 16]" = torch.ops.aten.view.default(wait_tensor, [8, 1, 2, 1, 2, 16])
        select_3: "f32[8, 2, 1, 2, 16]" = torch.ops.aten.select.int(view_3, 1, 0)
        select_4: "f32[8, 1, 2, 16]" = torch.ops.aten.select.int(select_3, 1, 0)
        select_5: "f32[8, 1, 2, 16]" = torch.ops.aten.select.int(select_3, 1, 1)
        permute_4: "f32[1, 2, 8, 16]" = torch.ops.aten.permute.default(select_4, [1, 2, 0, 3])
        permute_5: "f32[1, 2, 8, 16]" = torch.ops.aten.permute.default(select_5, [1, 2, 0, 3])
        slice_1: "f32[1, 2, 4, 16]" = torch.ops.aten.slice.Tensor(permute_4, -2, 0, 4)
        slice_2: "f32[1, 2, 4, 16]" = torch.ops.aten.slice.Tensor(permute_5, -2, 0, 4)
        _scaled_dot_product_flash_attention_for_cpu_1 = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(primals_1, slice_1, slice_2, scale = 0.25)
        getitem_2: "f32[1, 4, 8, 16]" = _scaled_dot_product_flash_attention_for_cpu_1[0]
        getitem_3: "f32[1, 4, 8]" = _scaled_dot_product_flash_attention_for_cpu_1[1]
        maximum: "f32[1, 4, 8]" = torch.ops.aten.maximum.default(getitem_1, getitem_3)
        eq: "b8[1, 4, 8]" = torch.ops.aten.eq.Scalar(maximum, -inf)
        scalar_tensor: "f32[]" = torch.ops.aten.scalar_tensor.default(0.0, dtype = torch.float32, layout = torch.strided, device = device(type='cpu'))
        where: "f32[1, 4, 8]" = torch.ops.aten.where.self(eq, scalar_tensor, maximum)
        sub: "f32[1, 4, 8]" = torch.ops.aten.sub.Tensor(getitem_1, where)
        exp: "f32[1, 4, 8]" = torch.ops.aten.exp.default(sub)
        sub_1: "f32[1, 4, 8]" = torch.ops.aten.sub.Tensor(getitem_3, where)
        exp_1: "f32[1, 4, 8]" = torch.ops.aten.exp.default(sub_1)
        add: "f32[1, 4, 8]" = torch.ops.aten.add.Tensor(exp, exp_1)
        gt: "b8[1, 4, 8]" = torch.ops.aten.gt.Scalar(add, 0)
        reciprocal: "f32[1, 4, 8]" = torch.ops.aten.reciprocal.default(add)
        mul: "f32[1, 4, 8]" = torch.ops.aten.mul.Tensor(reciprocal, 1.0)
        scalar_tensor_1: "f32[]" = torch.ops.aten.scalar_tensor.default(0.0, dtype = torch.float32, layout = torch.strided, device = device(type='cpu'))
        where_1: "f32[1, 4, 8]" = torch.ops.aten.where.self(gt, mul, scalar_tensor_1)
        mul_1: "f32[1, 4, 8]" = torch.ops.aten.mul.Tensor(exp, where_1)
        unsqueeze: "f32[1, 4, 8, 1]" = torch.ops.aten.unsqueeze.default(mul_1, -1)
        mul_2: "f32[1, 4, 8, 16]" = torch.ops.aten.mul.Tensor(getitem, unsqueeze)
        mul_3: "f32[1, 4, 8]" = torch.ops.aten.mul.Tensor(exp_1, where_1)
        unsqueeze_1: "f32[1, 4, 8, 1]" = torch.ops.aten.unsqueeze.default(mul_3, -1)
        mul_4: "f32[1, 4, 8, 16]" = torch.ops.aten.mul.Tensor(getitem_2, unsqueeze_1)
        add_1: "f32[1, 4, 8, 16]" = torch.ops.aten.add.Tensor(mul_2, mul_4)
        gt_1: "b8[1, 4, 8]" = torch.ops.aten.gt.Scalar(add, 0)
        log: "f32[1, 4, 8]" = torch.ops.aten.log.default(add)
        add_2: "f32[1, 4, 8]" = torch.ops.aten.add.Tensor(where, log)
        scalar_tensor_2: "f32[]" = torch.ops.aten.scalar_tensor.default(-inf, dtype = torch.float32, layout = torch.strided, device = device(type='cpu'))
        where_2: "f32[1, 4, 8]" = torch.ops.aten.where.self(gt_1, add_2, scalar_tensor_2)
        detach: "f32[1, 4, 8, 16]" = torch.ops.aten.detach.default(add_1)
        return (add_1, primals_1, stack, where_2, detach)
""",
        )
        self.assertExpectedInline(
            bwd,
            """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_1: "f32[1, 4, 8, 16]", stack: "f32[8, 1, 2, 1, 2, 16]", where_2: "f32[1, 4, 8]", detach: "f32[1, 4, 8, 16]", tangents_1: "f32[1, 4, 8, 16]"):
        view_2: "f32[512]" = torch.ops.aten.view.default(stack, [-1])
        detach_1: "f32[1, 4, 8, 16]" = torch.ops.aten.detach.default(detach)
        in_backward: "f32[8, 1, 2, 1, 2, 16]" = torch.ops.cpcompile.in_backward.default(stack, tangents_1)
        view_4: "f32[512]" = torch.ops.aten.view.default(in_backward, [-1])
        all_to_all_single_1: "f32[512]" = torch.ops._c10d_functional.all_to_all_single.default(view_4, [512, 0], [512, 0], '0')
        select_6: "f32[8, 2, 1, 2, 16]" = torch.ops.aten.select.int(stack, 1, 0)
        select_7: "f32[8, 1, 2, 16]" = torch.ops.aten.select.int(select_6, 1, 0)
        select_8: "f32[8, 1, 2, 16]" = torch.ops.aten.select.int(select_6, 1, 1)
        permute_6: "f32[1, 2, 8, 16]" = torch.ops.aten.permute.default(select_7, [1, 2, 0, 3])
        permute_7: "f32[1, 2, 8, 16]" = torch.ops.aten.permute.default(select_8, [1, 2, 0, 3])
        _scaled_dot_product_flash_attention_for_cpu_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default(tangents_1, primals_1, permute_6, permute_7, detach_1, where_2, 0.0, True, scale = 0.25)
        getitem_4: "f32[1, 4, 8, 16]" = _scaled_dot_product_flash_attention_for_cpu_backward[0]
        getitem_5: "f32[1, 2, 8, 16]" = _scaled_dot_product_flash_attention_for_cpu_backward[1]
        getitem_6: "f32[1, 2, 8, 16]" = _scaled_dot_product_flash_attention_for_cpu_backward[2]
        permute_8: "f32[8, 1, 2, 16]" = torch.ops.aten.permute.default(getitem_5, [2, 0, 1, 3])
        permute_9: "f32[8, 1, 2, 16]" = torch.ops.aten.permute.default(getitem_6, [2, 0, 1, 3])
        stack_1: "f32[8, 2, 1, 2, 16]" = torch.ops.aten.stack.default([permute_8, permute_9], 1)
        stack_2: "f32[8, 1, 2, 1, 2, 16]" = torch.ops.aten.stack.default([stack_1], 1)
        view_5: "f32[512]" = torch.ops.aten.view.default(stack_2, [-1])
        all_to_all_single_2: "f32[512]" = torch.ops._c10d_functional.all_to_all_single.default(view_5, [512, 0], [512, 0], '0')
        wait_tensor_1: "f32[512]" = torch.ops._c10d_functional.wait_tensor.default(all_to_all_single_1)
        view_6: "f32[8, 1, 2, 1, 2, 16]" = torch.ops.aten.view.default(wait_tensor_1, [8, 1, 2, 1, 2, 16])
        select_9: "f32[8, 2, 1, 2, 16]" = torch.ops.aten.select.int(view_6, 1, 0)
        select_10: "f32[8, 1, 2, 16]" = torch.ops.aten.select.int(select_9, 1, 0)
        select_11: "f32[8, 1, 2, 16]" = torch.ops.aten.select.int(select_9, 1, 1)
        permute_10: "f32[1, 2, 8, 16]" = torch.ops.aten.permute.default(select_10, [1, 2, 0, 3])
        permute_11: "f32[1, 2, 8, 16]" = torch.ops.aten.permute.default(select_11, [1, 2, 0, 3])
        slice_3: "f32[1, 2, 4, 16]" = torch.ops.aten.slice.Tensor(permute_10, -2, 0, 4)
        slice_4: "f32[1, 2, 4, 16]" = torch.ops.aten.slice.Tensor(permute_11, -2, 0, 4)
        _scaled_dot_product_flash_attention_for_cpu_backward_1 = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default(tangents_1, primals_1, slice_3, slice_4, detach_1, where_2, 0.0, False, scale = 0.25)
        getitem_7: "f32[1, 4, 8, 16]" = _scaled_dot_product_flash_attention_for_cpu_backward_1[0]
        getitem_8: "f32[1, 2, 4, 16]" = _scaled_dot_product_flash_attention_for_cpu_backward_1[1]
        getitem_9: "f32[1, 2, 4, 16]" = _scaled_dot_product_flash_attention_for_cpu_backward_1[2]
        new_zeros: "f32[1, 2, 4, 16]" = torch.ops.aten.new_zeros.default(permute_10, [1, 2, 4, 16], dtype = torch.float32, pin_memory = False)
        cat: "f32[1, 2, 8, 16]" = torch.ops.aten.cat.default([getitem_8, new_zeros], -2)
        new_zeros_1: "f32[1, 2, 4, 16]" = torch.ops.aten.new_zeros.default(permute_11, [1, 2, 4, 16], dtype = torch.float32, pin_memory = False)
        cat_1: "f32[1, 2, 8, 16]" = torch.ops.aten.cat.default([getitem_9, new_zeros_1], -2)
        permute_12: "f32[8, 1, 2, 16]" = torch.ops.aten.permute.default(cat, [2, 0, 1, 3])
        permute_13: "f32[8, 1, 2, 16]" = torch.ops.aten.permute.default(cat_1, [2, 0, 1, 3])
        stack_3: "f32[8, 2, 1, 2, 16]" = torch.ops.aten.stack.default([permute_12, permute_13], 1)
        stack_4: "f32[8, 1, 2, 1, 2, 16]" = torch.ops.aten.stack.default([stack_3], 1)
        add_3: "f32[1, 4, 8, 16]" = torch.ops.aten.add.Tensor(getitem_4, getitem_7)
        wait_tensor_2: "f32[512]" = torch.ops._c10d_functional.wait_tensor.default(all_to_all_single_2)
        view_7: "f32[8, 1, 2, 1, 2, 16]" = torch.ops.aten.view.default(wait_tensor_2, [8, 1, 2, 1, 2, 16])
        add_4: "f32[8, 1, 2, 1, 2, 16]" = torch.ops.aten.add.Tensor(view_7, stack_4)
        view_8: "f32[512]" = torch.ops.aten.view.default(add_4, [-1])
        all_to_all_single_3: "f32[512]" = torch.ops._c10d_functional.all_to_all_single.default(view_8, [512, 0], [512, 0], '0')
        wait_tensor_3: "f32[512]" = torch.ops._c10d_functional.wait_tensor.default(all_to_all_single_3)
        view_9: "f32[8, 1, 2, 1, 2, 16]" = torch.ops.aten.view.default(wait_tensor_3, [8, 1, 2, 1, 2, 16])
        permute_14: "f32[2, 1, 2, 1, 8, 16]" = torch.ops.aten.permute.default(view_9, [2, 3, 4, 1, 0, 5])
        view_10: "f32[2, 1, 2, 8, 16]" = torch.ops.aten.view.default(permute_14, [2, 1, 2, 8, 16])
        select_12: "f32[1, 2, 8, 16]" = torch.ops.aten.select.int(view_10, 0, 0)
        select_13: "f32[1, 2, 8, 16]" = torch.ops.aten.select.int(view_10, 0, 1)
        return (add_3, select_12, select_13)
""",
        )


@pytest.mark.parametrize("strategy", ["flat", "zigzag"])
def test_collectives_per_step_and_saved_tensors(strategy):
    """cp - 1 K/V shifts forward; backward cp - 1 K/V shifts and cp gradient shifts (the last one brings the
    rank's own K/V gradient home); only local tensors are saved for backward."""
    world = 4
    with fake_group(rank=1, world=world):
        be = cpcompile.backend(strategy=strategy, comm="ring", inner="aot_eager")
        graphs = capture_graphs(gqa_attention, be, *_qkv())
    fw, bw = (_collectives(graphs[n]) for n in ("fw", "bw"))
    assert [str(n.target) for n in fw] == ["_c10d_functional.all_to_all_single.default"] * (world - 1)
    assert [str(n.target) for n in bw] == ["_c10d_functional.all_to_all_single.default"] * (2 * world - 1)
    bw_inputs = [n for n in graphs["bw"].graph.nodes if n.op == "placeholder"]
    kv_like = [n for n in bw_inputs if tuple(n.meta["val"].shape) == (16, 1, 2, 1, 2, 16)]  # (L, 1, 2, B, Hkv, D)
    assert len(kv_like) == 1, f"the forward saves {len(kv_like)} K/V buffers; only the rank's own may be saved"


@pytest.mark.skipif(
    tuple(int(x) for x in torch_minor().split(".")) < (2, 13),
    reason="on CPU the ring's merges are torch ops that Inductor fuses, and torch 2.11's CPU scheduler then issues "
    "the last shift after its step's kernel (2.13 keeps program order); on CUDA, where the merge is a Triton kernel, "
    "tests/gpu/test_ring_issue_order.py checks the order on the GPU machine's torch 2.11",
)
@pytest.mark.parametrize("deferred_merge", [False, True])
def test_inductor_forward_issues_each_shift_before_the_step(deferred_merge):
    """The running merge folds each step in as it comes; the deferred one merges once after the last step: in
    both, no fused merge pulls a later step's kernel ahead of the shift it overlaps."""
    cfg = TinyConfig(layers=1)
    torch.manual_seed(0)
    model = TinyLlama(cfg)
    ids, pos = torch.randint(0, cfg.vocab, (1, 16)), torch.arange(16)[None]
    with fake_group(rank=1, world=4):
        be = cpcompile.backend(strategy="zigzag", comm="ring", deferred_merge=deferred_merge)
        compiled = torch.compile(model, backend=be, fullgraph=True)
        _, codes = run_and_get_code(lambda: compiled(ids, pos).sum().backward())
    fwd = codes[0]
    events = re.findall(r"(all_to_all_single|wait_tensor|_scaled_dot_product_flash_attention_for_cpu)\.default\(", fwd)
    step = ["all_to_all_single", "_scaled_dot_product_flash_attention_for_cpu", "wait_tensor"]
    # one call a step: step 0's blocks are one causal square (comms/ring/schedule.causal_square)
    assert events == [*step, *step, *step, step[1]], events
    assert shifts_overlap_kernels(launch_events(fwd)) is None


def test_deferred_merge_runs_every_step_before_one_merge():
    """backend(deferred_merge=True): the forward graph attends every step, then merges (the LSE merge's exp) once;
    the running merge's first exp comes before the last step's kernel."""
    kernel = "aten._scaled_dot_product_flash_attention_for_cpu.default"

    def order(deferred):
        with fake_group(rank=1, world=4):
            graphs = capture_graphs(gqa_attention, cpcompile.backend(
                strategy="zigzag", comm="ring", inner="aot_eager", deferred_merge=deferred), *_qkv())  # fmt: skip
        targets = [str(n.target) for n in graphs["fw"].graph.nodes if n.op == "call_function"]
        kernels = [i for i, t in enumerate(targets) if t == kernel]
        exps = [i for i, t in enumerate(targets) if t == "aten.exp.default"]
        return len(kernels), kernels[-1], exps[0]

    calls, last_kernel, first_exp = order(True)
    assert calls == 4 and last_kernel < first_exp
    calls, last_kernel, first_exp = order(False)
    assert calls == 4 and first_exp < last_kernel


def _checkpointed_block(x, wq, wk, wv):
    def block(x, wq, wk, wv):
        q, k, v = ((x @ w).view(1, 16, -1, 16).transpose(1, 2) for w in (wq, wk, wv))
        return gqa_attention(q, k, v).transpose(1, 2).reshape(1, 16, 64)

    return torch.utils.checkpoint.checkpoint(block, x, wq, wk, wv, use_reentrant=False)


@pytest.mark.parametrize("comm,regather", [("all_gather", False), ("all_gather", True), ("ring", False)])
def test_checkpointed_block_saves_only_its_inputs(comm, regather):
    """Under per-block activation checkpointing the forward saves only the block's inputs, whatever the comm:
    the recompute gathers (or circulates) K/V again, so regather only adds a third backward collective."""
    inputs = [torch.randn(1, 16, 64, requires_grad=True)] + [
        torch.randn(64, n, requires_grad=True) for n in (64, 32, 32)
    ]
    with fake_group(rank=1, world=4):
        be = cpcompile.backend(strategy="zigzag", comm=comm, inner="aot_eager", regather=regather)
        graphs = capture_graphs(_checkpointed_block, be, *inputs)
    shapes = {tuple(t.shape) for t in inputs}
    saved = [n for n in graphs["bw"].graph.nodes if n.op == "placeholder" and "tangents" not in n.name]
    # aten's attention kernels are seeded ops (dropout), so the recompute replays each one's RNG state: a few bytes
    # each, not activations
    saved = [n for n in saved if not n.name.startswith("rng_state_output")]
    assert {tuple(n.meta["val"].shape) for n in saved} <= shapes, [tuple(n.meta["val"].shape) for n in saved]
    backward = {("all_gather", False): 2, ("all_gather", True): 3, ("ring", False): 3 + 3 + 4}[(comm, regather)]
    assert len(_collectives(graphs["bw"])) == backward


def test_inductor_overlaps_every_step_of_a_plain_layer():
    """On a bare SDPA layer Inductor's peak-memory reordering sank each shift down to its wait (no overlap);
    cpcompile compiles region graphs without it, so every attention call but the last, forward and backward,
    runs while a shift is in flight."""
    from bench.probes.ring_trace import blocks_without_overlap

    q, k, v = _qkv(32)
    with fake_group(rank=1, world=4):
        be = cpcompile.backend(strategy="zigzag", comm="ring", kernel="cpu_flash")
        fn = torch.compile(gqa_attention, backend=be, fullgraph=True)
        _, (fwd, bwd) = run_and_get_code(lambda: fn(q, k, v).sum().backward())
    assert blocks_without_overlap(fwd) == [] and blocks_without_overlap(bwd) == []


def _windowed(q, k, v):
    return cpcompile.attention(q, k, v, is_causal=True, window=(2, 0))


def test_a_short_window_skips_the_steps_it_never_reaches():
    """flat cp=4, chunks of 16, a causal window of 3 tokens: only step 1 (the previous rank's K/V) is visited.
    Forward: one K/V shift to rank + 1. Backward: that shift again, the own gradient's shift with the K/V to rank
    + 1, and the held chunk's gradient home to rank - 1 (offset cp - 1), not cp - 1 + cp shifts."""
    world, rank = 4, 1
    with fake_group(rank=rank, world=world):
        be = cpcompile.backend(strategy="flat", comm="ring", inner="aot_eager")
        graphs = capture_graphs(_windowed, be, *_qkv())
    fw, bw = (_collectives(graphs[n]) for n in ("fw", "bw"))

    def to_rank(node):  # all_to_all_single(x, output_split_sizes, input_split_sizes, group): the one split sent
        (dest,) = [r for r, n in enumerate(node.args[2]) if n]
        return dest

    assert [to_rank(n) for n in fw] == [rank + 1]
    assert sorted(to_rank(n) for n in bw) == [rank - 1, rank + 1, rank + 1]


def _packed_windowed(q, k, v, cu):
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn(q, k, v, cu, cu, 16, 16, window_size=(3, 0))


class TestPackedRingWindowSnapshot(expecttest.TestCase):
    def test_rewritten_call_and_step_blocks(self):
        """thd cp=2, a causal window of 3 tokens (8 a rank): the region call carries the window; step 0 is the
        rank's pieces against themselves (a windowed causal square), step 1 the band block with window (0, 3)
        and the unmasked block (layouts/packed_band.py), bounded by the local length its fillers may span."""
        cu = torch.tensor([0, 5, 16], dtype=torch.int32)
        qkv = [torch.randn(8, 2, 4) for _ in range(3)]
        with fake_group(rank=1, world=2):
            code = rewritten_graph(_packed_windowed, *qkv, cu, strategy="thd", comm="ring")
            fwd, _ = aot_graphs(_packed_windowed, *(t.requires_grad_() for t in qkv), cu, strategy="thd", comm="ring")
        (call,) = [line.strip() for line in code.splitlines() if "ring_varlen_attention(" in line]
        self.assertExpectedInline(
            call,
            """ring_varlen_attention = cpcompile_comms_ring_varlen_ring_varlen_attention(l_q_, l_k_, l_v_, check_packed_metadata, layout = 'thd', causal = True, scale = 0.5, kernel = 'cpu_varlen_ref', group_name = '0', rank = 1, world = 2, max_doc = 16, window = (3, -1))""",  # noqa: E501
        )
        specs = re.findall(
            r"attend_varlen_blocks\.default\(primals_1, \[[^]]*\], \[[^]]*\], \[[^]]*\], (\[[^]]*\])", fwd
        )
        self.assertExpectedInline(
            "\n".join(specs),
            """\
[0, 1, 8, 8, 3, -1, 1, 1, 1]
[0, 0, 8, 8, 0, 3, 0, 0, 0, 0, 0, 8, 8, -1, -1, 0, 0, 0]""",
        )
