"""shard_block_mask: what a rank's model receives for a FlexAttention BlockMask built for the whole sequence.

Dynamo checks a BlockMask's lengths against q and k while tracing (`block_mask was created for ... but got
q_len=...`), so a rank's model cannot take the global mask as it is. It takes a copy whose lengths are the
local ones and whose tensors are still the GLOBAL mask's (its q-block rows for every token, its kv blocks for
every key): the cpcompile pass derives each rank's rows from them inside the region, for the layout and comm it
plans. The copy's mask_mod is the global one behind a marker op (`cpcompile::flex_sharded_mask`), which
- tells the pass that the tensors are global and for which layout, CP size and length they were sharded, so a
  mask built for the local length (whose blocks would be silently wrong) is refused instead;
- raises if anything runs the mask_mod outside a cpcompile region (eager flex_attention on a rank's tokens would
  attend to them alone).
The pass strips the marker and calls the global mask_mod (and score_mod) with GLOBAL positions.
"""

from __future__ import annotations

import copy

import torch
import torch.fx

from ..errors import CPCompileError
from ..graph.region_call import schema_bound
from ..layouts import THD_LAYOUTS, get_layout
from ..mesh import resolve_group


@torch.library.custom_op("cpcompile::flex_sharded_mask", mutates_args=())
def flex_sharded_mask(
    q_idx: torch.Tensor, strategy: str, cp: int, seq_len: int, q_block: int, kv_block: int
) -> torch.Tensor:
    """The marker in a sharded BlockMask's mask_mod: never runs, only the compiled graph carries it."""
    raise CPCompileError(
        f"a BlockMask from cpcompile.shard_block_mask (strategy={strategy!r}, cp={cp}, {seq_len} tokens) was "
        "evaluated outside a cpcompile region: its tensors describe the whole sequence and only the compiled "
        "model's CP region can apply them. Fix: call flex_attention inside the model compiled with "
        "cpcompile.backend(...) (no graph break around it); for one device, use the global BlockMask itself."
    )


@flex_sharded_mask.register_fake
def _(q_idx, strategy, cp, seq_len, q_block, kv_block):
    return torch.empty_like(q_idx)


MARKERS = frozenset({torch.ops.cpcompile.flex_sharded_mask, torch.ops.cpcompile.flex_sharded_mask.default})


