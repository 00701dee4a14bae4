"""The a2a region's graphs on a fake process group: rewritten graph, collectives per step, no reorder copies."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from expecttest import assert_expected_inline

import cpcompile
from tests.support.fake_pg import capture_graphs, fake_group, normalize_gm
from tests.support.graphs import _collectives, _kernel_calls, attention_kernels, on_snapshot_torch, view_source

WORLD, RANK = 4, 1
_c10d = torch.ops._c10d_functional


@pytest.fixture
def fake_pg():
    torch._dynamo.reset()
    with fake_group(RANK, WORLD):
        yield


def _inputs(hq=4, hkv=2, seq=8, d=8, b=1):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(b, h, seq, d, generator=g, requires_grad=True) for h in (hq, hkv, hkv)]


def _attention(causal):
    def attn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)

    return attn


def _capture(strategy, causal, inputs):
    """Compile, run forward and backward; return the rewritten Dynamo graph and the AOT fw/bw graphs."""
    be = cpcompile.backend(strategy=strategy, comm="a2a", inner="eager")
    return capture_graphs(_attention(causal), be, *inputs)


def test_rewritten_graph_snapshot(fake_pg):
    graphs = _capture("zigzag", True, _inputs())
    assert_expected_inline(
        normalize_gm(graphs["rewritten"].print_readable(False)),
        """\
class GraphModule(torch.nn.Module):
    def forward(self, L_q_: "f32[1, 4, 8, 8]", L_k_: "f32[1, 2, 8, 8]", L_v_: "f32[1, 2, 8, 8]"):
        l_q_ = L_q_
        l_k_ = L_k_
        l_v_ = L_v_
        a2a_attention: "f32[1, 4, 8, 8]" = cpcompile_comms_a2a_dense_a2a_attention(l_q_, l_k_, l_v_, layout = 'zigzag', causal = True, scale = 0.35355339059327373, kernel = 'cpu_flash', group_name = '0', rank = 1, world = 4)
        return (a2a_attention,)
