# ruff: noqa: E501  (graph snapshots keep their long lines)
"""The graph the pass produces for varlen_attn sites (fake process group, one process): part of its contract."""

from __future__ import annotations

import torch
import torch.distributed as dist
from expecttest import TestCase
from torch._dynamo.testing import normalize_gm
from torch.nn.attention.varlen import AuxRequest, varlen_attn
from torch.testing._internal.distributed.fake_pg import FakeStore

import cpcompile


def causal_with_lse(q, k, v, cu):
    out, lse = varlen_attn(q, k, v, cu, cu, 16, 16, window_size=(-1, 0), return_aux=AuxRequest(lse=True))
    return out * 2, lse


def full(q, k, v, cu):
    return varlen_attn(q, k, v, cu, cu, 16, 16, enable_gqa=True)


def rewritten(fn, strategy: str, heads=(2, 2), cu=(0, 3, 16, 32)) -> str:
    be = cpcompile.backend(strategy=strategy, inner="eager")
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(normalize_gm(be.transform(gm).print_readable(False)))
        return gm.forward

    torch._dynamo.reset()
    q = torch.randn(8, heads[0], 4)
    kv = torch.randn(8, heads[1], 4)
    torch.compile(fn, backend=capture, fullgraph=True)(q, kv, kv.clone(), torch.tensor(cu, dtype=torch.int32))
    assert len(graphs) == 1
    return graphs[0]


class TestThdSnapshot(TestCase):
    @classmethod
    def setUpClass(cls):
        dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)

    @classmethod
    def tearDownClass(cls):
        dist.destroy_process_group()

    def test_thd_causal_with_lse(self):
        self.assertExpectedInline(
            rewritten(causal_with_lse, "thd"),
            """\
class GraphModule(torch.nn.Module):
    def forward(self, L_q_: "f32[8, 2, 4]", L_k_: "f32[8, 2, 4]", L_v_: "f32[8, 2, 4]", L_cu_: "i32[4]"):
        l_q_ = L_q_
        l_k_ = L_k_
        l_v_ = L_v_
        l_cu_ = L_cu_

        all_gather_varlen_attention = cpcompile_regions_all_gather_varlen_all_gather_varlen_attention(l_q_, l_k_, l_v_, l_cu_, layout = 'thd', causal = True, scale = 0.5, kernel = 'cpu_varlen_ref', group_name = '0', rank = 1, world = 4);  l_q_ = l_k_ = l_v_ = l_cu_ = None
        out: "f32[8, 2, 4]" = all_gather_varlen_attention[0]
        lse: "f32[2, 8]" = all_gather_varlen_attention[1];  all_gather_varlen_attention = None

        mul: "f32[8, 2, 4]" = out * 2;  out = None
        return (mul, lse)
""",
        )

    def test_thd_zigzag_full_gqa(self):
        self.assertExpectedInline(
            rewritten(full, "thd_zigzag", heads=(4, 2), cu=(0, 8, 32)),
            """\
class GraphModule(torch.nn.Module):
    def forward(self, L_q_: "f32[8, 4, 4]", L_k_: "f32[8, 2, 4]", L_v_: "f32[8, 2, 4]", L_cu_: "i32[3]"):
        l_q_ = L_q_
        l_k_ = L_k_
        l_v_ = L_v_
        l_cu_ = L_cu_

        all_gather_varlen_attention = cpcompile_regions_all_gather_varlen_all_gather_varlen_attention(l_q_, l_k_, l_v_, l_cu_, layout = 'thd_zigzag', causal = False, scale = 0.5, kernel = 'cpu_varlen_ref', group_name = '0', rank = 1, world = 4);  l_q_ = l_k_ = l_v_ = l_cu_ = None
        out: "f32[8, 4, 4]" = all_gather_varlen_attention[0];  all_gather_varlen_attention = None
        return (out,)
""",
        )