def shard_block_mask(block_mask, *, strategy: str, mesh=None, group=None):
    """This rank's BlockMask, from `block_mask` built once for the global sequence (as for one GPU).

    The result has the local q/kv lengths Dynamo checks, the global mask's tensors, and its mask_mod behind a
    marker; pass it to the model compiled with cpcompile.backend(strategy=..., mesh=...) together with the
    tensors of cpcompile.shard_batch. It is the same on every rank. mask_mod and score_mod see GLOBAL positions
    there, so any mask written for one GPU stays right; tensors they index must be global too (not sharded).
    """
    from torch.nn.attention.flex_attention import BlockMask

    if not isinstance(block_mask, BlockMask):
        raise CPCompileError(
            f"shard_block_mask takes a torch.nn.attention.flex_attention.BlockMask, got {type(block_mask).__name__}. "
            "Fix: build it with create_block_mask(mask_mod, B, H, S, S) for the global sequence length S."
        )
    if getattr(block_mask.mask_mod, "cpcompile_sharded", None) is not None:
        raise CPCompileError(
            "shard_block_mask got a BlockMask that shard_block_mask made already. Fix: shard the global mask once."
        )
    if strategy in THD_LAYOUTS:
        raise CPCompileError(
            f"shard_block_mask(strategy={strategy!r}): FlexAttention sites take the dense layouts 'flat' and "
            "'zigzag'. Fix: express documents in the mask_mod over one dense sequence with strategy='zigzag' "
            "(or 'flat'), or call varlen_attn for packed documents."
        )
    layout = get_layout(strategy)
    cp = resolve_group(mesh, group).size
    q_len, kv_len = block_mask.seq_lengths
    if q_len != kv_len:
        raise CPCompileError(
            f"shard_block_mask got a BlockMask for {q_len} queries and {kv_len} keys; CP shards q, k and v along "
            "one sequence. Fix: build the mask for self-attention, create_block_mask(mask_mod, B, H, S, S)."
        )
    need = layout.required_multiple(cp)
    if q_len % need:
        raise CPCompileError(
            f"shard_block_mask got a BlockMask for {q_len} tokens; layout {strategy!r} with cp={cp} needs a multiple "
            f"of {need}. Fix: pad the sequence (cpcompile.pad_to_multiple) and build the mask for the padded length."
        )
    sharded = copy.copy(block_mask)
    sharded.seq_lengths = (q_len // cp, kv_len // cp)
    q_block, kv_block = (int(b) for b in block_mask.BLOCK_SIZE)
    sharded.mask_mod = _marked(block_mask.mask_mod, strategy, cp, q_len, q_block, kv_block)
    sharded.BLOCK_SIZE = (NO_LENGTH_CHECK, NO_LENGTH_CHECK)
    return sharded


NO_LENGTH_CHECK = 1 << 30
"""flex_attention's block size for "no mask" (torch's _LARGE_SPARSE_BLOCK_SIZE), for which it skips its check of
the mask's lengths against q and k. A sharded mask carries it so that a mask built for the LOCAL length reaches
the planner, which refuses it by name (its marker's length is not cp x the local one), instead of failing inside
Dynamo as an "Unsupported" ValueError; its real block size travels in the marker."""


def _marked(mask_mod, strategy: str, cp: int, seq_len: int, q_block: int, kv_block: int):
    def sharded_mask_mod(b, h, q_idx, kv_idx):
        return mask_mod(b, h, flex_sharded_mask(q_idx, strategy, cp, seq_len, q_block, kv_block), kv_idx)

    sharded_mask_mod.cpcompile_sharded = (strategy, cp, seq_len)
    return sharded_mask_mod


def marker_node(mask_graph: torch.fx.GraphModule) -> torch.fx.Node | None:
    """The marker call in a traced mask_mod graph, or None (the mask did not come from shard_block_mask)."""
    found = [n for n in mask_graph.graph.nodes if n.op == "call_function" and n.target in MARKERS]
    return found[0] if found else None


def _marker_bound(node: torch.fx.Node) -> dict:
    return schema_bound(node, torch.ops.cpcompile.flex_sharded_mask.default._schema)


def marker_args(node: torch.fx.Node) -> tuple[str, int, int]:
    """(strategy, cp, global length) the mask was sharded for."""
    bound = _marker_bound(node)
    return bound["strategy"], bound["cp"], bound["seq_len"]


def marker_block_size(node: torch.fx.Node) -> tuple[int, int]:
    """The sharded mask's real (q, kv) block size (its BlockMask carries NO_LENGTH_CHECK's)."""
    bound = _marker_bound(node)
    return int(bound["q_block"]), int(bound["kv_block"])


def mask_graph(gm: torch.fx.GraphModule, node: torch.fx.Node) -> torch.fx.GraphModule:
    """The traced mask_mod GraphModule a flex_attention call's get_attr operand names."""
    return getattr(gm, str(node.target))


def strip_marker(gm: torch.fx.GraphModule, node: torch.fx.Node) -> None:
    """Remove the marker from the traced mask_mod graph `node` names (in place; idempotent, as layers may share
    one graph): it becomes the global mask_mod of global positions, which the region calls."""
    graph = mask_graph(gm, node)
    for n in list(graph.graph.nodes):
        if n.op == "call_function" and n.target in MARKERS:
            n.replace_all_uses_with(_marker_bound(n)["q_idx"])
            graph.graph.erase_node(n)
    graph.recompile()
