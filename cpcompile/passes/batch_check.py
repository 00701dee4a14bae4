"""Insert the run-time batch check (regions/batch_check.py): one check_batch call in each graph that holds CP
regions, before its first region, fed what of the batch that graph sees:

- position ids: cpcompile.attention's (site metadata) and the graph inputs named `*position*` (HF's position_ids,
  torchtitan's positions, the examples') with the local length on their last dim, integer; not where a mask
  describes documents under a chunk layout (flex_attention's BlockMask: positions may restart at each document);
- padding masks: cpcompile.attention's;
- token ids, only where no positions are checked (the positions catch an unsharded batch themselves): the integer
  graph inputs with a dim of the local length that are not offsets (cu_seqlens);
- packed layouts: the cu_seqlens the graph's first varlen region reads (after its metadata check).

Nothing is inserted when the graph sees none of them (q/k/v as inputs), for DTensor regions (their placements say
where the tokens are), a CP group of one rank, or a group without peers (a fake process group: one process
standing in for a rank, fed any batch; explain()'s stand-in); backend(check_batch=False) skips the step
(passes/rewrite.py).
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist
import torch.fx

from ..families.plans import CPPlan
from ..families.registry import get_family
from ..graph.region_call import read_call
from ..layouts import THD_LAYOUTS
from ..regions.batch_check import check_batch

POSITION_NAME = re.compile(r"position", re.IGNORECASE)
"""Graph inputs that are the model's position ids: Dynamo names placeholders after the arguments (HF's
position_ids, torchtitan's positions)."""


def _traced(node: torch.fx.Node):
    return node.meta.get("example_value", node.meta.get("val"))


def _integer_input(node: torch.fx.Node) -> torch.Tensor | None:
    value = _traced(node)
    if not isinstance(value, torch.Tensor) or value.is_floating_point() or value.is_complex():
        return None
    if value.dtype == torch.bool or isinstance(value, torch.nn.Parameter):
        return None
    return value


def _local_length(plan: CPPlan) -> int:
    return int(plan.site.q_shape[get_family(plan.site.kind).seq_dim])


def _sizes(value: torch.Tensor) -> list[int]:
    return [int(s) if isinstance(s, int) else int(s.node.hint) for s in value.shape]


def has_peers(group) -> bool:
    """Whether the CP group has other ranks to compare with: not a fake process group (one process standing in for
    a rank: graph tests, one-rank benchmarks, which feed it any batch) nor explain()'s stand-in group (none), whose
    all-gather would hand this rank's own verdicts back for every rank."""
    if group is None:
        return False
    try:
        return dist.get_backend(group) != "fake"
    except (RuntimeError, ValueError):
        return False


def insert_batch_checks(regions: list[tuple[torch.fx.Node, CPPlan]]) -> None:
    """One check_batch call per graph holding regions (`regions`: every rewritten region node and its plan)."""
    by_graph: dict[int, list[tuple[torch.fx.Node, CPPlan]]] = {}
    for region, plan in regions:
        by_graph.setdefault(id(region.graph), []).append((region, plan))
    for found in by_graph.values():
        order = {n: i for i, n in enumerate(found[0][0].graph.nodes)}
        _insert(sorted(found, key=lambda rp: order[rp[0]]))


def _insert(found: list[tuple[torch.fx.Node, CPPlan]]) -> None:
    first, plan = found[0]
    if plan.dtensor or plan.group.size < 2 or not has_peers(plan.group.group):
        return
    graph, packed = first.graph, plan.layout in THD_LAYOUTS
    lengths = {_local_length(p) for _, p in found}
    positions: list[torch.fx.Node] = []
    masks: list[torch.fx.Node] = []
    for _, p in found:
        for node, into in ((p.site.position_ids, positions), (p.site.padding_mask, masks)):
            if isinstance(node, torch.fx.Node) and node.graph is graph and node not in into:
                into.append(node)
    placeholders = list(graph.find_nodes(op="placeholder"))
    # documents a mask describes (flex's BlockMask: an offset field other than cu_seqlens) may restart the model's
    # positions at each document under a chunk layout: its positions are not checked (its tokens are instead)
    masked_documents = not packed and any(get_family(p.site.kind).offset_fields for _, p in found)
    for node in [] if masked_documents else placeholders:
        value = _integer_input(node)
        if value is None or not POSITION_NAME.search(node.name) or node in positions:
            continue
        sizes = _sizes(value)
        if sizes and sizes[-1] in lengths and (not packed or value.numel() == sizes[-1]):
            positions.append(node)
    cu = None
    if packed:  # the offsets the first region reads (its family's offset field "cu_seqlens", checked already)
        offsets = [(r, get_family(p.site.kind)) for r, p in found]
        offsets = [(r, f) for r, f in offsets if "cu_seqlens" in f.offset_fields]
        cu = read_call(offsets[0][1].call, offsets[0][0]).cu_seqlens if offsets else None
        if not isinstance(cu, torch.fx.Node):
            positions, cu = [], None
    offsets = {cu} | set(cu.all_input_nodes) if cu is not None else set()
    tokens = []
    if not positions:
        for node in placeholders:
            value = _integer_input(node)
            if value is not None and node not in offsets and set(_sizes(value)) & lengths:
                tokens.append(node)
    if not (positions or masks or tokens):
        return
    kwargs = dict(layout=plan.layout, group_name=plan.group.name, rank=plan.group.rank, world=plan.group.size)
    with graph.inserting_before(first):
        check = graph.call_function(check_batch, (positions, masks, tokens, cu), kwargs)
    check.meta = {"stack_trace": first.meta.get("stack_trace"), "cpcompile_check": True}
