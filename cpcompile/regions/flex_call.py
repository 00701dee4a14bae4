"""ONE flex_attention call at global positions, shared by the flex regions (comms/all_gather/flex.py gathers K/V,
comms/a2a/flex.py exchanges heads for sequence first).

FlexAttention applies any mask as a block table plus a mask_mod, so a permuted key buffer costs nothing: the
rank's q buffer attends the key buffer in the order the collective delivered it (rank-major local orders, no
reorder copy), with
- the user's mask_mod and score_mod called at the GLOBAL positions of the buffers' tokens (and global head
  index under a2a), so a mask written for one GPU stays right (layouts.flex.Positions);
- the BlockMask's tensors derived from the global mask's on device: the q buffer's rows, kv blocks renumbered
  into the key buffer's order, and the q tables flex's backward reads (layouts.flex.derive_tables). kv blocks
  the rank's rows never list are never computed.
The call is the flex_attention higher-order op itself, so aot_autograd records flex's own forward and backward
(with the final logsumexp: one call over all keys needs no merge) and Inductor compiles them with its flex
kernels, fusing the mods in; the collectives around it carry their own autograd.
"""

from __future__ import annotations

import torch

from ..layouts.flex import Positions, derive_tables


def _wrap(mod, q: Positions, kv: Positions, head_offset: int, score: bool):
    """The user's mod at global positions; the lookup tables (when a buffer is not one run) come first among the
    mod's buffers: (tables..., user buffers...)."""
    n_tables = (q.offset is None) + (kv.offset is None)

    def call(*args):
        lead, rest = (args[:5], args[5:]) if score else (args[:4], args[4:])
        tables, user = list(rest[:n_tables]), rest[n_tables:]
        qt = tables.pop(0) if q.offset is None else None
        kt = tables.pop(0) if kv.offset is None else None
        *head, b, h, qi, ki = lead
        h = h + head_offset if head_offset else h
        return mod(*head, b, h, q.apply(qi, qt), kv.apply(ki, kt), *user)

    return call


def flex_call(q, k, v, score_mod, mask_mod, tables, extras, score_buffers, mask_buffers, qpos, kvpos, *, plan):
    """One flex_attention call of q against the key buffer at global positions; (out, lse, max_scores)."""
    scale, kernel_options, block_size, masked, heads = plan
    if masked:
        tables = derive_tables(tuple(tables), qpos, kvpos, block_size, heads)
    pos_tables = tuple(p.table(q.device) for p in (qpos, kvpos) if p.offset is None)
    head_offset = heads[0] if heads is not None else 0
    mask = (q.shape[-2], k.shape[-2], *tables, *extras, *block_size, _wrap(mask_mod, qpos, kvpos, head_offset, False))
    return torch.ops.higher_order.flex_attention(
        q,
        k,
        v,
        _wrap(score_mod, qpos, kvpos, head_offset, True),
        mask,
        scale,
        dict(kernel_options),
        (*pos_tables, *score_buffers),
        (*pos_tables, *mask_buffers),
    )
