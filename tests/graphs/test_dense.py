"""The graph the pass produces is part of its contract: snapshots taken with a fake process group."""

from __future__ import annotations

import expecttest
import torch
import torch.nn.functional as F

import cpcompile
from cpcompile.testing.model import TinyConfig, TinyLlama
from tests.support.fake_pg import aot_graphs, capture_graphs, count_ops, fake_group, rewritten_graph
from tests.support.graphs import attention_kernels, view_source


def gqa_attention(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def three_forms(q, k, v):
    """SDPA as a positional call, a keyword call and the aten op: all three must be rewritten."""
    a = F.scaled_dot_product_attention(q, k, v, None, 0.0, True)
    b = torch.nn.functional.scaled_dot_product_attention(query=q, key=k, value=v, scale=0.5)
    c = torch.ops.aten.scaled_dot_product_attention(q, k, v, is_causal=True)
    return a + b + c


def _qkv(hkv=2, s=8, requires_grad=False):
    q = torch.randn(1, 4, s, 16, requires_grad=requires_grad)
    k = torch.randn(1, hkv, s, 16, requires_grad=requires_grad)
    v = torch.randn(1, hkv, s, 16, requires_grad=requires_grad)
    return q, k, v


class TestSnapshots(expecttest.TestCase):
    def test_flat_rewrite(self):
        with fake_group(rank=1, world=4):
            code = rewritten_graph(gqa_attention, *_qkv(), strategy="flat")
        self.assertExpectedInline(
            code,
            """\
class GraphModule(torch.nn.Module):
    def forward(self, L_q_: "f32[1, 4, 8, 16]", L_k_: "f32[1, 2, 8, 16]", L_v_: "f32[1, 2, 8, 16]"):
        l_q_ = L_q_
        l_k_ = L_k_
        l_v_ = L_v_
        all_gather_attention: "f32[1, 4, 8, 16]" = cpcompile_comms_all_gather_dense_all_gather_attention(l_q_, l_k_, l_v_, layout = 'flat', causal = True, scale = 0.25, kernel = 'cpu_flash', group_name = '0', rank = 1, world = 4)
        return (all_gather_attention,)
""",
        )

    def test_zigzag_rewrite(self):
        with fake_group(rank=1, world=4):
            code = rewritten_graph(gqa_attention, *_qkv(), strategy="zigzag")
        self.assertExpectedInline(
            code,
            """\
class GraphModule(torch.nn.Module):
    def forward(self, L_q_: "f32[1, 4, 8, 16]", L_k_: "f32[1, 2, 8, 16]", L_v_: "f32[1, 2, 8, 16]"):
        l_q_ = L_q_
        l_k_ = L_k_
        l_v_ = L_v_
        all_gather_attention: "f32[1, 4, 8, 16]" = cpcompile_comms_all_gather_dense_all_gather_attention(l_q_, l_k_, l_v_, layout = 'zigzag', causal = True, scale = 0.25, kernel = 'cpu_flash', group_name = '0', rank = 1, world = 4)
        return (all_gather_attention,)
""",
        )

    def test_zigzag_aot_forward_backward(self):
        """One all-gather (K and V of both slots) forward, one reduce-scatter backward, no reorder ops; the
        executor's kernel calls on views (zigzag's two causal squares one batched call), the LSE merge as pointwise
        ops, the gathered K/V gradient summed straight into the layout the reduce-scatter sends."""
        with fake_group(rank=1, world=4):
            fwd, bwd = aot_graphs(gqa_attention, *_qkv(requires_grad=True), strategy="zigzag", kernel="cpu_flash")
        self.assertEqual(count_ops(fwd, r"all_gather_into_tensor\.default\("), 1)
        self.assertEqual(count_ops(bwd, r"reduce_scatter_tensor\.default\("), 1)
        for reorder in ("index_select", "aten.gather", "index.Tensor"):
            self.assertNotIn(reorder, fwd + bwd)
        self.assertExpectedInline(
            fwd,
            """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_1: "f32[1, 4, 8, 16]", primals_2: "f32[1, 2, 8, 16]", primals_3: "f32[1, 2, 8, 16]"):
        view: "f32[1, 2, 2, 4, 16]" = torch.ops.aten.view.default(primals_2, [1, 2, 2, 4, 16])
        permute: "f32[4, 2, 1, 2, 16]" = torch.ops.aten.permute.default(view, [3, 2, 0, 1, 4])
        view_1: "f32[1, 2, 2, 4, 16]" = torch.ops.aten.view.default(primals_3, [1, 2, 2, 4, 16])
        permute_1: "f32[4, 2, 1, 2, 16]" = torch.ops.aten.permute.default(view_1, [3, 2, 0, 1, 4])
        stack: "f32[4, 2, 2, 1, 2, 16]" = torch.ops.aten.stack.default([permute, permute_1], 2)
        all_gather_into_tensor: "f32[16, 2, 2, 1, 2, 16]" = torch.ops._c10d_functional.all_gather_into_tensor.default(stack, 4, '0')
        slice_1: "f32[1, 4, 8, 16]" = torch.ops.aten.slice.Tensor(primals_1, 2, 0, 8)
        unfold: "f32[1, 4, 2, 16, 4]" = torch.ops.aten.unfold.default(slice_1, 2, 4, 4)
        permute_2: "f32[1, 4, 2, 4, 16]" = torch.ops.aten.permute.default(unfold, [0, 1, 2, 4, 3])
        permute_3: "f32[2, 1, 4, 4, 16]" = torch.ops.aten.permute.default(permute_2, [2, 0, 1, 3, 4])
        squeeze: "f32[2, 4, 4, 16]" = torch.ops.aten.squeeze.dim(permute_3, 1)
        slice_2: "f32[1, 2, 8, 16]" = torch.ops.aten.slice.Tensor(primals_2, 2, 0, 8)
        unfold_1: "f32[1, 2, 2, 16, 4]" = torch.ops.aten.unfold.default(slice_2, 2, 4, 4)
        permute_4: "f32[1, 2, 2, 4, 16]" = torch.ops.aten.permute.default(unfold_1, [0, 1, 2, 4, 3])
        permute_5: "f32[2, 1, 2, 4, 16]" = torch.ops.aten.permute.default(permute_4, [2, 0, 1, 3, 4])
        squeeze_1: "f32[2, 2, 4, 16]" = torch.ops.aten.squeeze.dim(permute_5, 1)
        slice_3: "f32[1, 2, 8, 16]" = torch.ops.aten.slice.Tensor(primals_3, 2, 0, 8)
        unfold_2: "f32[1, 2, 2, 16, 4]" = torch.ops.aten.unfold.default(slice_3, 2, 4, 4)
        permute_6: "f32[1, 2, 2, 4, 16]" = torch.ops.aten.permute.default(unfold_2, [0, 1, 2, 4, 3])
        permute_7: "f32[2, 1, 2, 4, 16]" = torch.ops.aten.permute.default(permute_6, [2, 0, 1, 3, 4])
        squeeze_2: "f32[2, 2, 4, 16]" = torch.ops.aten.squeeze.dim(permute_7, 1)
        _scaled_dot_product_flash_attention_for_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(squeeze, squeeze_1, squeeze_2, 0.0, True, scale = 0.25)
        getitem: "f32[2, 4, 4, 16]" = _scaled_dot_product_flash_attention_for_cpu[0]
        getitem_1: "f32[2, 4, 4]" = _scaled_dot_product_flash_attention_for_cpu[1]
        slice_4: "f32[1, 4, 4, 16]" = torch.ops.aten.slice.Tensor(getitem, 0, 0, 1)
        slice_5: "f32[1, 4, 4, 16]" = torch.ops.aten.slice.Tensor(getitem, 0, 1, 2)
        slice_6: "f32[1, 4, 4]" = torch.ops.aten.slice.Tensor(getitem_1, 0, 0, 1)
        slice_7: "f32[1, 4, 4]" = torch.ops.aten.slice.Tensor(getitem_1, 0, 1, 2)
        cat: "f32[1, 4, 8, 16]" = torch.ops.aten.cat.default([slice_4, slice_5], -2)
        cat_1: "f32[1, 4, 8]" = torch.ops.aten.cat.default([slice_6, slice_7], -1)
        wait_tensor: "f32[16, 2, 2, 1, 2, 16]" = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor)
        select: "f32[16, 2, 1, 2, 16]" = torch.ops.aten.select.int(wait_tensor, 1, 0)
        select_1: "f32[16, 1, 2, 16]" = torch.ops.aten.select.int(select, 1, 0)
        select_2: "f32[16, 1, 2, 16]" = torch.ops.aten.select.int(select, 1, 1)
        select_3: "f32[16, 2, 1, 2, 16]" = torch.ops.aten.select.int(wait_tensor, 1, 1)
        select_4: "f32[16, 1, 2, 16]" = torch.ops.aten.select.int(select_3, 1, 0)
        select_5: "f32[16, 1, 2, 16]" = torch.ops.aten.select.int(select_3, 1, 1)
        permute_8: "f32[1, 2, 16, 16]" = torch.ops.aten.permute.default(select_1, [1, 2, 0, 3])
        permute_9: "f32[1, 2, 16, 16]" = torch.ops.aten.permute.default(select_4, [1, 2, 0, 3])
        permute_10: "f32[1, 2, 16, 16]" = torch.ops.aten.permute.default(select_2, [1, 2, 0, 3])
        permute_11: "f32[1, 2, 16, 16]" = torch.ops.aten.permute.default(select_5, [1, 2, 0, 3])
        slice_8: "f32[1, 4, 4, 16]" = torch.ops.aten.slice.Tensor(primals_1, -2, 0, 4)
        slice_9: "f32[1, 2, 4, 16]" = torch.ops.aten.slice.Tensor(permute_8, -2, 0, 4)
        slice_10: "f32[1, 2, 4, 16]" = torch.ops.aten.slice.Tensor(permute_10, -2, 0, 4)
        _scaled_dot_product_flash_attention_for_cpu_1 = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(slice_8, slice_9, slice_10, scale = 0.25)
        getitem_2: "f32[1, 4, 4, 16]" = _scaled_dot_product_flash_attention_for_cpu_1[0]
        getitem_3: "f32[1, 4, 4]" = _scaled_dot_product_flash_attention_for_cpu_1[1]
        slice_11: "f32[1, 4, 4, 16]" = torch.ops.aten.slice.Tensor(primals_1, -2, 4, 8)
        _scaled_dot_product_flash_attention_for_cpu_2 = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(slice_11, permute_8, permute_10, scale = 0.25)
        getitem_4: "f32[1, 4, 4, 16]" = _scaled_dot_product_flash_attention_for_cpu_2[0]
        getitem_5: "f32[1, 4, 4]" = _scaled_dot_product_flash_attention_for_cpu_2[1]
        slice_12: "f32[1, 4, 4, 16]" = torch.ops.aten.slice.Tensor(primals_1, -2, 4, 8)
        slice_13: "f32[1, 2, 8, 16]" = torch.ops.aten.slice.Tensor(permute_9, -2, 8, 16)
        slice_14: "f32[1, 2, 8, 16]" = torch.ops.aten.slice.Tensor(permute_11, -2, 8, 16)
        _scaled_dot_product_flash_attention_for_cpu_3 = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(slice_12, slice_13, slice_14, scale = 0.25)
        getitem_6: "f32[1, 4, 4, 16]" = _scaled_dot_product_flash_attention_for_cpu_3[0]
        getitem_7: "f32[1, 4, 4]" = _scaled_dot_product_flash_attention_for_cpu_3[1]
        maximum: "f32[1, 4, 4]" = torch.ops.aten.maximum.default(getitem_5, getitem_7)
        eq: "b8[1, 4, 4]" = torch.ops.aten.eq.Scalar(maximum, -inf)
        scalar_tensor: "f32[]" = torch.ops.aten.scalar_tensor.default(0.0, dtype = torch.float32, layout = torch.strided, device = device(type='cpu'))
        where: "f32[1, 4, 4]" = torch.ops.aten.where.self(eq, scalar_tensor, maximum)
        sub: "f32[1, 4, 4]" = torch.ops.aten.sub.Tensor(getitem_5, where)
        exp: "f32[1, 4, 4]" = torch.ops.aten.exp.default(sub)
        sub_1: "f32[1, 4, 4]" = torch.ops.aten.sub.Tensor(getitem_7, where)
        exp_1: "f32[1, 4, 4]" = torch.ops.aten.exp.default(sub_1)
        add: "f32[1, 4, 4]" = torch.ops.aten.add.Tensor(exp, exp_1)
        gt: "b8[1, 4, 4]" = torch.ops.aten.gt.Scalar(add, 0)
        reciprocal: "f32[1, 4, 4]" = torch.ops.aten.reciprocal.default(add)
        mul: "f32[1, 4, 4]" = torch.ops.aten.mul.Tensor(reciprocal, 1.0)
        scalar_tensor_1: "f32[]" = torch.ops.aten.scalar_tensor.default(0.0, dtype = torch.float32, layout = torch.strided, device = device(type='cpu'))
        where_1: "f32[1, 4, 4]" = torch.ops.aten.where.self(gt, mul, scalar_tensor_1)
        mul_1: "f32[1, 4, 4]" = torch.ops.aten.mul.Tensor(exp, where_1)
        unsqueeze: "f32[1, 4, 4, 1]" = torch.ops.aten.unsqueeze.default(mul_1, -1)
        mul_2: "f32[1, 4, 4, 16]" = torch.ops.aten.mul.Tensor(getitem_4, unsqueeze)
        mul_3: "f32[1, 4, 4]" = torch.ops.aten.mul.Tensor(exp_1, where_1)
        unsqueeze_1: "f32[1, 4, 4, 1]" = torch.ops.aten.unsqueeze.default(mul_3, -1)
        mul_4: "f32[1, 4, 4, 16]" = torch.ops.aten.mul.Tensor(getitem_6, unsqueeze_1)
        add_1: "f32[1, 4, 4, 16]" = torch.ops.aten.add.Tensor(mul_2, mul_4)
        gt_1: "b8[1, 4, 4]" = torch.ops.aten.gt.Scalar(add, 0)
        log: "f32[1, 4, 4]" = torch.ops.aten.log.default(add)
        add_2: "f32[1, 4, 4]" = torch.ops.aten.add.Tensor(where, log)
        scalar_tensor_2: "f32[]" = torch.ops.aten.scalar_tensor.default(-inf, dtype = torch.float32, layout = torch.strided, device = device(type='cpu'))
        where_2: "f32[1, 4, 4]" = torch.ops.aten.where.self(gt_1, add_2, scalar_tensor_2)
        cat_2: "f32[1, 4, 8, 16]" = torch.ops.aten.cat.default([getitem_2, add_1], -2)
        cat_3: "f32[1, 4, 8]" = torch.ops.aten.cat.default([getitem_3, where_2], -1)
        maximum_1: "f32[1, 4, 8]" = torch.ops.aten.maximum.default(cat_1, cat_3)
        eq_1: "b8[1, 4, 8]" = torch.ops.aten.eq.Scalar(maximum_1, -inf)
        scalar_tensor_3: "f32[]" = torch.ops.aten.scalar_tensor.default(0.0, dtype = torch.float32, layout = torch.strided, device = device(type='cpu'))
        where_3: "f32[1, 4, 8]" = torch.ops.aten.where.self(eq_1, scalar_tensor_3, maximum_1)
        sub_2: "f32[1, 4, 8]" = torch.ops.aten.sub.Tensor(cat_1, where_3)
        exp_2: "f32[1, 4, 8]" = torch.ops.aten.exp.default(sub_2)
        sub_3: "f32[1, 4, 8]" = torch.ops.aten.sub.Tensor(cat_3, where_3)
        exp_3: "f32[1, 4, 8]" = torch.ops.aten.exp.default(sub_3)
        add_3: "f32[1, 4, 8]" = torch.ops.aten.add.Tensor(exp_2, exp_3)
        gt_2: "b8[1, 4, 8]" = torch.ops.aten.gt.Scalar(add_3, 0)
        reciprocal_1: "f32[1, 4, 8]" = torch.ops.aten.reciprocal.default(add_3)
        mul_5: "f32[1, 4, 8]" = torch.ops.aten.mul.Tensor(reciprocal_1, 1.0)
        scalar_tensor_4: "f32[]" = torch.ops.aten.scalar_tensor.default(0.0, dtype = torch.float32, layout = torch.strided, device = device(type='cpu'))
        where_4: "f32[1, 4, 8]" = torch.ops.aten.where.self(gt_2, mul_5, scalar_tensor_4)
        mul_6: "f32[1, 4, 8]" = torch.ops.aten.mul.Tensor(exp_2, where_4)
        unsqueeze_2: "f32[1, 4, 8, 1]" = torch.ops.aten.unsqueeze.default(mul_6, -1)
        mul_7: "f32[1, 4, 8, 16]" = torch.ops.aten.mul.Tensor(cat, unsqueeze_2)
        mul_8: "f32[1, 4, 8]" = torch.ops.aten.mul.Tensor(exp_3, where_4)
        unsqueeze_3: "f32[1, 4, 8, 1]" = torch.ops.aten.unsqueeze.default(mul_8, -1)
        mul_9: "f32[1, 4, 8, 16]" = torch.ops.aten.mul.Tensor(cat_2, unsqueeze_3)
        add_4: "f32[1, 4, 8, 16]" = torch.ops.aten.add.Tensor(mul_7, mul_9)
        gt_3: "b8[1, 4, 8]" = torch.ops.aten.gt.Scalar(add_3, 0)
        log_1: "f32[1, 4, 8]" = torch.ops.aten.log.default(add_3)
        add_5: "f32[1, 4, 8]" = torch.ops.aten.add.Tensor(where_3, log_1)
        scalar_tensor_5: "f32[]" = torch.ops.aten.scalar_tensor.default(-inf, dtype = torch.float32, layout = torch.strided, device = device(type='cpu'))
        where_5: "f32[1, 4, 8]" = torch.ops.aten.where.self(gt_3, add_5, scalar_tensor_5)
        detach: "f32[1, 4, 8, 16]" = torch.ops.aten.detach.default(add_4)
        return (add_4, primals_1, primals_2, primals_3, wait_tensor, where_5, detach)
""",
        )

    def test_every_attention_form_is_rewritten(self):
        with fake_group(rank=0, world=2):
            be = cpcompile.backend(strategy="flat", inner="eager")
            torch.compile(three_forms, backend=be, fullgraph=True)(*_qkv(hkv=4))
        self.assertEqual(len(be.plans), 3)
        self.assertEqual([p.causal for p in be.plans], [True, False, True])
        self.assertEqual([p.scale for p in be.plans], [0.25, 0.5, 0.25])

    def test_rewritten_nodes_equal_attention_calls_in_a_model(self):
        cfg = TinyConfig(layers=3)
        model = TinyLlama(cfg)
        ids = torch.randint(0, cfg.vocab, (2, 8))
        with fake_group(rank=1, world=2):
            pos = cpcompile.shard(torch.arange(16).expand(2, 16), strategy="zigzag", seq_dim=1)  # rank 1's
            be = cpcompile.backend(strategy="zigzag", inner="eager")
            torch.compile(model, backend=be, fullgraph=True)(ids, pos)
        self.assertEqual(len(be.plans), cfg.layers)
        self.assertTrue(all(p.layout == "zigzag" and p.causal for p in be.plans))


if __name__ == "__main__":
    import unittest

    unittest.main()


def test_kernels_read_kv_in_place():
    """Every attention kernel reads q/k/v (forward) and q/k/v/out/dout (backward) as views of the region's inputs
    or of the gathered buffer: the executor copies no K/V before a kernel."""
    with fake_group(rank=1, world=4):
        be = cpcompile.backend(strategy="zigzag", kernel="cpu_flash", inner="aot_eager")
        graphs = capture_graphs(gqa_attention, be, *_qkv(requires_grad=True))
    for phase, backward, reads in (("fw", False, 3), ("bw", True, 5)):
        calls = attention_kernels(graphs[phase], backward)
        assert len(calls) == 4, (phase, len(calls))  # the two local squares in one call, three gathered blocks
        for call in calls:
            for arg in call.args[:reads]:
                source = view_source(arg)
                assert source.op == "placeholder" or "all_gather" in str(source.target), (phase, call, source)
