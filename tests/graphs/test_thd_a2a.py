# ruff: noqa: E501  (graph snapshots keep their long lines)
"""Packed documents under comm="a2a" (thd layout): the graph's communication, on a fake process group."""

from __future__ import annotations

import re

import pytest
import torch
from expecttest import assert_expected_inline
from torch.nn.attention.varlen import AuxRequest, varlen_attn

import cpcompile
from cpcompile.testing.varlen_model import GQA
from tests.support.fake_pg import capture_graphs, fake_group, normalize_gm
from tests.support.graphs import VIEW_OPS, _collectives, _kernel_calls

WORLD, RANK, L = 4, 1, 8
_c10d = torch.ops._c10d_functional


def _capture(fn, heads=(4, 2)):
    """Rewritten Dynamo graph and AOT forward/backward graphs of `fn` as rank 1 of 4."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(L, h, 4, generator=g, requires_grad=True) for h in (heads[0], heads[1], heads[1]))
    cu = torch.tensor([0, 3, 20, 32], dtype=torch.int32)
    with fake_group(RANK, WORLD):
        return capture_graphs(fn, cpcompile.backend(strategy="thd", comm="a2a", inner="eager"), q, k, v, cu)


def sliding_with_lse(q, k, v, cu):
    return varlen_attn(q, k, v, cu, cu, 32, 32, window_size=(4, 0), **GQA, return_aux=AuxRequest(lse=True))


def causal(q, k, v, cu):
    return varlen_attn(q, k, v, cu, cu, 32, 32, window_size=(-1, 0), **GQA)


def test_rewritten_graph_snapshot():
    graphs = _capture(sliding_with_lse)
    assert_expected_inline(
        normalize_gm(graphs["rewritten"].print_readable(False)),
        """\
class GraphModule(torch.nn.Module):
    def forward(self, L_q_: "f32[8, 4, 4]", L_k_: "f32[8, 2, 4]", L_v_: "f32[8, 2, 4]", L_cu_: "i32[4]"):
        l_q_ = L_q_
        l_k_ = L_k_
        l_v_ = L_v_
        l_cu_ = L_cu_
        check_packed_metadata: "i32[4]" = cpcompile_regions_guards_check_packed_metadata(l_cu_, total = 32, max_doc = 32, doc_multiple_per_cp = 0, group_name = '0', world = 4)
        a2a_varlen_attention = cpcompile_comms_a2a_varlen_a2a_varlen_attention(l_q_, l_k_, l_v_, check_packed_metadata, layout = 'thd', causal = True, scale = 0.5, kernel = 'cpu_varlen_ref', group_name = '0', rank = 1, world = 4, max_doc = 32, window = (4, -1), return_lse = True)
        out: "f32[8, 4, 4]" = a2a_varlen_attention[0]
        lse: "f32[4, 8]" = a2a_varlen_attention[1]
        return (out, lse)
""",
    )


@pytest.mark.parametrize("fn,lse", [(causal, False), (sliding_with_lse, True)])
def test_collectives_per_step(fn, lse):
    """Forward: the cu_seqlens check's all-gather of 2 int64 a rank (regions/guards.py), one q/k/v all-to-all,
    one for the output (+ one for the lse only when the graph reads it); backward: the mirror image of the two
    all-to-alls. The forward moves this rank's q heads, the kv heads they read (GQA 4 q / 2 kv heads at cp=4:
    each kv head to 2 ranks), the output and the lse."""
    hq, hkv, d = 4, 2, 4
    graphs = _capture(fn, (hq, hkv))
    (check, *fw), bw = _collectives(graphs["fw"]), _collectives(graphs["bw"])
    assert check.target == _c10d.all_gather_into_tensor.default and check.args[0].meta["val"].numel() == 2
    assert [n.target for n in fw] == [_c10d.all_to_all_single.default] * (3 if lse else 2)
    assert [n.target for n in bw] == [_c10d.all_to_all_single.default] * 2
    moved = sum(n.args[0].meta["val"].numel() for n in fw)
    assert moved == L * d * (hq + 2 * WORLD * max(hkv // WORLD, 1)) + L * hq * d + (L * hq if lse else 0)


def test_executor_reads_exchanged_buffer_in_place():
    """q/k/v of the one varlen block are views of the all-to-all result, with the GLOBAL cu_seqlens."""
    graphs = _capture(causal)
    (call,) = [n for n in graphs["fw"].graph.nodes if n.target == torch.ops.cpcompile.attend_varlen_blocks.default]
    views = VIEW_OPS | {torch.ops.aten.squeeze.dim, torch.ops.aten.squeeze.dims}
    q, ks, vs, ranges, spec = call.args[:5]
    covers_all_square = [0, 1, WORLD * L, WORLD * L, -1, -1, 1, 1, 1]
    assert len(ks) == len(ranges) == 1 and spec == covers_all_square, spec
    for t in [q, *ks, *vs]:
        while t.op == "call_function" and (t.target in views or t.target.__name__ == "getitem"):
            t = t.args[0]
        assert t.target == _c10d.all_to_all_single.default, t


def test_inductor_kernels():
    """Under Inductor (sliding window, GQA replicated): forward = the cu_seqlens check, the q/k/v pack
    (replication fused in) and the block ranges, backward = the dout pack, the dq/dk/dv pack and one unpack with the replica sum; the
    executor reads the all-to-all buffer directly (no reorder kernel anywhere)."""
    from torch._inductor.utils import run_and_get_code

    def fn(q, k, v, cu):
        return varlen_attn(q, k, v, cu, cu, 32, 32, window_size=(4, 0), **GQA)

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(L, h, 4, generator=g, requires_grad=True) for h in (4, 2, 2))
    cu = torch.tensor([0, 3, 20, 32], dtype=torch.int32)
    with fake_group(RANK, WORLD):
        be = cpcompile.backend(strategy="thd", comm="a2a", inner="inductor")
        compiled = torch.compile(fn, backend=be, fullgraph=True)
        _, (fw, bw) = run_and_get_code(lambda: compiled(q, k, v, cu).sum().backward())
    assert len(_kernel_calls(fw)) == 3, _kernel_calls(fw)
    assert len(_kernel_calls(bw)) == 3, _kernel_calls(bw)
    (line,) = [ln for ln in fw.splitlines() if "cpcompile.attend_varlen_blocks.default(" in ln]
    tensors = re.findall(r"reinterpret_tensor\((buf\d+)", line.split("attend_varlen_blocks.default(", 1)[1])
    (exchanged,) = re.findall(r"(buf\d+) = torch\.ops\._c10d_functional\.all_to_all_single", fw)[:1]
    assert set(tensors[:3]) == {exchanged}, line  # q, k, v (then the ranges)
