# ruff: noqa: E501  (graph snapshots keep their long lines)
"""Packed documents under comm="a2a" (thd layout): parity with per-document attention (incl. sliding windows)
and the graph's communication, on a fake process group.

Parity: one spawn per world size, several cases each (causal, full, windows (w, 0), (l, r); GQA with
Hkv < cp and >= cp; fp64 and bf16; lse returned through return_aux), outputs and q/k/v grads on every rank.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from expecttest import assert_expected_inline
from fake_pg import capture_graphs, fake_group, normalize_gm
from parity import max_err
from test_a2a_graph import VIEW_OPS, _collectives
from test_parity import _assert_reports
from thd_parity import compare_packed, cu_of, packed_case, window_mask
from torch.nn.attention.varlen import AuxRequest, varlen_attn

import cpcompile
from cpcompile.testing.distributed import run_ranks

_c10d = torch.ops._c10d_functional


def _a2a():
    return cpcompile.backend(strategy="thd", comm="a2a", inner="aot_eager")


def _lse_case(world: int, lengths: list[int], heads: tuple[int, int], window: tuple[int, int]) -> dict:
    """(out, lse) of a windowed varlen_attn with return_aux, against per-document masked attention in fp64."""
    cu = cu_of(lengths)
    q, k, v, _ = packed_case(3, int(cu[-1]), *heads, 8)

    def fn(q, k, v, cu):
        return varlen_attn(
            q, k, v, cu, cu, 64, 64, window_size=window, enable_gqa=True, return_aux=AuxRequest(lse=True)
        )

    shard = lambda t, dim=0: cpcompile.shard(t, strategy="thd", seq_dim=dim, cu_seqlens=cu)  # noqa: E731
    torch._dynamo.reset()
    out, lse = torch.compile(fn, backend=_a2a(), fullgraph=True)(shard(q), shard(k), shard(v), cu)
    ref_out, ref_lse = torch.zeros_like(q), torch.zeros(heads[0], q.shape[0], dtype=q.dtype)
    groups = heads[0] // heads[1]
    for a, b in zip(cu.tolist(), cu.tolist()[1:]):
        qd, kd, vd = q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1)
        kd, vd = kd.repeat_interleave(groups, 0), vd.repeat_interleave(groups, 0)
        scores = (qd @ kd.transpose(1, 2) / math.sqrt(8)).masked_fill(~window_mask(b - a, window), float("-inf"))
        ref_lse[:, a:b] = scores.logsumexp(-1)
        ref_out[a:b] = (scores.softmax(-1) @ vd).transpose(0, 1)
    return {"out": (max_err(out, shard(ref_out)), 1e-10), "lse": (max_err(lse, shard(ref_lse, 1)), 1e-5)}


def _sweep(rank, world):
    del rank
    f64, bf16 = torch.float64, torch.bfloat16
    edge = [1, 1, 3 * world, 5, 3 * world + 1]  # 1-token documents and ones spanning several ranks
    mixed = [2, 7, 1, 4 * world + 2, 2 * world]
    if world == 2:
        cases = {
            "causal gqa": dict(causal=True, dtype=f64, lengths=edge, heads=(4, 2)),
            "window (2, 0), 1 kv head": dict(causal=True, dtype=f64, lengths=mixed, heads=(4, 1), window=(2, 0)),
            "window (1, 2)": dict(causal=False, dtype=f64, lengths=edge, heads=(2, 2), window=(1, 2)),
        }
    else:
        cases = {
            "causal bf16, kv heads < cp": dict(causal=True, dtype=bf16, lengths=edge, heads=(4, 1)),
            "full": dict(causal=False, dtype=f64, lengths=mixed, heads=(8, 4)),
            "window (-1, 1), kv heads < cp": dict(causal=False, dtype=f64, lengths=mixed, heads=(4, 2), window=(-1, 1)),
        }
    results = {}
    for name, c in cases.items():
        results[name] = compare_packed(
            "thd",
            c["causal"],
            c["dtype"],
            c["lengths"],
            heads=c["heads"],
            backend=_a2a(),
            window=c.get("window"),
            seed=len(results),
        )
    results["lse window (3, 0)"] = _lse_case(world, mixed, (4, 2), (3, 0))
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_thd_a2a_parity(world):
    _assert_reports(run_ranks(_sweep, world, timeout=600))


# ---- graphs on a fake process group (rank 1 of 4) ----

WORLD, RANK, L = 4, 1, 8


def _capture(fn, heads=(4, 2)):
    """Rewritten Dynamo graph and AOT forward/backward graphs of `fn` as rank 1 of 4."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(L, h, 4, generator=g, requires_grad=True) for h in (heads[0], heads[1], heads[1]))
    cu = torch.tensor([0, 3, 20, 32], dtype=torch.int32)
    with fake_group(RANK, WORLD):
        return capture_graphs(fn, cpcompile.backend(strategy="thd", comm="a2a", inner="eager"), q, k, v, cu)


def sliding_with_lse(q, k, v, cu):
    return varlen_attn(q, k, v, cu, cu, 32, 32, window_size=(4, 0), enable_gqa=True, return_aux=AuxRequest(lse=True))


def causal(q, k, v, cu):
    return varlen_attn(q, k, v, cu, cu, 32, 32, window_size=(-1, 0), enable_gqa=True)


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
        a2a_varlen_attention = cpcompile_regions_a2a_varlen_a2a_varlen_attention(l_q_, l_k_, l_v_, check_packed_metadata, layout = 'thd', causal = True, scale = 0.5, kernel = 'cpu_varlen_ref', group_name = '0', rank = 1, world = 4, max_doc = 32, window = (4, -1), return_lse = True)
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
    assert len(ks) == len(ranges) == 1 and spec == [0, 1, WORLD * L, WORLD * L, -1, -1, 1, 1], spec  # covers all
    for t in [q, *ks, *vs]:
        while t.op == "call_function" and (t.target in views or t.target.__name__ == "getitem"):
            t = t.args[0]
        assert t.target == _c10d.all_to_all_single.default, t


def test_inductor_kernels():
    """Under Inductor (sliding window, GQA replicated): forward = the cu_seqlens check, the q/k/v pack
    (replication fused in) and the block ranges, backward = the dout pack, the dq/dk/dv pack and one unpack with the replica sum; the
    executor reads the all-to-all buffer directly (no reorder kernel anywhere)."""
    from test_a2a_graph import _kernel_calls
    from torch._inductor.utils import run_and_get_code

    def fn(q, k, v, cu):
        return varlen_attn(q, k, v, cu, cu, 32, 32, window_size=(4, 0), enable_gqa=True)

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
