"""Snapshots of cpcompile.attention sites (what attn_implementation="cpcompile" calls): the region call gets its
window and softcap as constants, the position ids and padding mask go to one run-time check a graph, and the
executor call gets the blocks' windows; an HF model's graph keeps no SDPA, no mask and no token mixing."""

from __future__ import annotations

from unittest import mock

import expecttest
import pytest
import torch

import cpcompile
from tests.support.fake_pg import aot_graphs, count_ops, fake_group, rewritten_graph


def windowed(q, k, v, pos):
    return cpcompile.attention(q, k, v, is_causal=True, scale=0.25, window=(3, 0), position_ids=pos)


def softcapped(q, k, v):
    return cpcompile.attention(q, k, v, is_causal=True, scale=0.25, softcap=20.0)


def with_peers():
    """The batch check as on a real group: the fake group has no peers, so the pass leaves it out there
    (passes/batch_check.has_peers); these snapshots show what a real group's graph gets."""
    return mock.patch("cpcompile.passes.batch_check.has_peers", lambda group: True)


def _qkv(s=8, requires_grad=False):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, s, 16, generator=g, requires_grad=requires_grad)
    k = torch.randn(1, 2, s, 16, generator=g, requires_grad=requires_grad)
    v = torch.randn(1, 2, s, 16, generator=g, requires_grad=requires_grad)
    return q, k, v


class TestSnapshots(expecttest.TestCase):
    def test_windowed_zigzag_rewrite(self):
        with fake_group(rank=1, world=2), with_peers():
            pos = cpcompile.shard(torch.arange(16)[None], strategy="zigzag", seq_dim=1)
            code = rewritten_graph(windowed, *_qkv(), pos, strategy="zigzag")
        self.assertExpectedInline(
            code,
            """\
class GraphModule(torch.nn.Module):
    def forward(self, L_q_: "f32[1, 4, 8, 16]", L_k_: "f32[1, 2, 8, 16]", L_v_: "f32[1, 2, 8, 16]", L_pos_: "i64[1, 8]"):
        l_q_ = L_q_
        l_k_ = L_k_
        l_v_ = L_v_
        l_pos_ = L_pos_
        check_batch = cpcompile_regions_batch_check_check_batch([l_pos_], [], [], None, layout = 'zigzag', group_name = '0', rank = 1, world = 2)
        all_gather_attention: "f32[1, 4, 8, 16]" = cpcompile_comms_all_gather_dense_all_gather_attention(l_q_, l_k_, l_v_, layout = 'zigzag', causal = True, scale = 0.25, kernel = 'cpu_flash', group_name = '0', rank = 1, world = 2, window = (3, 0))
        return (all_gather_attention,)
""",
        )

    def test_softcap_a2a_rewrite(self):
        with fake_group(rank=0, world=2):
            code = rewritten_graph(softcapped, *_qkv(), strategy="flat", comm="a2a")
        self.assertExpectedInline(
            code,
            """\
class GraphModule(torch.nn.Module):
    def forward(self, L_q_: "f32[1, 4, 8, 16]", L_k_: "f32[1, 2, 8, 16]", L_v_: "f32[1, 2, 8, 16]"):
        l_q_ = L_q_
        l_k_ = L_k_
        l_v_ = L_v_
        a2a_attention: "f32[1, 4, 8, 16]" = cpcompile_comms_a2a_dense_a2a_attention(l_q_, l_k_, l_v_, layout = 'flat', causal = True, scale = 0.25, kernel = 'cpu_ref', group_name = '0', rank = 0, world = 2, softcap = 20.0)
        return (a2a_attention,)
""",
        )

    def test_windowed_aot_forward(self):
        """Each executor call carries its blocks' windows (two ints a block: (-1, -1) none) after the six ints a block; the
        batch check (positions only, here) is one all-gather and one assert."""
        with fake_group(rank=1, world=2), with_peers():
            pos = cpcompile.shard(torch.arange(16)[None], strategy="zigzag", seq_dim=1)
            fwd, bwd = aot_graphs(windowed, *_qkv(requires_grad=True), pos, strategy="zigzag")
        self.assertEqual(count_ops(fwd, r"all_gather_into_tensor\.default\("), 2)  # K/V, and the token check
        self.assertEqual(count_ops(fwd, r"assert_on_ranks\.default\("), 1)
        self.assertEqual(count_ops(bwd, r"reduce_scatter_tensor\.default\("), 1)
        # two executor calls (main's all_gather region): the local blocks while the gather is in flight, then the
        # gathered ones; each carries its own blocks' windows
        calls = [line.strip() for line in fwd.splitlines() if "attend_blocks.default(" in line]
        self.assertEqual(len(calls), 2)
        self.assertExpectedInline(
            "\n".join(calls),
            """\
attend_blocks = torch.ops.cpcompile.attend_blocks.default(primals_1, [primals_2], [primals_3], [0, 8, 0, 0, 8, 0], 0.25, 'cpu_flash', None, True, [3, 0])
attend_blocks_1 = torch.ops.cpcompile.attend_blocks.default(primals_1, [], [], [0, 3, 0, 1, 3, 0], 0.25, 'cpu_flash', wait_tensor_1, True, [0, -1])""",
        )


def test_hf_model_graph_keeps_no_sdpa_mask_or_token_mixing():
    """Mistral with a sliding window under the cpcompile attention: two regions, one token check, no SDPA and
    no mask tensor left; HF's packed-sequence detection (a cumsum on the position ids) is dead code."""
    pytest.importorskip("transformers")
    from tests.support.hf_zoo import batch, build

    full = batch("mistral_sw", 2, 16)
    with fake_group(rank=0, world=2), with_peers():
        local = cpcompile.shard_batch(full, strategy="zigzag", hf_loss="causal_lm")
        graphs = []
        be = cpcompile.backend(strategy="zigzag", inner="eager")

        def capture(gm, example_inputs):
            compiled = be(gm, example_inputs)
            graphs.append(gm)
            return compiled

        torch._dynamo.reset()
        torch.compile(build("mistral_sw", "cpcompile"), backend=capture, fullgraph=True)(**local, use_cache=False)
    (gm,) = graphs
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert sum("all_gather_attention" in t for t in targets) == 2
    assert sum("check_batch" in t for t in targets) == 1
    assert not [t for t in targets if "scaled_dot_product" in t or "cpcompile.attention" in t], targets
    assert [p.window for p in be.plans] == [(4, 0), (4, 0)]


if __name__ == "__main__":
    import unittest

    unittest.main()
