# ruff: noqa: E501  (graph snapshots keep their long lines)
"""The graph the pass produces for varlen_attn sites (fake process group, one process): part of its contract."""

from __future__ import annotations

import expecttest
import pytest
import torch
from torch.nn.attention.varlen import AuxRequest, varlen_attn

import cpcompile
from cpcompile.testing.varlen_model import GQA
from tests.support.fake_pg import aot_graphs, count_ops, fake_group, rewritten_graph
from tests.support.graphs import on_snapshot_torch


def causal_with_lse(q, k, v, cu):
    out, lse = varlen_attn(q, k, v, cu, cu, 16, 16, window_size=(-1, 0), return_aux=AuxRequest(lse=True))
    return out * 2, lse


def causal(q, k, v, cu):
    return varlen_attn(q, k, v, cu, cu, 16, 16, window_size=(-1, 0))


def full(q, k, v, cu):
    return varlen_attn(q, k, v, cu, cu, 32, 32, **GQA)  # max_q/max_k bound the 24-token document


def _inputs(heads=(2, 2), cu=(0, 3, 16, 32), requires_grad=False):
    q = torch.randn(8, heads[0], 4, requires_grad=requires_grad)
    k = torch.randn(8, heads[1], 4, requires_grad=requires_grad)
    v = torch.randn(8, heads[1], 4, requires_grad=requires_grad)
    return q, k, v, torch.tensor(cu, dtype=torch.int32)


