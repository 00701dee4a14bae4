"""Which graph inputs may carry the sequence: not model state (parameters and buffers, which Dynamo marks as
static inputs), not the GLOBAL offsets that only reach a varlen region's cu_seqlens or a flex region's BlockMask.
DTensor inputs say where their tokens are themselves: their placement on the CP mesh dim, at global shapes.
The local lengths the graph's regions run at (attention sites and token mixers) are read here too."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.fx
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree

from ..families.registry import get_family
from ..graph.bodies import ONCE
from ..graph.region_call import read_call
from ..mesh import cp_mesh_dim
from ..mixers import TOKEN_REGION
from ..token_marks import TokenMark, token_mark
from .flow import concrete, leaves, traced


def walk(gm: torch.fx.GraphModule) -> Iterator[torch.fx.Node]:
    """Every node of the graph and of the bodies its higher-order ops call (get_attr GraphModules)."""
    for node in gm.graph.nodes:
        yield node
        if node.op == "get_attr":
            sub = getattr(gm, str(node.target), None)
            if isinstance(sub, torch.fx.GraphModule):
                yield from walk(sub)


def is_state(node: torch.fx.Node, value: torch.Tensor) -> bool:
    """Parameters and buffers (Dynamo marks both as static inputs) never carry the sequence."""
    if isinstance(value, torch.nn.Parameter):
        return True
    if "_dynamo_static_input_type" in (node.meta.get("tensor_dict") or {}):
        return True
    grapharg = node.meta.get("grapharg")
    return isinstance(getattr(grapharg, "example", None), torch.nn.Parameter)


def state_inputs(gm: torch.fx.GraphModule) -> frozenset[str]:
    """Placeholders that are model state (parameters, buffers)."""
    return frozenset(
        n.name
        for n in gm.graph.nodes
        if n.op == "placeholder" and isinstance(v := traced(n), torch.Tensor) and is_state(n, v)
    )


def dtensor_inputs(gm: torch.fx.GraphModule) -> list[tuple[torch.fx.Node, int]]:
    """(placeholder, token dim) of every DTensor input sharded on its CP mesh dim (global shapes)."""
    found = []
    for node in gm.graph.nodes:
        value = traced(node) if node.op == "placeholder" else None
        if isinstance(value, DTensor) and (cp := cp_mesh_dim(value.device_mesh)) is not None:
            p = value.placements[cp]
            if p.is_shard():
                found.append((node, p.dim % value.dim()))
    return found


def data_inputs(gm: torch.fx.GraphModule, strategy: str = "zigzag") -> list | None:
    """(placeholder, meta tensor like its value) of every tensor input that is not model state; for a graph of
    DTensors, (placeholder, token dim) from their placements, or None under a flat layout (skipped: DTensor's
    own propagation redistributes what an op needs)."""
    inputs = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        value = traced(node)
        if isinstance(value, DTensor):
            return None if strategy == "flat" else dtensor_inputs(gm)
        if not isinstance(value, torch.Tensor) or is_state(node, value):
            continue
        inputs.append((node, torch.empty(concrete(value.shape), dtype=value.dtype, device="meta")))
    return inputs


def input_marks(gm: torch.fx.GraphModule) -> dict[str, TokenMark]:
    """{placeholder: mark} of the data inputs whose real tensor is marked as holding tokens (token_marks.py:
    shard / shard_batch's results, an earlier compiled graph's outputs); Dynamo keeps a weak reference to each real
    input in the placeholder's grapharg. A mark whose parts do not fit the traced shape is ignored."""
    found = {}
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        value, grapharg = traced(node), node.meta.get("grapharg")
        mark = token_mark(getattr(grapharg, "example", None)) if grapharg is not None else None
        if mark is None or not isinstance(value, torch.Tensor) or is_state(node, value):
            continue
        shape = concrete(value.shape)
        if all(d < len(shape) and shape[d] % hi == 0 and hi <= shape[d] for d, _, hi in mark.parts):
            found[node.name] = mark
    return found


def cu_only_inputs(gm: torch.fx.GraphModule) -> set[str]:
    """Inputs that reach the regions' offset fields (Family.offset_fields: varlen's cu_seqlens, flex's BlockMask)
    but no q/k/v: global offsets, never sharded."""
    cu, qkv = set(), set()
    for node in walk(gm):
        plan = node.meta.get("cpcompile_plan")
        if plan is not None and node.op == "call_function":
            family = get_family(plan.site.kind)
            call = read_call(family.call, node)  # the region's inputs by name (graph/region_call.py)
            qkv |= top_inputs(gm, [call.q, call.k, call.v])
            for name in family.offset_fields:  # varlen's cu_seqlens, flex's global BlockMask tensors
                cu |= top_inputs(gm, list(pytree.tree_leaves(getattr(call, name))))
    return cu - qkv


def top_inputs(gm: torch.fx.GraphModule, args) -> set[str]:
    """Names of the top-level placeholders that `args` (nodes of gm, or of a body it calls) depend on: a body's
    placeholder stands for the operand its call passes there (graph/bodies.py ONCE)."""
    body_calls: dict[int, list[tuple]] = {}
    for node in walk(gm):
        if node.op == "call_function" and isinstance(node.target, torch._ops.HigherOrderOperator):
            call = ONCE.get(node.target.name())
            if call is None:
                continue
            body, operands = call.split(node.args)
            if isinstance(body, torch.fx.Node):
                sub = getattr(node.graph.owning_module, str(body.target), None)
                if sub is not None:
                    body_calls.setdefault(id(sub.graph), []).append(operands)
    found, seen = set(), set()
    stack = [a for a in args if isinstance(a, torch.fx.Node)]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op == "placeholder":
            calls = body_calls.get(id(node.graph))
            if calls is None:
                found.add(node.name)
                continue
            index = [n for n in node.graph.nodes if n.op == "placeholder"].index(node)
            for operands in calls:
                if index < len(operands) and isinstance(operands[index], torch.fx.Node):
                    stack.append(operands[index])
            continue
        stack.extend(node.all_input_nodes)
    return found


def mixer_lengths(gm: torch.fx.GraphModule) -> set[int]:
    """The local lengths of the token mixers' regions (cpcompile/mixers/): their outputs' seq dim."""
    found = set()
    for node in walk(gm):
        seq = node.meta.get(TOKEN_REGION)
        if seq is not None:
            found.add(int(leaves(traced(node))[0].shape[seq]))
    return found


def site_lengths(plans) -> set[int]:
    """The local lengths of the rewritten attention sites: q's sequence dim (its family's seq_dim)."""
    return {p.site.q_shape[get_family(p.site.kind).seq_dim] for p in plans}
