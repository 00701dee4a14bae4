"""Reading the graphs of a compiled region: view-only ops, the collectives a graph launches, the kernels that
Inductor's generated code calls."""

from __future__ import annotations

import re

import pytest
import torch

_c10d = torch.ops._c10d_functional
_aten = torch.ops.aten
# Ops that only reinterpret memory: what may sit between a collective and an attention kernel.
VIEW_OPS = {
    _aten.view.default,
    _aten.permute.default,
    _aten.split_with_sizes.default,
    _aten.slice.Tensor,
    _aten.select.int,
    _aten.unfold.default,
    _aten.squeeze.dim,
    _aten.unsqueeze.default,
    _aten.transpose.int,
    _c10d.wait_tensor.default,
}
# The aten attention kernels the traced executor calls (executor/dense.py): (forward ops, backward ops).
ATTENTION_KERNELS = (
    {_aten._scaled_dot_product_flash_attention_for_cpu.default},
    {_aten._scaled_dot_product_flash_attention_for_cpu_backward.default},
)


def attention_kernels(gm, backward: bool = False):
    """The attention kernel calls of a traced region's graph, in graph order."""
    targets = ATTENTION_KERNELS[1 if backward else 0]
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in targets]


def view_source(node):
    """Follow view-only ops (and getitem) back from `node`: the first node that is not one."""
    while node.op == "call_function" and (node.target in VIEW_OPS or node.target.__name__ == "getitem"):
        node = node.args[0]
    return node


def _collectives(gm):
    """Every collective launched (waits excluded)."""
    return [n for n in _calls_any(gm) if "c10d" in str(n.target) and "wait_tensor" not in str(n.target)]


def sent_bytes(gm, world: int, rank: int | None = None) -> int:
    """Bytes one rank sends in the graph's collectives: (world - 1) copies of an all-gather's input, (world - 1) /
    world of a reduce-scatter's or an equal-split all-to-all's input, and an all-to-all with input splits (the
    ring's shift) the rows it sends to the other ranks (`rank`: the sender). The packed-metadata check's 2-int64
    all-gather (once per graph, not per site) is left out."""
    total = 0
    for node in _collectives(gm):
        x = node.args[0].meta["val"]
        size = x.numel() * x.element_size()
        if "all_gather" in str(node.target):
            if x.dtype == torch.int64 and x.numel() == 2:  # the cu_seqlens check (regions/guards.py)
                continue
            total += (world - 1) * size
        elif "all_to_all" in str(node.target) and node.args[2] is not None and len(set(node.args[2])) > 1:
            splits = list(node.args[2])
            row = size // max(1, x.shape[0])
            total += row * (sum(splits) - splits[rank])
        else:  # reduce_scatter, equal-split all_to_all
            total += (world - 1) * size // world
    return total


def _calls_any(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function"]


def _kernel_calls(code: str) -> list[str]:
    """Names of the generated C++ kernels a compiled graph's `call` launches, in order."""
    body = code[code.index("def call(") :]
    return re.findall(r"^\s+(cpp_fused_\w+)\(", body, flags=re.M)


SNAPSHOT_TORCH = "2.13"
"""The torch whose graphs the snapshots hold: AOT's op order around collectives and flex's BlockMask tuple differ
between versions, so those snapshots run on it only (the same regions run on every version in the parity
tests)."""
on_snapshot_torch = pytest.mark.skipif(
    not torch.__version__.startswith(SNAPSHOT_TORCH),
    reason=f"a snapshot of torch {SNAPSHOT_TORCH}'s graph; this is torch {torch.__version__}",
)
