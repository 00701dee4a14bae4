"""comm="hierarchical"'s graphs on a fake process group (rank 1 of a 2x2 ("cp_inter", "cp_intra") mesh, one
process): the rewritten call with both levels, the AOT forward and backward (the a2a inside the node around the
ring across the nodes, the K/V shifts tied to the output gradient), and each level's collectives against the
registry's per-level bytes."""

from __future__ import annotations

import re

import expecttest
import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import cpcompile
from cpcompile.comm.wire import WireShape
from cpcompile.comms.registry import get_comm
from tests.support.fake_pg import capture_graphs, fake_group, normalize_gm, rewritten_graph
from tests.support.graphs import on_snapshot_torch


def gqa_attention(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def _qkv(heads=(4, 2, 2), s=8, requires_grad=True):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, h, s, 16, generator=g, requires_grad=requires_grad) for h in heads]


def _mesh(shape=(2, 2)):
    return init_device_mesh("cpu", shape, mesh_dim_names=("cp_inter", "cp_intra"))


def test_rewritten_graph_has_both_levels():
    with fake_group(rank=1, world=4):
        mesh = _mesh()
        inter, intra = mesh.get_group("cp_inter").group_name, mesh.get_group("cp_intra").group_name
        code = rewritten_graph(gqa_attention, *_qkv(requires_grad=False), strategy="zigzag", comm="hierarchical",
                               mesh=mesh)  # fmt: skip
    assert "cpcompile_comms_hierarchical_dense_hierarchical_attention(l_q_, l_k_, l_v_, layout = 'zigzag'" in code
    # CP rank 1 = node 0, index 1 in its node
    assert f"rank = 1, world = 4, levels = (('{inter}', 0, 2), ('{intra}', 1, 2)))" in code


