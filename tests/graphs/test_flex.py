"""flex_attention rewritten: the region call the pass inserts, and what aot_autograd makes of it (fake process group)."""

from __future__ import annotations

import expecttest
import torch
from torch.utils.checkpoint import checkpoint

import cpcompile
from tests.support.fake_pg import aot_graphs, count_ops, fake_group, rewritten_graph
from tests.support.flex import attention, block_mask, cpu_flex_backward
from tests.support.graphs import on_snapshot_torch


def _qkv(requires_grad=False, local=16):
    g = torch.Generator().manual_seed(0)
    shapes = ((1, 4, local, 8), (1, 2, local, 8), (1, 2, local, 8))
    return [torch.randn(s, generator=g).requires_grad_(requires_grad) for s in shapes]


class TestFlexSnapshots(expecttest.TestCase):
    @on_snapshot_torch
    def test_zigzag_document_rewrite(self):
        with fake_group(rank=1, world=4):
            mask = cpcompile.shard_block_mask(block_mask("document", 1, 4), strategy="zigzag")
            code = rewritten_graph(attention(None), *_qkv(), mask, strategy="zigzag")
        self.assertExpectedInline(
            code,
            """\
class GraphModule(torch.nn.Module):
    def forward(self, L_q_: "f32[1, 4, 16, 8]", L_k_: "f32[1, 2, 16, 8]", L_v_: "f32[1, 2, 16, 8]", L_block_mask_kv_num_blocks: "i32[1, 1, 8]", L_block_mask_mask_mod_closure_2_cell_contents_closure_0_cell_contents: "i64[64]", L_block_mask_kv_indices: "i32[1, 1, 8, 8]", L_block_mask_full_kv_num_blocks: "i32[1, 1, 8]", L_block_mask_full_kv_indices: "i32[1, 1, 8, 8]", L_block_mask_q_num_blocks: "i32[1, 1, 8]", L_block_mask_q_indices: "i32[1, 1, 8, 8]", L_block_mask_full_q_num_blocks: "i32[1, 1, 8]", L_block_mask_full_q_indices: "i32[1, 1, 8, 8]"):
        l_q_ = L_q_
        l_k_ = L_k_
        l_v_ = L_v_
        l_block_mask_kv_num_blocks = L_block_mask_kv_num_blocks
        l_block_mask_mask_mod_closure_2_cell_contents_closure_0_cell_contents = L_block_mask_mask_mod_closure_2_cell_contents_closure_0_cell_contents
        l_block_mask_kv_indices = L_block_mask_kv_indices
        l_block_mask_full_kv_num_blocks = L_block_mask_full_kv_num_blocks
        l_block_mask_full_kv_indices = L_block_mask_full_kv_indices
        l_block_mask_q_num_blocks = L_block_mask_q_num_blocks
        l_block_mask_q_indices = L_block_mask_q_indices
        l_block_mask_full_q_num_blocks = L_block_mask_full_q_num_blocks
        l_block_mask_full_q_indices = L_block_mask_full_q_indices
        score_mod_0 = self.score_mod_0
        mask_fn_0 = self.mask_fn_0
        all_gather_flex_attention = cpcompile_comms_all_gather_flex_all_gather_flex_attention(l_q_, l_k_, l_v_, score_mod_0, mask_fn_0, (l_block_mask_kv_num_blocks, l_block_mask_kv_indices, l_block_mask_full_kv_num_blocks, l_block_mask_full_kv_indices, l_block_mask_q_num_blocks, l_block_mask_q_indices, l_block_mask_full_q_num_blocks, l_block_mask_full_q_indices), (None, None, None, None), (), (l_block_mask_mask_mod_closure_2_cell_contents_closure_0_cell_contents,), layout = 'zigzag', scale = 0.35355339059327373, group_name = '0', rank = 1, world = 4, kernel_options = {'BACKEND': 'AUTO', 'PRESCALE_QK': False, 'ROWS_GUARANTEED_SAFE': False, 'BLOCKS_ARE_CONTIGUOUS': False, 'WRITE_DQ': True, 'OUTPUT_LOGSUMEXP': False, 'OUTPUT_MAX': False}, block_size = (8, 8), masked = True)
        out: "f32[1, 4, 16, 8]" = all_gather_flex_attention[0]
        return (out,)
    class score_mod_0(torch.nn.Module):
        def forward(self, child: "f32[]", child_1: "i32[]", child_2: "i32[]", child_3: "i32[]", child_4: "i32[]"):
            return child
    class mask_fn_0(torch.nn.Module):
        def forward(self, child: "i32[]", child_1: "i32[]", child_2: "i32[]", child_3: "i32[]", l_block_mask_mask_mod_closure_2_cell_contents_closure_0_cell_contents: "i64[64]"):
            getitem: "i64[]" = l_block_mask_mask_mod_closure_2_cell_contents_closure_0_cell_contents[child_2]
            getitem_1: "i64[]" = l_block_mask_mask_mod_closure_2_cell_contents_closure_0_cell_contents[child_3]
            eq: "b8[]" = getitem == getitem_1
            ge: "b8[]" = child_2 >= child_3
            and_: "b8[]" = eq & ge
            return and_
""",
        )

    def test_aot_graphs_gather_once_and_reduce_scatter_once(self):
        """One all-gather of K/V forward, one reduce-scatter backward; flex's own forward and backward ops."""
        with fake_group(rank=0, world=2), cpu_flex_backward():
            mask = cpcompile.shard_block_mask(block_mask("causal_alibi", 1, 4), strategy="zigzag")
            fw, bw = aot_graphs(attention(None), *_qkv(requires_grad=True, local=32), mask, strategy="zigzag")
        gather, scatter = r"all_gather_into_tensor\.default\(", r"reduce_scatter_tensor\.default\("
        assert count_ops(fw, gather) == 1 and count_ops(fw, scatter) == 0
        assert count_ops(fw, r"higher_order\.flex_attention\(") == 1
        assert count_ops(bw, scatter) == 1 and count_ops(bw, gather) == 0
        assert count_ops(bw, r"higher_order\.flex_attention_backward\(") == 1

    def test_flex_inside_checkpoint_is_rewritten(self):
        """bodies.py finds a flex call in a checkpoint body, and does not search flex's own mod graphs."""
        attn = attention(lambda s, b, h, q, k: s + 0.01 * (q - k))

        def layer(q, k, v, mask):
            return checkpoint(attn, q, k, v, mask, use_reentrant=False)

        with fake_group(rank=1, world=2):
            mask = cpcompile.shard_block_mask(block_mask("window", 1, 4), strategy="flat")
            code = rewritten_graph(layer, *_qkv(local=32), mask, strategy="flat")
        assert "all_gather_flex_attention" in code and "torch.ops.higher_order.flex_attention(" not in code
        assert "flex_sharded_mask" not in code  # the marker is stripped from the mask graph
