"""The flex family: flex_attention (torch.ops.higher_order.flex_attention) with its score_mod, mask_mod and a
BlockMask from cpcompile.shard_block_mask, q/k/v (B, H, L, D) sharded on L by a chunk layout."""

from __future__ import annotations

from ..family import Family
from .call import FlexCall
from .match import match_flex
from .plan import SEQ_DIM, plan_flex_site

FLEX = Family(
    name="flex",
    title="flex_attention",
    match=match_flex,
    plan=plan_flex_site,
    call=FlexCall,
    seq_dim=SEQ_DIM,
    out_seq_dims=(SEQ_DIM, SEQ_DIM, SEQ_DIM),  # (out, lse, max_scores)
    offset_fields=("tables",),  # the global BlockMask's tensors
    untokened_fields=("tables", "extras", "score_buffers", "mask_buffers"),
    untokened_what="a flex_attention score_mod/mask_mod buffer",
    uncosted_note=(
        "flex_attention sites are planned but not costed (their work is set by the BlockMask's blocks): no "
        "blocks, FLOPs or estimate for them, and comm='auto' refuses them"
    ),
    overlaps=False,  # its regions issue and wait each collective before the blocks (comms/<comm>/flex.py)
    dtensor_refusal=(
        "its q/k/v are DTensors; cpcompile rewrites flex_attention on plain local tensors only",
        "feed the model plain tensors from cpcompile.shard_batch and the mask from cpcompile.shard_block_mask",
    ),
    regather_refusal=(
        "regather=True: the flex_attention region keeps its gathered K/V for backward and cannot gather again",
        "drop regather for models with flex_attention (or use per-block activation checkpointing)",
    ),
)
