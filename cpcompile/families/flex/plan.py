"""Plan a flex_attention site: check every rule, failing with one clear error; the mask geometry as constants.

The region re-calls flex_attention on this rank's q buffer against the gathered (all_gather) or exchanged (a2a)
key buffer with the global mask_mod / score_mod at GLOBAL positions and the BlockMask's rows derived from the
global one (layouts/flex.py). That needs: a dense layout, q/k/v of one local length, a BlockMask from
cpcompile.shard_block_mask for this layout, CP size and length (or none at all), and layout chunks that are whole
blocks of the mask wherever a buffer is not in global order.
"""

from __future__ import annotations

import math

import torch.fx

from ...comms.registry import comms_that, get_comm
from ...errors import site_error
from ...layouts import LAYOUTS, get_layout
from ...layouts.flex import rank_major_chunks
from ...mesh import CPGroup
from ...sharding.flex import marker_args, marker_block_size, marker_node, mask_graph
from ..auto import AUTO
from ..checks import constant, is_static
from ..plans import CPConfig
from ..site import AttentionSite
from .plan_type import FlexPlan

SEQ_DIM = 2
"""q (B, H, L, D) holds the tokens on L."""

LARGE_BLOCK = 1 << 30
"""flex_attention's block size for "no BlockMask given" (one block over everything, noop mask)."""

_SHARD_FIX = (
    "build the BlockMask once for the GLOBAL sequence (create_block_mask(mask_mod, B, H, S, S), as for one GPU) "
    "and pass cpcompile.shard_block_mask(block_mask, strategy=..., mesh=...) to the model"
)


def plan_flex_site(site: AttentionSite, config: CPConfig, group: CPGroup) -> FlexPlan:
    """Validate a flex_attention `site` against the rules of CP with this config and return its plan (or raise)."""
    node, flex = site.node, site.flex
    if config.strategy not in LAYOUTS:
        raise site_error(
            node,
            f"strategy={config.strategy!r} lays out packed documents for varlen_attn, but flex_attention attends "
            "one dense sequence",
            "use strategy='zigzag' or 'flat' and express documents in the mask_mod (cpcompile.shard_block_mask)",
        )
    if config.comm == AUTO:
        raise site_error(
            node,
            "comm='auto' chooses by the cost model, which does not cost flex_attention (its work is set by the "
            "BlockMask's blocks, which the planner does not count)",
            "name the comm for flex_attention models: comm='all_gather' or comm='a2a'",
        )
    comm = get_comm(config.comm)
    if not comm.serves("flex"):
        takes = comms_that(lambda c: c.serves("flex"))
        raise site_error(node, f"comm={config.comm!r} has no flex_attention region", f"use comm in {takes}")
    _check_shapes(site)
    (_, hq, sq, d), (_, hkv, _, _) = site.q_shape, site.k_shape
    if comm.capabilities.splits_heads:
        if problem := comm.capabilities.head_problem(hq, hkv, group.size):
            raise site_error(node, *problem)
        if flex.outputs_read - {0}:
            raise site_error(
                node,
                f"the graph reads flex_attention's logsumexp or max_scores, which comm={comm.name!r} computes for a "
                "share of the heads of every token, not for this rank's tokens",
                "use comm='all_gather' (it computes them for this rank's tokens), or do not read them",
            )
    layout = get_layout(config.strategy)
    if sq % layout.chunks_per_rank:
        raise site_error(
            node,
            f"layout {layout.name!r} splits each rank's tokens into {layout.chunks_per_rank} equal chunks, "
            f"but this rank has {sq} tokens",
            f"pad the global sequence to a multiple of {layout.required_multiple(group.size)} tokens",
        )
    masked = _check_mask(site, layout.name, group.size)
    _check_mod_buffers(site, group.size)
    marker = marker_node(mask_graph(node.graph.owning_module, flex.mask_mod))
    block_size = marker_block_size(marker) if marker is not None else tuple(int(x) for x in flex.block_size)
    if masked:
        _check_blocks(site, config.comm, layout, group.size, block_size)
    options = dict(flex.kernel_options)
    if layout.name != "flat" and options.get("BLOCKS_ARE_CONTIGUOUS"):
        options["BLOCKS_ARE_CONTIGUOUS"] = False  # a hint the layout's renumbered blocks no longer keep
    scale = float(constant(site, "scale", site.scale, (int, float))) if site.scale is not None else 1 / math.sqrt(d)
    return FlexPlan(
        site=site,
        layout=layout.name,
        comm=config.comm,
        kernel="flex",
        causal=False,
        scale=scale,
        group=group,
        masked=masked,
        block_size=block_size,
        kernel_options=options,
    )


def _check_shapes(site: AttentionSite) -> None:
    node = site.node
    for name, shape in (("query", site.q_shape), ("key", site.k_shape), ("value", site.v_shape)):
        if len(shape) != 4 or not is_static(shape[1:]):
            raise site_error(
                node,
                f"its {name} has shape {shape}; cpcompile needs static 4-D (batch, heads, seq, head_dim) inputs",
                "compile with dynamic=False and pad batches to a fixed length",
            )
    (b, _, sq, _), (bk, _, sk, _), (_, _, sv, _) = site.q_shape, site.k_shape, site.v_shape
    if sq == 0:
        raise site_error(node, "its query has 0 local tokens", "feed every rank a non-empty shard")
    if sq != sk or sk != sv or b != bk:
        raise site_error(
            node,
            f"q has {sq} local tokens (batch {b}) but k/v have {sk}/{sv} (batch {bk}); CP shards q, k and v along "
            "the same sequence",
            "use CP only for self-attention whose q, k and v come from the same sharded tokens",
        )