class TestThdSnapshot(expecttest.TestCase):
    def test_thd_causal_with_lse(self):
        with fake_group(rank=1, world=4):
            code = rewritten_graph(causal_with_lse, *_inputs(), strategy="thd")
        self.assertExpectedInline(
            code,
            """\
class GraphModule(torch.nn.Module):
    def forward(self, L_q_: "f32[8, 2, 4]", L_k_: "f32[8, 2, 4]", L_v_: "f32[8, 2, 4]", L_cu_: "i32[4]"):
        l_q_ = L_q_
        l_k_ = L_k_
        l_v_ = L_v_
        l_cu_ = L_cu_
        check_packed_metadata: "i32[4]" = cpcompile_regions_guards_check_packed_metadata(l_cu_, total = 32, max_doc = 16, doc_multiple_per_cp = 0, group_name = '0', world = 4)
        all_gather_varlen_attention = cpcompile_comms_all_gather_varlen_all_gather_varlen_attention(l_q_, l_k_, l_v_, check_packed_metadata, layout = 'thd', causal = True, scale = 0.5, kernel = 'cpu_varlen_ref', group_name = '0', rank = 1, world = 4, max_doc = 16, window = (-1, -1))
        out: "f32[8, 2, 4]" = all_gather_varlen_attention[0]
        lse: "f32[2, 8]" = all_gather_varlen_attention[1]
        mul: "f32[8, 2, 4]" = out * 2
        return (mul, lse)
""",
        )

    def test_thd_zigzag_full_gqa(self):
        with fake_group(rank=1, world=4):
            code = rewritten_graph(full, *_inputs(heads=(4, 2), cu=(0, 8, 32)), strategy="thd_zigzag")
        self.assertExpectedInline(
            code,
            """\
class GraphModule(torch.nn.Module):
    def forward(self, L_q_: "f32[8, 4, 4]", L_k_: "f32[8, 2, 4]", L_v_: "f32[8, 2, 4]", L_cu_: "i32[3]"):
        l_q_ = L_q_
        l_k_ = L_k_
        l_v_ = L_v_
        l_cu_ = L_cu_
        check_packed_metadata: "i32[3]" = cpcompile_regions_guards_check_packed_metadata(l_cu_, total = 32, max_doc = 32, doc_multiple_per_cp = 2, group_name = '0', world = 4)
        all_gather_varlen_attention = cpcompile_comms_all_gather_varlen_all_gather_varlen_attention(l_q_, l_k_, l_v_, check_packed_metadata, layout = 'thd_zigzag', causal = False, scale = 0.5, kernel = 'cpu_varlen_ref', group_name = '0', rank = 1, world = 4, max_doc = 32, window = (-1, -1))
        out: "f32[8, 4, 4]" = all_gather_varlen_attention[0]
        return (out,)
""",
        )

    @on_snapshot_torch
    def test_thd_aot_forward_computes_blocks_on_device(self):
        """Block ranges come from cu_seqlens by tensor ops (no .item(), no host sync): one gather, one block that
        reads the gathered buffer itself (thd needs no key copy)."""
        with fake_group(rank=1, world=2):
            fwd, bwd = aot_graphs(causal, *_inputs(cu=(0, 3, 16), requires_grad=True), strategy="thd")
        self.assertExpectedInline(
            fwd,
            """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_1: "f32[8, 2, 4]", primals_2: "f32[8, 2, 4]", primals_3: "f32[8, 2, 4]", primals_4: "i32[3]"):
        _to_copy: "i64[3]" = torch.ops.aten._to_copy.default(primals_4, dtype = torch.int64)
        slice_1: "i64[2]" = torch.ops.aten.slice.Tensor(_to_copy, 0, 1, 9223372036854775807)
        slice_2: "i64[2]" = torch.ops.aten.slice.Tensor(_to_copy, 0, 0, -1)
        sub: "i64[2]" = torch.ops.aten.sub.Tensor(slice_1, slice_2)
        select: "i64[]" = torch.ops.aten.select.int(_to_copy, 0, 0)
        eq: "b8[]" = torch.ops.aten.eq.Scalar(select, 0)
        select_1: "i64[]" = torch.ops.aten.select.int(_to_copy, 0, -1)
        eq_1: "b8[]" = torch.ops.aten.eq.Scalar(select_1, 16)
        bitwise_and: "b8[]" = torch.ops.aten.bitwise_and.Tensor(eq, eq_1)
        ge: "b8[2]" = torch.ops.aten.ge.Scalar(sub, 0)
        all_1: "b8[]" = torch.ops.aten.all.default(ge)
        bitwise_and_1: "b8[]" = torch.ops.aten.bitwise_and.Tensor(bitwise_and, all_1)
        le: "b8[2]" = torch.ops.aten.le.Scalar(sub, 16)
        all_2: "b8[]" = torch.ops.aten.all.default(le)
        bitwise_and_2: "b8[]" = torch.ops.aten.bitwise_and.Tensor(bitwise_and_1, all_2)
        arange: "i64[3]" = torch.ops.aten.arange.start(1, 4, dtype = torch.int64, device = device(type='cpu'), pin_memory = False)
        mul: "i64[3]" = torch.ops.aten.mul.Tensor(arange, 40503)
        add: "i64[3]" = torch.ops.aten.add.Tensor(mul, 97)
        mul_1: "i64[3]" = torch.ops.aten.mul.Tensor(_to_copy, add)
        sum_1: "i64[]" = torch.ops.aten.sum.default(mul_1)
        add_1: "i64[]" = torch.ops.aten.add.Tensor(sum_1, 3)
        _to_copy_1: "i64[]" = torch.ops.aten._to_copy.default(bitwise_and_2, dtype = torch.int64)
        stack: "i64[2]" = torch.ops.aten.stack.default([add_1, _to_copy_1])
        view: "i64[1, 2]" = torch.ops.aten.view.default(stack, [1, 2])
        all_gather_into_tensor: "i64[2, 2]" = torch.ops._c10d_functional.all_gather_into_tensor.default(view, 2, '0')
        wait_tensor: "i64[2, 2]" = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor)
        select_2: "i64[2]" = torch.ops.aten.select.int(wait_tensor, 1, 0)
        select_3: "i64[2]" = torch.ops.aten.select.int(wait_tensor, 0, 0)
        select_4: "i64[]" = torch.ops.aten.select.int(select_3, 0, 0)
        eq_2: "b8[2]" = torch.ops.aten.eq.Tensor(select_2, select_4)
        all_3: "b8[]" = torch.ops.aten.all.default(eq_2)
        _assert_async = torch.ops.aten._assert_async.msg(all_3, 'cpcompile: cu_seqlens differs between CP ranks; pass the same GLOBAL cu_seqlens (unsharded) to every rank')
        select_5: "i64[2]" = torch.ops.aten.select.int(wait_tensor, 1, 1)
        eq_3: "b8[2]" = torch.ops.aten.eq.Scalar(select_5, 1)
        all_4: "b8[]" = torch.ops.aten.all.default(eq_3)
        bitwise_and_3: "b8[]" = torch.ops.aten.bitwise_and.Tensor(all_3, all_4)
        _assert_async_1 = torch.ops.aten._assert_async.msg(bitwise_and_3, "cpcompile: bad cu_seqlens, need cu[0]=0, non-decreasing, cu[-1]=16 (the GLOBAL packed length, not a rank's local one); docs <= max_q/max_k=16. cpcompile.shard checks it on the host")
        zeros_like: "i32[3]" = torch.ops.aten.zeros_like.default(primals_4, pin_memory = False)
        where: "i32[3]" = torch.ops.aten.where.self(bitwise_and_3, primals_4, zeros_like)
        _to_copy_2: "i64[3]" = torch.ops.aten._to_copy.default(where, dtype = torch.int64)
        slice_3: "i64[2]" = torch.ops.aten.slice.Tensor(_to_copy_2, 0, 0, -1)
        slice_4: "i64[2]" = torch.ops.aten.slice.Tensor(_to_copy_2, 0, 1, 9223372036854775807)
        sub_1: "i64[2]" = torch.ops.aten.sub.Tensor(slice_3, 8)
        clamp: "i64[2]" = torch.ops.aten.clamp.default(sub_1, 0, 8)
        sub_2: "i64[2]" = torch.ops.aten.sub.Tensor(slice_4, 8)
        clamp_1: "i64[2]" = torch.ops.aten.clamp.default(sub_2, 0, 8)
        gt: "b8[2]" = torch.ops.aten.gt.Tensor(clamp_1, clamp)
        clamp_2: "i64[2]" = torch.ops.aten.clamp.default(slice_4, None, 16)
        where_1: "i64[2]" = torch.ops.aten.where.self(gt, clamp_2, slice_3)
        stack_1: "i64[4, 2]" = torch.ops.aten.stack.default([clamp, clamp_1, slice_3, where_1])
        unbind = torch.ops.aten.unbind.int(stack_1)
        getitem: "i64[2]" = unbind[0]
        getitem_1: "i64[2]" = unbind[1]
        getitem_2: "i64[2]" = unbind[2]
        getitem_3: "i64[2]" = unbind[3]
        gt_1: "b8[2]" = torch.ops.aten.gt.Tensor(getitem_1, getitem)
        gt_2: "b8[2]" = torch.ops.aten.gt.Tensor(getitem_3, getitem_2)
        bitwise_and_4: "b8[2]" = torch.ops.aten.bitwise_and.Tensor(gt_1, gt_2)
        arange_1: "i64[2]" = torch.ops.aten.arange.start(1, 3, dtype = torch.int64, device = device(type='cpu'), pin_memory = False)
        zeros: "i64[17]" = torch.ops.aten.zeros.default([17], dtype = torch.int64, device = device(type='cpu'), pin_memory = False)
        scatter_add: "i64[17]" = torch.ops.aten.scatter_add.default(zeros, 0, getitem_2, arange_1)
        neg: "i64[2]" = torch.ops.aten.neg.default(arange_1)
        scatter_add_1: "i64[17]" = torch.ops.aten.scatter_add.default(scatter_add, 0, getitem_3, neg)
        cumsum: "i64[17]" = torch.ops.aten.cumsum.default(scatter_add_1, 0)
        slice_5: "i64[16]" = torch.ops.aten.slice.Tensor(cumsum, 0, 0, 16)
        sub_3: "i64[16]" = torch.ops.aten.sub.Tensor(slice_5, 1)
        ge_1: "b8[16]" = torch.ops.aten.ge.Scalar(sub_3, 0)
        clamp_3: "i64[16]" = torch.ops.aten.clamp.default(sub_3, 0)
        index: "b8[16]" = torch.ops.aten.index.Tensor(bitwise_and_4, [clamp_3])
        bitwise_and_5: "b8[16]" = torch.ops.aten.bitwise_and.Tensor(ge_1, index)
        stack_2: "f32[8, 2, 2, 4]" = torch.ops.aten.stack.default([primals_2, primals_3], 1)
        all_gather_into_tensor_1: "f32[16, 2, 2, 4]" = torch.ops._c10d_functional.all_gather_into_tensor.default(stack_2, 2, '0')
        wait_tensor_1: "f32[16, 2, 2, 4]" = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_1)
        select_6: "f32[16, 2, 4]" = torch.ops.aten.select.int(wait_tensor_1, 1, 0)
        select_7: "f32[16, 2, 4]" = torch.ops.aten.select.int(wait_tensor_1, 1, 1)
        attend_varlen_blocks = torch.ops.cpcompile.attend_varlen_blocks.default(primals_1, [select_6], [select_7], [stack_1], [0, 1, 8, 16, -1, -1, 1, 0, 0], 0.5, 'cpu_varlen_ref', [bitwise_and_5])
        getitem_4: "f32[8, 2, 4]" = attend_varlen_blocks[0]
        getitem_5: "f32[2, 8]" = attend_varlen_blocks[1]
        detach: "f32[8, 2, 4]" = torch.ops.aten.detach.default(getitem_4)
        return (getitem_4, primals_1, wait_tensor, stack_1, bitwise_and_5, wait_tensor_1, getitem_5, detach)
""",
        )
        # one for K/V, one for the cu_seqlens check (2 int64 a rank, regions/guards.py)
        self.assertEqual(count_ops(fwd, r"all_gather_into_tensor\.default\("), 2)
        self.assertEqual(count_ops(bwd, r"reduce_scatter_tensor\.default\("), 1)
        self.assertEqual(count_ops(fwd + bwd, r"\.item\(|_local_scalar_dense"), 0)

    @on_snapshot_torch
    def test_thd_zigzag_aot_backward_folds_the_key_buffer(self):
        """thd_zigzag copies the gathered K/V into its key buffer (one index_select) and folds the buffer's
        gradient back by a gather over each token's copies (no scatter-add), in fp32, before the one reduce-scatter."""
        with fake_group(rank=0, world=2):
            fwd, bwd = aot_graphs(causal, *_inputs(cu=(0, 4, 16), requires_grad=True), strategy="thd_zigzag")
        self.assertEqual(count_ops(fwd, r"index_select\.default\("), 1)
        self.assertEqual(count_ops(fwd, r"attend_varlen_blocks\.default\("), 1)
        self.assertEqual(count_ops(bwd, r"aten\.(index_add|scatter|scatter_add|index_put)[_.]"), 0)
        self.assertEqual(count_ops(bwd, r"aten\.index\.Tensor\("), 1)
        self.assertEqual(count_ops(bwd, r"reduce_scatter_tensor\.default\("), 1)
        self.assertEqual(count_ops(fwd + bwd, r"\.item\(|_local_scalar_dense"), 0)
        self.assertExpectedInline(
            bwd,
            """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_1: "f32[8, 2, 4]", wait_tensor: "i64[2, 2]", stack_5: "i64[4, 4]", index_put: "i64[32]", index_select: "f32[20, 2, 2, 4]", getitem_1: "f32[2, 8]", detach: "f32[8, 2, 4]", tangents_1: "f32[8, 2, 4]"):
        select_2: "i64[2]" = torch.ops.aten.select.int(wait_tensor, 1, 0)
        select_3: "i64[2]" = torch.ops.aten.select.int(wait_tensor, 0, 0)
        select_4: "i64[]" = torch.ops.aten.select.int(select_3, 0, 0)
        eq_3: "b8[2]" = torch.ops.aten.eq.Tensor(select_2, select_4)
        all_4: "b8[]" = torch.ops.aten.all.default(eq_3)
        _assert_async = torch.ops.aten._assert_async.msg(all_4, 'cpcompile: cu_seqlens differs between CP ranks; pass the same GLOBAL cu_seqlens (unsharded) to every rank')
        select_5: "i64[2]" = torch.ops.aten.select.int(wait_tensor, 1, 1)
        eq_4: "b8[2]" = torch.ops.aten.eq.Scalar(select_5, 1)
        all_5: "b8[]" = torch.ops.aten.all.default(eq_4)
        bitwise_and_4: "b8[]" = torch.ops.aten.bitwise_and.Tensor(all_4, all_5)
        _assert_async_1 = torch.ops.aten._assert_async.msg(bitwise_and_4, "cpcompile: bad cu_seqlens, need cu[0]=0, non-decreasing, cu[-1]=16 (the GLOBAL packed length, not a rank's local one); docs <= max_q/max_k=16; each a multiple of 2*cp=4. cpcompile.shard checks it on the host")
        detach_1: "f32[8, 2, 4]" = torch.ops.aten.detach.default(detach)
        select_8: "f32[20, 2, 4]" = torch.ops.aten.select.int(index_select, 1, 0)
        select_9: "f32[20, 2, 4]" = torch.ops.aten.select.int(index_select, 1, 1)
        attend_varlen_blocks_backward = torch.ops.cpcompile.attend_varlen_blocks_backward.default(tangents_1, primals_1, [select_8], [select_9], detach_1, getitem_1, [stack_5], [0, 1, 4, 16, -1, -1, 1, 1, 0], 0.5, 'cpu_varlen_ref', [])
        getitem_2: "f32[8, 2, 4]" = attend_varlen_blocks_backward[0]
        getitem_3 = attend_varlen_blocks_backward[1]
        getitem_5 = attend_varlen_blocks_backward[2]
        getitem_4: "f32[20, 2, 4]" = getitem_3[0]
        getitem_6: "f32[20, 2, 4]" = getitem_5[0]
        stack_7: "f32[20, 2, 2, 4]" = torch.ops.aten.stack.default([getitem_4, getitem_6], 1)
        view_6: "i64[2, 16]" = torch.ops.aten.view.default(index_put, [2, 16])
        clamp_2: "i64[2, 16]" = torch.ops.aten.clamp.default(view_6, 0)
        index_3: "f32[2, 16, 2, 2, 4]" = torch.ops.aten.index.Tensor(stack_7, [clamp_2])
        ge_2: "b8[2, 16]" = torch.ops.aten.ge.Scalar(view_6, 0)
        unsqueeze: "b8[2, 16, 1]" = torch.ops.aten.unsqueeze.default(ge_2, 2)
        unsqueeze_1: "b8[2, 16, 1, 1]" = torch.ops.aten.unsqueeze.default(unsqueeze, 3)
        unsqueeze_2: "b8[2, 16, 1, 1, 1]" = torch.ops.aten.unsqueeze.default(unsqueeze_1, 4)
        scalar_tensor_1: "f32[]" = torch.ops.aten.scalar_tensor.default(0, dtype = torch.float32, layout = torch.strided, device = device(type='cpu'))
        where_3: "f32[2, 16, 2, 2, 4]" = torch.ops.aten.where.self(unsqueeze_2, index_3, scalar_tensor_1)
        sum_2: "f32[16, 2, 2, 4]" = torch.ops.aten.sum.dim_IntList(where_3, [0])
        reduce_scatter_tensor: "f32[8, 2, 2, 4]" = torch.ops._c10d_functional.reduce_scatter_tensor.default(sum_2, 'sum', 2, '0')
        wait_tensor_2: "f32[8, 2, 2, 4]" = torch.ops._c10d_functional.wait_tensor.default(reduce_scatter_tensor)
        select_10: "f32[8, 2, 4]" = torch.ops.aten.select.int(wait_tensor_2, 1, 0)
        select_11: "f32[8, 2, 4]" = torch.ops.aten.select.int(wait_tensor_2, 1, 1)
        return (getitem_2, select_10, select_11, None)
""",
        )


