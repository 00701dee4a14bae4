# ruff: noqa: E501  (graph snapshots keep their long lines)
"""The graph the pass produces for comm="selective" (fake process group, one process): part of its contract."""

from __future__ import annotations

import expecttest
import torch
from torch.nn.attention.varlen import varlen_attn

from cpcompile.layouts.thd_balanced import make_plan
from tests.support.fake_pg import aot_graphs, count_ops, fake_group, rewritten_graph


def causal(q, k, v, cu):
    return varlen_attn(q, k, v, cu, cu, 6, 6, window_size=(-1, 0))  # C = min(8, 6) slots a peer


def _inputs(requires_grad=False):
    q, k, v = (torch.randn(8, 2, 4, requires_grad=requires_grad) for _ in range(3))
    return q, k, v, make_plan(torch.tensor((0, 3, 9, 14, 20, 26, 32), dtype=torch.int32), 4)


class TestSelectiveSnapshot(expecttest.TestCase):
    def test_selective_region(self):
        """The plan reaches the region as it is (after the layout's check); every shape is static."""
        with fake_group(rank=1, world=4):
            code = rewritten_graph(causal, *_inputs(), strategy="thd_balanced", comm="selective")
        self.assertExpectedInline(
            code,
            """\
class GraphModule(torch.nn.Module):
    def forward(self, L_q_: "f32[8, 2, 4]", L_k_: "f32[8, 2, 4]", L_v_: "f32[8, 2, 4]", L_cu_: "i32[56]"):
        l_q_ = L_q_
        l_k_ = L_k_
        l_v_ = L_v_
        l_cu_ = L_cu_
        check_packed_metadata: "i32[56]" = cpcompile_regions_guards_check_packed_metadata(l_cu_, total = 32, max_doc = 6, doc_multiple_per_cp = 0, group_name = '0', world = 4, layout = 'thd_balanced')
        selective_varlen_attention = cpcompile_comms_selective_varlen_selective_varlen_attention(l_q_, l_k_, l_v_, check_packed_metadata, layout = 'thd_balanced', causal = True, scale = 0.5, kernel = 'cpu_varlen_ref', group_name = '0', rank = 1, world = 4, max_doc = 6, window = (-1, -1))
        out: "f32[8, 2, 4]" = selective_varlen_attention[0]
        return (out,)
""",
        )

    def test_selective_aot_collectives_and_no_sync(self):
        """Forward: the metadata all-gather and ONE all-to-all of K/V slots (no K/V all-gather); backward: one
        all-to-all of their gradients, no reduce-scatter, no scatter-add; no host sync anywhere."""
        with fake_group(rank=0, world=4):
            fwd, bwd = aot_graphs(causal, *_inputs(requires_grad=True), strategy="thd_balanced", comm="selective")
        self.assertEqual(count_ops(fwd, r"all_gather_into_tensor\.default\("), 1)
        self.assertEqual(count_ops(fwd, r"all_to_all_single\.default\("), 1)
        self.assertEqual(count_ops(fwd, r"_assert_async\.msg\("), 3)  # cu agreed, the plan, the slots
        self.assertEqual(count_ops(fwd, r"attend_varlen_blocks\.default\("), 1)
        self.assertEqual(count_ops(bwd, r"all_to_all_single\.default\("), 1)
        self.assertEqual(count_ops(bwd, r"reduce_scatter_tensor\.default\("), 0)
        self.assertEqual(count_ops(bwd, r"aten\.(index_add|scatter|scatter_add)[_.]"), 0)
        self.assertEqual(count_ops(fwd + bwd, r"\.item\(|_local_scalar_dense"), 0)
