"""The graph the pass produces is part of its contract: snapshots taken with a fake process group."""

from __future__ import annotations

import expecttest
import torch
import torch.nn.functional as F

import cpcompile
from cpcompile.testing.model import TinyConfig, TinyLlama
from tests.support.fake_pg import aot_graphs, count_ops, fake_group, rewritten_graph


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
        """One all-gather (K and V of both slots) forward, one reduce-scatter backward, no reorder ops."""
        with fake_group(rank=1, world=4):
            fwd, bwd = aot_graphs(gqa_attention, *_qkv(requires_grad=True), strategy="zigzag", kernel="cpu_flash")
        self.assertEqual(count_ops(fwd, r"all_gather_into_tensor\.default\("), 1)
        self.assertEqual(count_ops(bwd, r"reduce_scatter_tensor\.default\("), 1)
        for reorder in ("index_select", "aten.cat", "aten.gather", "index.Tensor"):
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
        attend_blocks = torch.ops.cpcompile.attend_blocks.default(primals_1, [primals_2], [primals_3], [0, 4, 0, 0, 4, 1, 4, 4, 0, 4, 4, 1], 0.25, 'cpu_flash', None, True)
        getitem: "f32[1, 4, 8, 16]" = attend_blocks[0]
        getitem_1: "f32[1, 4, 8]" = attend_blocks[1]
        wait_tensor: "f32[16, 2, 2, 1, 2, 16]" = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor)
        attend_blocks_1 = torch.ops.cpcompile.attend_blocks.default(primals_1, [], [], [0, 4, 0, 0, 4, 0, 4, 4, 0, 0, 16, 0, 4, 4, 1, 8, 8, 0], 0.25, 'cpu_flash', wait_tensor, True)
        getitem_2: "f32[1, 4, 8, 16]" = attend_blocks_1[0]
        getitem_3: "f32[1, 4, 8]" = attend_blocks_1[1]
        merge_partial = torch.ops.cpcompile.merge_partial.default(getitem, getitem_1, getitem_2, getitem_3, True)
        getitem_4: "f32[1, 4, 8, 16]" = merge_partial[0]
        getitem_5: "f32[1, 4, 8]" = merge_partial[1]
        detach: "f32[1, 4, 8, 16]" = torch.ops.aten.detach.default(getitem_4)
        return (getitem_4, primals_1, primals_2, primals_3, wait_tensor, getitem_5, detach)
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