def _plan(cu, world):
    from cpcompile.layouts.thd_balanced import make_plan

    return make_plan(torch.tensor(cu, dtype=torch.int32), world)


class TestThdBalancedSnapshot(expecttest.TestCase):
    def test_thd_balanced_region(self):
        """cu_seqlens is the plan (offsets, then each rank's pieces, then the tag): the check reads all of it
        (layout=...), the region gets it as it is, and every shape is static."""
        q, k, v, _ = _inputs()
        with fake_group(rank=1, world=4):
            code = rewritten_graph(causal, q, k, v, _plan((0, 3, 16, 32), 4), strategy="thd_balanced")
        self.assertExpectedInline(
            code,
            """\
class GraphModule(torch.nn.Module):
    def forward(self, L_q_: "f32[8, 2, 4]", L_k_: "f32[8, 2, 4]", L_v_: "f32[8, 2, 4]", L_cu_: "i32[45]"):
        l_q_ = L_q_
        l_k_ = L_k_
        l_v_ = L_v_
        l_cu_ = L_cu_
        check_packed_metadata: "i32[45]" = cpcompile_regions_guards_check_packed_metadata(l_cu_, total = 32, max_doc = 16, doc_multiple_per_cp = 0, group_name = '0', world = 4, layout = 'thd_balanced')
        all_gather_varlen_attention = cpcompile_comms_all_gather_varlen_all_gather_varlen_attention(l_q_, l_k_, l_v_, check_packed_metadata, layout = 'thd_balanced', causal = True, scale = 0.5, kernel = 'cpu_varlen_ref', group_name = '0', rank = 1, world = 4, max_doc = 16, window = (-1, -1))
        out: "f32[8, 2, 4]" = all_gather_varlen_attention[0]
        return (out,)
""",
        )

    def test_thd_balanced_aot_collectives_and_no_sync(self):
        """One metadata all-gather, one K/V all-gather, one key-buffer copy, one kernel call; backward: one
        reduce-scatter, no scatter-add; no host sync anywhere."""
        q, k, v, _ = _inputs(requires_grad=True)
        with fake_group(rank=0, world=2):
            fwd, bwd = aot_graphs(causal, q, k, v, _plan((0, 3, 16), 2), strategy="thd_balanced")
        self.assertEqual(count_ops(fwd, r"all_gather_into_tensor\.default\("), 2)
        self.assertEqual(count_ops(fwd, r"index_select\.default\("), 1)
        self.assertEqual(count_ops(fwd, r"attend_varlen_blocks\.default\("), 1)
        self.assertEqual(count_ops(bwd, r"aten\.(index_add|scatter|scatter_add)[_.]"), 0)
        self.assertEqual(count_ops(bwd, r"reduce_scatter_tensor\.default\("), 1)
        self.assertEqual(count_ops(fwd + bwd, r"\.item\(|_local_scalar_dense"), 0)