def _check_mask(site: AttentionSite, strategy: str, cp: int) -> bool:
    """True for a BlockMask from shard_block_mask for this layout, CP size and length; False for no mask."""
    node, flex = site.node, site.flex
    graph = mask_graph(node.graph.owning_module, flex.mask_mod)
    marker = marker_node(graph)
    if marker is None:
        if tuple(flex.block_size) == (LARGE_BLOCK, LARGE_BLOCK):
            return False  # no BlockMask: full attention (the mods still see global positions)
        raise site_error(
            node,
            f"its BlockMask (for {flex.seq_lengths[0]} x {flex.seq_lengths[1]} tokens) did not come from "
            "cpcompile.shard_block_mask, so its blocks describe this rank's tokens alone, not the sequence",
            _SHARD_FIX,
        )
    sharded, sharded_cp, seq_len = marker_args(marker)
    if seq_len == site.q_shape[2] and cp > 1:
        raise site_error(
            node,
            f"its BlockMask was built for {seq_len} tokens, this rank's LOCAL length, and then sharded, so its blocks "
            f"describe {seq_len} tokens of a sequence of {seq_len * cp}",
            _SHARD_FIX,
        )
    if (sharded, sharded_cp, seq_len) != (strategy, cp, site.q_shape[2] * cp):
        raise site_error(
            node,
            f"its BlockMask was sharded for strategy={sharded!r}, cp={sharded_cp}, {seq_len} tokens, but this site "
            f"is planned for strategy={strategy!r}, cp={cp}, {site.q_shape[2] * cp} tokens",
            "pass the backend's strategy and mesh to cpcompile.shard_block_mask, and build the mask for the global "
            "length of the batch",
        )
    if any(e is not None and e is not False for e in flex.extras):
        raise site_error(
            node,
            "its BlockMask carries dQ write-order metadata (deterministic FLASH backward), which would describe "
            "the global mask's rows, not this rank's",
            "build the mask without compute_dq_write_order / dq_kv_order",
        )
    heads = _example_shape(flex.tables[0])
    if heads is not None and heads[1] not in (1, site.q_shape[1]):
        raise site_error(
            node,
            f"its BlockMask has {heads[1]} heads, the query {site.q_shape[1]}",
            "build the mask with H=None (1) or the number of query heads",
        )
    return True


POSITIONS = {"score_mod": 3, "mask_mod": 2}
"""Where a mod's (q_idx, kv_idx) placeholders start: score_mod(score, b, h, q, kv, *buffers), mask_mod(b, h, q, kv,
*buffers)."""


def _check_mod_buffers(site: AttentionSite, cp: int) -> None:
    """A mod buffer indexed by position must be GLOBAL: the region calls the mods with global positions, so a
    tensor of this rank's tokens (document ids cut by shard_batch and kept in a module buffer, which the token
    guard does not place as it does graph inputs) would be read out of range, or at another token's entry."""
    node, flex = site.node, site.flex
    local = site.q_shape[2]
    for kind, mod, buffers in (("score_mod", flex.score_mod, flex.score_buffers),
                               ("mask_mod", flex.mask_mod, flex.mask_buffers)):  # fmt: skip
        if not buffers or not isinstance(mod, torch.fx.Node) or mod.op != "get_attr":
            continue
        placeholders = [n for n in mask_graph(node.graph.owning_module, mod).graph.nodes if n.op == "placeholder"]
        start = POSITIONS[kind]
        from_positions = set(placeholders[start : start + 2])
        for n in placeholders[0].graph.nodes:
            if n.op != "placeholder" and any(a in from_positions for a in n.all_input_nodes):
                from_positions.add(n)
        for outer, inner in zip(buffers, placeholders[len(placeholders) - len(buffers) :]):
            val = _example(outer) if isinstance(outer, torch.fx.Node) else None
            if val is None or local not in val.shape or local * cp in val.shape:
                continue
            if any(from_positions & set(user.all_input_nodes) for user in inner.users):
                raise site_error(
                    node,
                    f"its {kind} indexes the score_mod/mask_mod buffer '{outer.name}' (shape {tuple(val.shape)}) by "
                    f"position, and the buffer holds this rank's {local} tokens; the mods see GLOBAL positions "
                    f"(0..{local * cp - 1}), so it would be read out of range or at another token's entry",
                    "keep the GLOBAL tensor (e.g. the whole batch's document ids, not shard_batch's share) in the "
                    "buffer, the same on every rank",
                )


def _check_blocks(site: AttentionSite, comm: str, layout, cp: int, block_size: tuple[int, int]) -> None:
    """Chunks of a buffer that is not in global order must be whole blocks (a block then maps to a block)."""
    chunk = site.q_shape[2] // layout.chunks_per_rank
    kv_identity = rank_major_chunks(layout, cp) == list(range(layout.num_chunks(cp)))
    q_identity = kv_identity and get_comm(comm).capabilities.splits_heads  # a2a's q buffer is the key buffer
    for side, block, identity in (("q", block_size[0], q_identity), ("kv", block_size[1], kv_identity)):
        if not identity and chunk % block:
            raise site_error(
                site.node,
                f"layout {layout.name!r} cuts the sequence into chunks of {chunk} tokens, which are not whole "
                f"{side} blocks of its BlockMask (BLOCK_SIZE {block}), so this rank's rows of the mask cannot be "
                "taken block by block",
                f"make the global length a multiple of {layout.num_chunks(cp) * block} (cp x chunks x block size), "
                "or build the mask with a smaller BLOCK_SIZE that divides the chunk",
            )


def _example(node):
    return node.meta.get("example_value", node.meta.get("val")) if hasattr(node, "meta") else None


def _example_shape(node) -> tuple | None:
    val = _example(node)
    return tuple(val.shape) if val is not None else None