def _graphs(layout="flat", heads=(4, 2, 2), mesh_shape=(2, 2), rank=1):
    with fake_group(rank=rank, world=mesh_shape[0] * mesh_shape[1]):
        mesh = _mesh(mesh_shape)
        be = cpcompile.backend(strategy=layout, comm="hierarchical", mesh=mesh, kernel="cpu_flash", inner="eager")
        graphs = capture_graphs(gqa_attention, be, *_qkv(heads, s=24 // mesh_shape[0] // mesh_shape[1] * 2))
        levels = {"cp_inter": mesh.get_group("cp_inter").group_name, "cp_intra": mesh.get_group("cp_intra").group_name}
    return graphs, levels


@on_snapshot_torch
class TestHierarchicalSnapshot(expecttest.TestCase):
    def test_flat_aot_forward_backward(self):
        """2x2 flat causal, GQA 4/2: one all-to-all of q/k/v heads inside the node ('3'), the ring's one K/V shift
        across the nodes ('2') overlapping step 0's causal square, the output back; backward: dout's all-to-all,
        the K/V shift tied to it, the fp32 dK/dV sent on twice, dq/dk/dv back in one all-to-all."""
        graphs, _ = _graphs()
        self.assertExpectedInline(
            normalize_gm(graphs["fw"].print_readable(False)),
            """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_1: "f32[1, 4, 12, 16]", primals_2: "f32[1, 2, 12, 16]", primals_3: "f32[1, 2, 12, 16]"):
        view: "f32[1, 2, 2, 12, 16]" = torch.ops.aten.view.default(primals_1, [1, 2, 2, 12, 16])
        permute: "f32[2, 12, 1, 2, 16]" = torch.ops.aten.permute.default(view, [1, 3, 0, 2, 4])
        clone: "f32[2, 12, 1, 2, 16]" = torch.ops.aten.clone.default(permute, memory_format = torch.contiguous_format)
        _unsafe_view: "f32[2, 12, 1, 32]" = torch.ops.aten._unsafe_view.default(clone, [2, 12, 1, 32])
        view_1: "f32[1, 2, 1, 12, 16]" = torch.ops.aten.view.default(primals_2, [1, 2, 1, 12, 16])
        permute_1: "f32[2, 12, 1, 1, 16]" = torch.ops.aten.permute.default(view_1, [1, 3, 0, 2, 4])
        view_2: "f32[2, 12, 1, 16]" = torch.ops.aten.view.default(permute_1, [2, 12, 1, 16])
        view_3: "f32[1, 2, 1, 12, 16]" = torch.ops.aten.view.default(primals_3, [1, 2, 1, 12, 16])
        permute_2: "f32[2, 12, 1, 1, 16]" = torch.ops.aten.permute.default(view_3, [1, 3, 0, 2, 4])
        view_4: "f32[2, 12, 1, 16]" = torch.ops.aten.view.default(permute_2, [2, 12, 1, 16])
        cat: "f32[2, 12, 1, 64]" = torch.ops.aten.cat.default([_unsafe_view, view_2, view_4], -1)
        all_to_all_single: "f32[2, 12, 1, 64]" = torch.ops._c10d_functional.all_to_all_single.default(cat, [1, 1], [1, 1], '3')
        wait_tensor: "f32[2, 12, 1, 64]" = torch.ops._c10d_functional.wait_tensor.default(all_to_all_single)
        view_5: "f32[24, 1, 64]" = torch.ops.aten.view.default(wait_tensor, [24, 1, 64])
        split_with_sizes = torch.ops.aten.split_with_sizes.default(view_5, [32, 16, 16], -1)
        getitem: "f32[24, 1, 32]" = split_with_sizes[0]
        getitem_1: "f32[24, 1, 16]" = split_with_sizes[1]
        getitem_2: "f32[24, 1, 16]" = split_with_sizes[2]
        view_6: "f32[24, 1, 2, 16]" = torch.ops.aten.view.default(getitem, [24, 1, 2, 16])
        permute_3: "f32[1, 2, 24, 16]" = torch.ops.aten.permute.default(view_6, [1, 2, 0, 3])
        view_7: "f32[24, 1, 1, 16]" = torch.ops.aten.view.default(getitem_1, [24, 1, 1, 16])
        permute_4: "f32[1, 1, 24, 16]" = torch.ops.aten.permute.default(view_7, [1, 2, 0, 3])
        view_8: "f32[24, 1, 1, 16]" = torch.ops.aten.view.default(getitem_2, [24, 1, 1, 16])
        permute_5: "f32[1, 1, 24, 16]" = torch.ops.aten.permute.default(view_8, [1, 2, 0, 3])
        view_9: "f32[1, 1, 1, 24, 16]" = torch.ops.aten.view.default(permute_4, [1, 1, 1, 24, 16])
        permute_6: "f32[24, 1, 1, 1, 16]" = torch.ops.aten.permute.default(view_9, [3, 2, 0, 1, 4])
        view_10: "f32[1, 1, 1, 24, 16]" = torch.ops.aten.view.default(permute_5, [1, 1, 1, 24, 16])
        permute_7: "f32[24, 1, 1, 1, 16]" = torch.ops.aten.permute.default(view_10, [3, 2, 0, 1, 4])
        stack: "f32[24, 1, 2, 1, 1, 16]" = torch.ops.aten.stack.default([permute_6, permute_7], 2)
        view_11: "f32[768]" = torch.ops.aten.view.default(stack, [-1])
        all_to_all_single_1: "f32[768]" = torch.ops._c10d_functional.all_to_all_single.default(view_11, [0, 768], [0, 768], '2')
        select: "f32[24, 2, 1, 1, 16]" = torch.ops.aten.select.int(stack, 1, 0)
        select_1: "f32[24, 1, 1, 16]" = torch.ops.aten.select.int(select, 1, 0)
        select_2: "f32[24, 1, 1, 16]" = torch.ops.aten.select.int(select, 1, 1)
        permute_8: "f32[1, 1, 24, 16]" = torch.ops.aten.permute.default(select_1, [1, 2, 0, 3])
        permute_9: "f32[1, 1, 24, 16]" = torch.ops.aten.permute.default(select_2, [1, 2, 0, 3])
        _scaled_dot_product_flash_attention_for_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(permute_3, permute_8, permute_9, 0.0, True, scale = 0.25)
        getitem_3: "f32[1, 2, 24, 16]" = _scaled_dot_product_flash_attention_for_cpu[0]
        getitem_4: "f32[1, 2, 24]" = _scaled_dot_product_flash_attention_for_cpu[1]
        wait_tensor_1: "f32[768]" = torch.ops._c10d_functional.wait_tensor.default(all_to_all_single_1)
        detach: "f32[1, 2, 24, 16]" = torch.ops.aten.detach.default(getitem_3)
        permute_10: "f32[24, 1, 2, 16]" = torch.ops.aten.permute.default(getitem_3, [2, 0, 1, 3])
        view_13: "f32[2, 12, 1, 32]" = torch.ops.aten.view.default(permute_10, [2, 12, 1, 32])
        all_to_all_single_2: "f32[2, 12, 1, 32]" = torch.ops._c10d_functional.all_to_all_single.default(view_13, [1, 1], [1, 1], '3')
        wait_tensor_2: "f32[2, 12, 1, 32]" = torch.ops._c10d_functional.wait_tensor.default(all_to_all_single_2)
        permute_11: "f32[1, 12, 2, 32]" = torch.ops.aten.permute.default(wait_tensor_2, [2, 1, 0, 3])
        clone_1: "f32[1, 12, 2, 32]" = torch.ops.aten.clone.default(permute_11, memory_format = torch.contiguous_format)
        _unsafe_view_1: "f32[1, 12, 4, 16]" = torch.ops.aten._unsafe_view.default(clone_1, [1, 12, 4, 16])
        transpose: "f32[1, 4, 12, 16]" = torch.ops.aten.transpose.int(_unsafe_view_1, 1, 2)
        detach_1: "f32[1, 2, 24, 16]" = torch.ops.aten.detach.default(detach)
        return (transpose, permute_3, stack, getitem_4, detach_1)
""",
        )
        self.assertExpectedInline(
            normalize_gm(graphs["bw"].print_readable(False)),
            """\
class GraphModule(torch.nn.Module):
    def forward(self, permute_3: "f32[1, 2, 24, 16]", stack: "f32[24, 1, 2, 1, 1, 16]", getitem_4: "f32[1, 2, 24]", detach_1: "f32[1, 2, 24, 16]", tangents_1: "f32[1, 4, 12, 16]"):
        transpose_1: "f32[1, 12, 4, 16]" = torch.ops.aten.transpose.int(tangents_1, 1, 2)
        view_14: "f32[1, 12, 2, 32]" = torch.ops.aten.view.default(transpose_1, [1, 12, 2, 32])
        permute_12: "f32[2, 12, 1, 32]" = torch.ops.aten.permute.default(view_14, [2, 1, 0, 3])
        clone_2: "f32[2, 12, 1, 32]" = torch.ops.aten.clone.default(permute_12, memory_format = torch.contiguous_format)
        all_to_all_single_3: "f32[2, 12, 1, 32]" = torch.ops._c10d_functional.all_to_all_single.default(clone_2, [1, 1], [1, 1], '3')
        wait_tensor_3: "f32[2, 12, 1, 32]" = torch.ops._c10d_functional.wait_tensor.default(all_to_all_single_3)
        view_15: "f32[24, 1, 2, 16]" = torch.ops.aten.view.default(wait_tensor_3, [24, 1, 2, 16])
        permute_13: "f32[1, 2, 24, 16]" = torch.ops.aten.permute.default(view_15, [1, 2, 0, 3])
        clone_3: "f32[1, 2, 24, 16]" = torch.ops.aten.clone.default(permute_13, memory_format = torch.contiguous_format)
        in_backward: "f32[24, 1, 2, 1, 1, 16]" = torch.ops.cpcompile.in_backward.default(stack, clone_3)
        view_16: "f32[768]" = torch.ops.aten.view.default(in_backward, [-1])
        all_to_all_single_4: "f32[768]" = torch.ops._c10d_functional.all_to_all_single.default(view_16, [0, 768], [0, 768], '2')
        select: "f32[24, 2, 1, 1, 16]" = torch.ops.aten.select.int(stack, 1, 0)
        select_1: "f32[24, 1, 1, 16]" = torch.ops.aten.select.int(select, 1, 0)
        select_2: "f32[24, 1, 1, 16]" = torch.ops.aten.select.int(select, 1, 1)
        permute_8: "f32[1, 1, 24, 16]" = torch.ops.aten.permute.default(select_1, [1, 2, 0, 3])
        permute_9: "f32[1, 1, 24, 16]" = torch.ops.aten.permute.default(select_2, [1, 2, 0, 3])
        _scaled_dot_product_flash_attention_for_cpu_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default(clone_3, permute_3, permute_8, permute_9, detach_1, getitem_4, 0.0, True, scale = 0.25)
        getitem_5: "f32[1, 2, 24, 16]" = _scaled_dot_product_flash_attention_for_cpu_backward[0]
        getitem_6: "f32[1, 1, 24, 16]" = _scaled_dot_product_flash_attention_for_cpu_backward[1]
        getitem_7: "f32[1, 1, 24, 16]" = _scaled_dot_product_flash_attention_for_cpu_backward[2]
        permute_16: "f32[24, 1, 1, 16]" = torch.ops.aten.permute.default(getitem_6, [2, 0, 1, 3])
        permute_17: "f32[24, 1, 1, 16]" = torch.ops.aten.permute.default(getitem_7, [2, 0, 1, 3])
        stack_1: "f32[24, 2, 1, 1, 16]" = torch.ops.aten.stack.default([permute_16, permute_17], 1)
        stack_2: "f32[24, 1, 2, 1, 1, 16]" = torch.ops.aten.stack.default([stack_1], 1)
        view_17: "f32[768]" = torch.ops.aten.view.default(stack_2, [-1])
        all_to_all_single_5: "f32[768]" = torch.ops._c10d_functional.all_to_all_single.default(view_17, [0, 768], [0, 768], '2')
        wait_tensor_4: "f32[768]" = torch.ops._c10d_functional.wait_tensor.default(all_to_all_single_4)
        wait_tensor_5: "f32[768]" = torch.ops._c10d_functional.wait_tensor.default(all_to_all_single_5)
        view_19: "f32[24, 1, 2, 1, 1, 16]" = torch.ops.aten.view.default(wait_tensor_5, [24, 1, 2, 1, 1, 16])
        view_20: "f32[768]" = torch.ops.aten.view.default(view_19, [-1])
        all_to_all_single_6: "f32[768]" = torch.ops._c10d_functional.all_to_all_single.default(view_20, [0, 768], [0, 768], '2')
        wait_tensor_6: "f32[768]" = torch.ops._c10d_functional.wait_tensor.default(all_to_all_single_6)
        view_21: "f32[24, 1, 2, 1, 1, 16]" = torch.ops.aten.view.default(wait_tensor_6, [24, 1, 2, 1, 1, 16])
        permute_18: "f32[2, 1, 1, 1, 24, 16]" = torch.ops.aten.permute.default(view_21, [2, 3, 4, 1, 0, 5])
        view_22: "f32[2, 1, 1, 24, 16]" = torch.ops.aten.view.default(permute_18, [2, 1, 1, 24, 16])
        select_6: "f32[1, 1, 24, 16]" = torch.ops.aten.select.int(view_22, 0, 0)
        select_7: "f32[1, 1, 24, 16]" = torch.ops.aten.select.int(view_22, 0, 1)
        permute_19: "f32[24, 1, 1, 16]" = torch.ops.aten.permute.default(select_7, [2, 0, 1, 3])
        view_23: "f32[24, 1, 16]" = torch.ops.aten.view.default(permute_19, [24, 1, 16])
        permute_20: "f32[24, 1, 1, 16]" = torch.ops.aten.permute.default(select_6, [2, 0, 1, 3])
        view_24: "f32[24, 1, 16]" = torch.ops.aten.view.default(permute_20, [24, 1, 16])
        permute_21: "f32[24, 1, 2, 16]" = torch.ops.aten.permute.default(getitem_5, [2, 0, 1, 3])
        view_25: "f32[24, 1, 32]" = torch.ops.aten.view.default(permute_21, [24, 1, 32])
        cat_1: "f32[24, 1, 64]" = torch.ops.aten.cat.default([view_25, view_24, view_23], 2)
        view_26: "f32[2, 12, 1, 64]" = torch.ops.aten.view.default(cat_1, [2, 12, 1, 64])
        all_to_all_single_7: "f32[2, 12, 1, 64]" = torch.ops._c10d_functional.all_to_all_single.default(view_26, [1, 1], [1, 1], '3')
        wait_tensor_7: "f32[2, 12, 1, 64]" = torch.ops._c10d_functional.wait_tensor.default(all_to_all_single_7)
        slice_1: "f32[2, 12, 1, 32]" = torch.ops.aten.slice.Tensor(wait_tensor_7, 3, 0, 32)
        slice_2: "f32[2, 12, 1, 16]" = torch.ops.aten.slice.Tensor(wait_tensor_7, 3, 32, 48)
        slice_3: "f32[2, 12, 1, 16]" = torch.ops.aten.slice.Tensor(wait_tensor_7, 3, 48, 64)
        view_27: "f32[2, 12, 1, 1, 16]" = torch.ops.aten.view.default(slice_3, [2, 12, 1, 1, 16])
        permute_22: "f32[1, 2, 1, 12, 16]" = torch.ops.aten.permute.default(view_27, [2, 0, 3, 1, 4])
        view_28: "f32[1, 2, 12, 16]" = torch.ops.aten.view.default(permute_22, [1, 2, 12, 16])
        view_29: "f32[2, 12, 1, 1, 16]" = torch.ops.aten.view.default(slice_2, [2, 12, 1, 1, 16])
        permute_23: "f32[1, 2, 1, 12, 16]" = torch.ops.aten.permute.default(view_29, [2, 0, 3, 1, 4])
        view_30: "f32[1, 2, 12, 16]" = torch.ops.aten.view.default(permute_23, [1, 2, 12, 16])
        view_31: "f32[2, 12, 1, 2, 16]" = torch.ops.aten.view.default(slice_1, [2, 12, 1, 2, 16])
        permute_24: "f32[1, 2, 2, 12, 16]" = torch.ops.aten.permute.default(view_31, [2, 0, 3, 1, 4])
        clone_4: "f32[1, 2, 2, 12, 16]" = torch.ops.aten.clone.default(permute_24, memory_format = torch.contiguous_format)
        _unsafe_view_2: "f32[1, 4, 12, 16]" = torch.ops.aten._unsafe_view.default(clone_4, [1, 4, 12, 16])
        return (_unsafe_view_2, view_30, view_28)
""",
        )


def _launched(gm) -> list:
    """Every collective the graph launches (waits excluded)."""
    calls = (n for n in gm.graph.nodes if n.op == "call_function")
    return [n for n in calls if "c10d" in str(n.target) and "wait_tensor" not in str(n.target)]


def _per_group_sent(gm, levels: dict, rank_in: dict) -> dict:
    """Bytes this rank sends per level in the graph's collectives (equal-split all-to-all: (n - 1) / n of the
    input; the ring's one-split all-to-all: the rows it sends to another rank)."""
    sent = dict.fromkeys(levels, 0)
    by_name = {name: dim for dim, name in levels.items()}
    for node in _launched(gm):
        if node.args[-1] not in by_name:  # the packed-metadata check's all-gather over the flattened group
            continue
        dim = by_name[node.args[-1]]
        x = node.args[0].meta["val"]
        size = x.numel() * x.element_size()
        splits = node.args[2]
        n = len(splits)
        if len(set(splits)) > 1:  # the ring's shift
            sent[dim] += size // max(1, x.shape[0]) * (sum(splits) - splits[rank_in[dim]])
        else:
            sent[dim] += (n - 1) * size // n
    return sent


@pytest.mark.parametrize(
    "layout, heads, mesh_shape, rank",
    [("flat", (4, 2, 2), (2, 2), 1), ("zigzag", (4, 1, 1), (2, 2), 2), ("zigzag", (6, 3, 3), (2, 3), 4),
     ("flat", (4, 2, 2), (3, 2), 3)],
)  # fmt: skip
def test_level_bytes_are_each_levels_collectives(layout, heads, mesh_shape, rank):
    graphs, levels = _graphs(layout, heads, mesh_shape, rank)
    inter, intra = mesh_shape
    rank_in = {"cp_inter": rank // intra, "cp_intra": rank % intra}
    tokens = 24 // inter // intra * 2
    shape = WireShape(tokens, 1, heads[0], heads[1], 16, 16, inter * intra, 4, 4, levels=mesh_shape,
                      dense_mask=(layout, True, None))  # fmt: skip
    expected = {lv.dim: (lv.fwd, lv.bwd) for lv in get_comm("hierarchical").level_bytes(shape)}
    got_fw, got_bw = (_per_group_sent(graphs[g], levels, rank_in) for g in ("fw", "bw"))
    assert {d: (got_fw[d], got_bw[d]) for d in levels} == expected
    assert get_comm("hierarchical").wire_bytes(shape) == (sum(got_fw.values()), sum(got_bw.values()))


def _packed_graphs(heads, mesh_shape, rank, lse):
    from torch.nn.attention.varlen import AuxRequest, varlen_attn

    from cpcompile.testing.varlen_model import GQA

    world = mesh_shape[0] * mesh_shape[1]
    cu = torch.tensor([0, 5, 20, 8 * world], dtype=torch.int32)
    aux = {"return_aux": AuxRequest(lse=True)} if lse else {}

    def fn(q, k, v, cu):
        return varlen_attn(q, k, v, cu, cu, 8 * world, 8 * world, window_size=(-1, 0), **GQA, **aux)

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(8, h, 8, generator=g, requires_grad=True) for h in (heads[0], heads[1], heads[1]))
    with fake_group(rank=rank, world=world):
        mesh = _mesh(mesh_shape)
        be = cpcompile.backend(strategy="thd", comm="hierarchical", mesh=mesh, inner="eager")
        graphs = capture_graphs(fn, be, q, k, v, cu)
        levels = {"cp_inter": mesh.get_group("cp_inter").group_name, "cp_intra": mesh.get_group("cp_intra").group_name}
    return graphs, levels


@pytest.mark.parametrize(
    "heads, mesh_shape, rank, lse",
    [((4, 2), (2, 2), 1, False), ((4, 1), (2, 2), 2, True), ((6, 3), (2, 3), 4, True), ((4, 2), (3, 2), 3, False)],
)
def test_packed_level_bytes_are_each_levels_collectives(heads, mesh_shape, rank, lse):
    graphs, levels = _packed_graphs(heads, mesh_shape, rank, lse)
    inter, intra = mesh_shape
    rank_in = {"cp_inter": rank // intra, "cp_intra": rank % intra}
    shape = WireShape(8, 1, heads[0], heads[1], 8, 8, inter * intra, 4, 4, lse, max_doc=8 * inter * intra,
                      levels=mesh_shape)  # fmt: skip
    expected = {lv.dim: (lv.fwd, lv.bwd) for lv in get_comm("hierarchical").level_bytes(shape)}
    got_fw, got_bw = (_per_group_sent(graphs[g], levels, rank_in) for g in ("fw", "bw"))
    assert {d: (got_fw[d], got_bw[d]) for d in levels} == expected


def test_inductor_forward_runs_each_node_step_while_the_next_chunk_travels():
    """Inductor's generated forward of a TinyLlama layer on a 2x2 mesh (zigzag, rank 1): the exchange inside the
    node (waited at once: the blocks need it), then the ring across the nodes in program order (the shift issued
    before step 0's kernel call, waited after it, then step 1's), then the output's exchange."""
    from torch._inductor.utils import run_and_get_code

    from cpcompile.testing.model import TinyConfig, TinyLlama

    cfg = TinyConfig(layers=1)
    torch.manual_seed(0)
    model = TinyLlama(cfg)
    ids, pos = torch.randint(0, cfg.vocab, (1, 8)), torch.arange(8)[None]
    with fake_group(rank=1, world=4):
        be = cpcompile.backend(strategy="zigzag", comm="hierarchical", mesh=_mesh())
        compiled = torch.compile(model, backend=be, fullgraph=True)
        _, codes = run_and_get_code(lambda: compiled(ids, pos).sum().backward())
    kernel = "_scaled_dot_product_flash_attention_for_cpu"
    events = re.findall(rf"(all_to_all_single|wait_tensor|{kernel})\.default\(", codes[0])
    exchange = ["all_to_all_single", "wait_tensor"]
    # step 0: one causal call over the node's two chunks; step 1: one call; the merge is pointwise (CPU)
    ring = ["all_to_all_single", kernel, "wait_tensor", kernel]
    assert events == [*exchange, *ring, *exchange], events


def test_explain_states_each_levels_bytes():
    """explain(world=(inter, intra)) plans a 2-D CP mesh's rank 0 and states what it sends on each level; a flat
    world is one refusal naming the mesh."""
    from cpcompile.testing.model import TinyConfig, TinyLlama

    model = TinyLlama(TinyConfig(layers=1))
    ids, pos = torch.randint(0, 128, (1, 32)), torch.arange(32)[None]
    report = cpcompile.explain(model, ids, pos, strategy="zigzag", comm="hierarchical", world=(2, 2))
    (site,) = report.sites
    assert not report.refusals and site.comm == "hierarchical"
    dims = [(lv.dim, lv.comm) for lv in site.estimate.levels]
    assert dims == [("cp_intra", "a2a"), ("cp_inter", "ring")], dims
    assert site.estimate.sent_fwd == sum(lv.fwd for lv in site.estimate.levels) > 0
    assert "on each level: cp_intra (a2a)" in str(report) and "cp_inter (ring)" in str(report)
    flat = cpcompile.explain(model, ids, pos, strategy="zigzag", comm="hierarchical", world=4)
    assert not flat.sites and "needs a 2-D CP mesh" in flat.refusals[0].message