""",
    )


def test_forward_graph_snapshot(fake_pg):
    """Flat causal, GQA 4 q / 2 kv heads at cp=4: replicate kv heads, pack q/k/v per destination rank (one
    cat), one all-to-all, views into the executor (one causal block over the whole sequence), the output
    straight into the return all-to-all, one copy into (B, S, H, D) memory."""
    graphs = _capture("flat", True, _inputs())
    assert_expected_inline(
        normalize_gm(graphs["fw"].print_readable(False)),
        """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_1: "f32[1, 4, 8, 8]", primals_2: "f32[1, 2, 8, 8]", primals_3: "f32[1, 2, 8, 8]"):
        unsqueeze: "f32[1, 2, 1, 8, 8]" = torch.ops.aten.unsqueeze.default(primals_2, 2)
        expand: "f32[1, 2, 2, 8, 8]" = torch.ops.aten.expand.default(unsqueeze, [1, 2, 2, 8, 8])
        clone: "f32[1, 2, 2, 8, 8]" = torch.ops.aten.clone.default(expand, memory_format = torch.contiguous_format)
        view: "f32[1, 4, 8, 8]" = torch.ops.aten.view.default(clone, [1, 4, 8, 8])
        unsqueeze_1: "f32[1, 2, 1, 8, 8]" = torch.ops.aten.unsqueeze.default(primals_3, 2)
        expand_1: "f32[1, 2, 2, 8, 8]" = torch.ops.aten.expand.default(unsqueeze_1, [1, 2, 2, 8, 8])
        clone_1: "f32[1, 2, 2, 8, 8]" = torch.ops.aten.clone.default(expand_1, memory_format = torch.contiguous_format)
        view_1: "f32[1, 4, 8, 8]" = torch.ops.aten.view.default(clone_1, [1, 4, 8, 8])
        view_2: "f32[1, 4, 1, 8, 8]" = torch.ops.aten.view.default(primals_1, [1, 4, 1, 8, 8])
        permute: "f32[4, 8, 1, 1, 8]" = torch.ops.aten.permute.default(view_2, [1, 3, 0, 2, 4])
        view_3: "f32[4, 8, 1, 8]" = torch.ops.aten.view.default(permute, [4, 8, 1, 8])
        view_4: "f32[1, 4, 1, 8, 8]" = torch.ops.aten.view.default(view, [1, 4, 1, 8, 8])
        permute_1: "f32[4, 8, 1, 1, 8]" = torch.ops.aten.permute.default(view_4, [1, 3, 0, 2, 4])
        view_5: "f32[4, 8, 1, 8]" = torch.ops.aten.view.default(permute_1, [4, 8, 1, 8])
        view_6: "f32[1, 4, 1, 8, 8]" = torch.ops.aten.view.default(view_1, [1, 4, 1, 8, 8])
        permute_2: "f32[4, 8, 1, 1, 8]" = torch.ops.aten.permute.default(view_6, [1, 3, 0, 2, 4])
        view_7: "f32[4, 8, 1, 8]" = torch.ops.aten.view.default(permute_2, [4, 8, 1, 8])
        cat: "f32[4, 8, 1, 24]" = torch.ops.aten.cat.default([view_3, view_5, view_7], -1)
        all_to_all_single: "f32[4, 8, 1, 24]" = torch.ops._c10d_functional.all_to_all_single.default(cat, [1, 1, 1, 1], [1, 1, 1, 1], '0')
        wait_tensor: "f32[4, 8, 1, 24]" = torch.ops._c10d_functional.wait_tensor.default(all_to_all_single)
        view_8: "f32[32, 1, 24]" = torch.ops.aten.view.default(wait_tensor, [32, 1, 24])
        split_with_sizes = torch.ops.aten.split_with_sizes.default(view_8, [8, 8, 8], -1)
        getitem: "f32[32, 1, 8]" = split_with_sizes[0]
        getitem_1: "f32[32, 1, 8]" = split_with_sizes[1]
        getitem_2: "f32[32, 1, 8]" = split_with_sizes[2]
        view_9: "f32[32, 1, 1, 8]" = torch.ops.aten.view.default(getitem, [32, 1, 1, 8])
        permute_3: "f32[1, 1, 32, 8]" = torch.ops.aten.permute.default(view_9, [1, 2, 0, 3])
        view_10: "f32[32, 1, 1, 8]" = torch.ops.aten.view.default(getitem_1, [32, 1, 1, 8])
        permute_4: "f32[1, 1, 32, 8]" = torch.ops.aten.permute.default(view_10, [1, 2, 0, 3])
        view_11: "f32[32, 1, 1, 8]" = torch.ops.aten.view.default(getitem_2, [32, 1, 1, 8])
        permute_5: "f32[1, 1, 32, 8]" = torch.ops.aten.permute.default(view_11, [1, 2, 0, 3])
        _scaled_dot_product_flash_attention_for_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(permute_3, permute_4, permute_5, 0.0, True, scale = 0.35355339059327373)
        getitem_3: "f32[1, 1, 32, 8]" = _scaled_dot_product_flash_attention_for_cpu[0]
        getitem_4: "f32[1, 1, 32]" = _scaled_dot_product_flash_attention_for_cpu[1]
        detach: "f32[1, 1, 32, 8]" = torch.ops.aten.detach.default(getitem_3)
        permute_6: "f32[32, 1, 1, 8]" = torch.ops.aten.permute.default(getitem_3, [2, 0, 1, 3])
        view_12: "f32[4, 8, 1, 8]" = torch.ops.aten.view.default(permute_6, [4, 8, 1, 8])
        all_to_all_single_1: "f32[4, 8, 1, 8]" = torch.ops._c10d_functional.all_to_all_single.default(view_12, [1, 1, 1, 1], [1, 1, 1, 1], '0')
        wait_tensor_1: "f32[4, 8, 1, 8]" = torch.ops._c10d_functional.wait_tensor.default(all_to_all_single_1)
        permute_7: "f32[1, 8, 4, 8]" = torch.ops.aten.permute.default(wait_tensor_1, [2, 1, 0, 3])
        view_13: "f32[1, 8, 4, 8]" = torch.ops.aten.view.default(permute_7, [1, 8, 4, 8])
        transpose: "f32[1, 4, 8, 8]" = torch.ops.aten.transpose.int(view_13, 1, 2)
        detach_1: "f32[1, 1, 32, 8]" = torch.ops.aten.detach.default(detach)
        return (transpose, permute_3, permute_4, permute_5, getitem_4, detach_1)