def test_packed_region_gets_the_options_asked_for():
    """backend(regather=True) reaches the packed all-gather region and deferred_merge=True the packed ring (both
    were once dropped by the varlen plan: the region ran without them, silently)."""
    with fake_group(rank=1, world=4):
        gathered = rewritten_graph(causal, *_inputs(), strategy="thd", comm="all_gather", regather=True)
        ring = rewritten_graph(causal, *_inputs(), strategy="thd", comm="ring", deferred_merge=True)
        plain = rewritten_graph(causal, *_inputs(), strategy="thd", comm="ring")
    assert "regather = True)" in gathered and "deferred_merge = True)" in ring
    assert "regather" not in plain and "deferred_merge" not in plain


def constant_offsets(q, k, v):
    cu = torch.tensor([0, 3, 16, 32], dtype=torch.int32)
    return varlen_attn(q, k, v, cu, cu, 16, 16, window_size=(-1, 0))


def constant_offsets_too_long(q, k, v):
    cu = torch.tensor([0, 3, 32], dtype=torch.int32)  # a 29-token document: longer than max_q/max_k
    return varlen_attn(q, k, v, cu, cu, 16, 16, window_size=(-1, 0))


class WithOffsetsBuffer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("cu", torch.tensor([0, 3, 16, 32], dtype=torch.int32))

    def forward(self, q, k, v):
        return varlen_attn(q, k, v, self.cu, self.cu, 16, 16, window_size=(-1, 0))


def test_constant_offsets_are_checked_before_the_region():
    """cu_seqlens built in the model (a constant, or a buffer) goes through the packed check like an input: the
    regions read a document only up to max_q/max_k (all_gather/thd's key slice), so a longer one must be refused,
    never attended over a cut key range."""
    q, k, v, _ = _inputs()
    with fake_group(rank=1, world=4):
        for model in (constant_offsets, WithOffsetsBuffer()):
            code = rewritten_graph(model, q, k, v, strategy="thd")
            assert count_ops(code, r"= cpcompile_regions_guards_check_packed_metadata\(") == 1, code
            assert "all_gather_varlen_attention(l_q_, l_k_, l_v_, check_packed_metadata," in code, code
        torch._dynamo.reset()
        be = cpcompile.backend(inner="aot_eager", strategy="thd")
        with pytest.raises(RuntimeError, match=r"bad cu_seqlens.*docs <= max_q/max_k=16"):
            torch.compile(constant_offsets_too_long, backend=be, fullgraph=True)(q, k, v)
