"""FlexArgs: what a flex_attention site carries beyond q/k/v (its own module, so that the generic AttentionSite
(families/site.py) can name it while the flex matcher (match.py) builds sites)."""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx


@dataclass(frozen=True)
class FlexArgs:
    """The non-q/k/v operands of a flex_attention call, as Dynamo records them (the BlockMask flattened:
    (q_len, kv_len, 8 block tensors, torch 2.13's optional dQ-order metadata, Q_BLOCK, KV_BLOCK, mask_mod))."""

    score_mod: torch.fx.Node
    mask_mod: torch.fx.Node
    seq_lengths: tuple
    tables: tuple
    """kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, q_num_blocks, q_indices, full_q_*."""
    extras: tuple
    """What torch adds between the tables and the block sizes (2.13: dq_write_order, ...; 2.11: nothing)."""
    block_size: tuple
    kernel_options: dict
    score_buffers: tuple
    mask_buffers: tuple
    outputs_read: frozenset
    """Which of the call's outputs (0 out, 1 lse, 2 max_scores) the graph reads."""