""",
    )


def _calls(gm, target):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target == target]


@pytest.mark.parametrize(
    "strategy,causal,exchanges",
    [("flat", True, 1), ("flat", False, 1), ("zigzag", True, 2), ("zigzag", False, 1)],
)
def test_collectives_per_step(fake_pg, strategy, causal, exchanges):
    """Forward: one q/k/v all-to-all per exchange plus one for the output; backward: the mirror image.
    Nothing else crosses ranks, and the forward moves only this rank's q heads plus the kv heads they read
    (GQA 4 q / 2 kv heads at cp=4: each kv head goes to 2 ranks, never to all)."""
    b, hq, hkv, seq, d = 1, 4, 2, 8, 8
    graphs = _capture(strategy, causal, _inputs(hq, hkv, seq, d, b))
    for phase in ("fw", "bw"):
        ops = _collectives(graphs[phase])
        assert [n.target for n in ops] == [_c10d.all_to_all_single.default] * (2 * exchanges), phase
    moved = sum(n.args[0].meta["val"].numel() for n in _collectives(graphs["fw"]))
    kv_per_rank = max(hkv // WORLD, 1)
    assert moved == b * seq * d * (hq + 2 * WORLD * kv_per_rank) + b * seq * hq * d


@pytest.mark.parametrize("strategy", ["flat", "zigzag"])
def test_executor_reads_exchanged_buffers_in_place(fake_pg, strategy):
    """Every q/k/v an attention kernel reads is a view of an all-to-all result, except zigzag's second buffer,
    whose chunks arrive in descending order: reversed once (one copy of q/k/v), its causal attention is one
    square and one rectangle, so zigzag runs 3 kernel calls, flat 1."""
    graphs = _capture(strategy, True, _inputs())
    calls = attention_kernels(graphs["fw"])
    assert len(calls) == (3 if strategy == "zigzag" else 1)
    for call in calls:
        for t in call.args[:3]:
            source = view_source(t)
            if source.target == _c10d.all_to_all_single.default:
                continue
            assert strategy == "zigzag" and source.target == torch.ops.aten.flip.default, (call, t, source)
            assert view_source(source.args[0]).target == _c10d.all_to_all_single.default, (call, source)


@on_snapshot_torch  # the kernel count is torch 2.13 Inductor's (2.14 calls its output cat kernel once a chunk)
def test_inductor_fuses_every_copy(fake_pg):
    """Zigzag causal under Inductor: the only kernels are one pack per all-to-all input (the copy the collective
    needs anyway, q/k/v in one buffer, GQA replication fused in), the one reversal of the descending buffer (its
    q/k/v; its output's reversal is fused into the merge), the LSE merge of that buffer's two partials written
    straight into the output's send buffer, and one kernel that writes the user's output. The kernels read the
    collective's buffers directly otherwise: a standalone reorder kernel would add to these counts."""
    from torch._inductor.utils import run_and_get_code

    be = cpcompile.backend(strategy="zigzag", comm="a2a", inner="inductor")
    compiled = torch.compile(_attention(True), backend=be, fullgraph=True)
    inputs = _inputs()

    def step():
        compiled(*inputs).sum().backward()

    _, (fw, bw) = run_and_get_code(step)
    # forward: pack slot 0, pack slot 1, reverse slot 1's q/k/v, merge slot 1 (into the send buffer), unpack
    assert len(_kernel_calls(fw)) == 5, _kernel_calls(fw)
    assert [name for name in _kernel_calls(fw) if "flip" in name and "exp" not in name] == [_kernel_calls(fw)[2]]
    # backward: pack dout per slot, reverse slot 1's dout, each gradient's partial sums written in the send layout
    # (dq, dk, dv), unpack (+ GQA replica sum) into the q/k/v grads
    assert len(_kernel_calls(bw)) == 7, _kernel_calls(bw)
    for line in fw.splitlines():
        if "_scaled_dot_product_flash_attention_for_cpu.default(" in line:
            args = line.split("_scaled_dot_product_flash_attention_for_cpu.default(", 1)[1]
            tensors = set(re.findall(r"reinterpret_tensor\((buf\d+)", args))
            sources = {m for m in re.findall(r"(buf\d+) = torch\.ops\._c10d_functional\.all_to_all_single", fw)}
            reversal = re.search(r"^\s*cpp_fused_flip\w*\((.*)\)$", fw, re.M).group(1)  # its inputs and outputs
            flipped = set(re.findall(r"\bbuf\d+\b", reversal))
            assert tensors and tensors <= sources | flipped, line
