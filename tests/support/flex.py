"""FlexAttention test helpers: the masks and score_mods of the parity tests, and torch's CPU backward gate lifted.

torch's flex_attention refuses `requires_grad` inputs on CPU in its Python API (`_validate_device`: Inductor has no
CPU backward kernel), although the higher-order op's eager forward and backward (dense math) run there. The
tests lift that gate for the single-process reference and the CP run alike, so both go through the same op.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.attention.flex_attention as flex_module
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

SEQ = 64
BLOCK = 8


@contextlib.contextmanager
def cpu_flex_backward():
    """flex_attention with requires_grad CPU tensors (eager and traced) for the duration of the block."""
    original = flex_module._validate_device
    flex_module._validate_device = lambda query, key, value: None
    try:
        yield
    finally:
        flex_module._validate_device = original


def mask_and_score(kind: str, heads: int, seq: int = SEQ):
    """(mask_mod, score_mod, buffers needing grad, block-mask heads) of a named case; GLOBAL positions throughout."""
    docs = torch.tensor([0] * (seq // 4 + 3) + [1] * (seq // 2 - 5) + [2] * (seq - seq // 4 - seq // 2 + 2))
    slopes = torch.tensor([2.0 ** -(i + 1) for i in range(heads)], dtype=torch.float64, requires_grad=True)
    prefix = torch.tensor([5 + 7 * i for i in range(heads)])
    if kind == "causal_alibi":
        return (lambda b, h, q, k: q >= k), (lambda s, b, h, q, k: s - slopes[h] * (q - k)), [slopes], None
    if kind == "window":
        return (lambda b, h, q, k: (q >= k) & (q - k <= 9)), None, [], None
    if kind == "document":
        return (lambda b, h, q, k: (docs[q] == docs[k]) & (q >= k)), None, [], None
    if kind == "prefix_softcap":  # a per-head prefix: the mask has a head dim
        return (lambda b, h, q, k: (k < prefix[h]) | (q >= k)), (lambda s, b, h, q, k: 2 * torch.tanh(s / 2)), [], heads
    if kind == "full":
        return None, None, [], None
    raise ValueError(kind)


def block_mask(kind: str, batch: int, heads: int, seq: int = SEQ):
    mask_mod, _, _, mask_heads = mask_and_score(kind, heads, seq)
    if mask_mod is None:
        return None
    return create_block_mask(mask_mod, batch, mask_heads, seq, seq, device="cpu", BLOCK_SIZE=BLOCK)


def attention(score_mod):
    def attn(q, k, v, block_mask):
        return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=True)

    return attn
