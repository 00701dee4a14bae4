"""explain()'s note for comm="selective" (its Comm.batch_note): the static slots a rank receives, against what the
example batch's ranks actually read of their peers' K/V (schedule.py's selection, on the host)."""

from __future__ import annotations

import torch

from ...comm.wire import WireShape, format_bytes
from ...layouts import THD_LAYOUTS
from .schedule import capacity, select, select_thd


def batch_note(wire: WireShape, documents: torch.Tensor) -> str:
    """What the region moves for this batch (`documents`: GLOBAL cu_seqlens, or thd_balanced's plan): the slots
    C a peer, what each rank's queries read, and whether the batch fits C."""
    layout, causal, _ = wire.packed_mask
    local, world = wire.tokens, wire.world
    cap = capacity(local, wire.max_doc)
    pick = select if THD_LAYOUTS[layout].carries_plan else select_thd
    need = pick(documents.cpu(), local, world, 0, causal, cap).need
    token = wire.kv_heads * (wire.head_dim + wire.v_head_dim) * wire.elt
    read = ", ".join(format_bytes(int(n) * token) for n in need.sum(1))
    fits = "within" if int(need.max()) <= cap else "MORE than (the region's check fails this batch)"
    slots, gather = format_bytes((world - 1) * cap * token), format_bytes((world - 1) * local * token)
    return (
        f"comm='selective' receives {world - 1} x C={cap} K/V token slots a rank ({slots}, the all-gather {gather}); "
        f"this batch's ranks read {read} of their peers' K/V, at most {int(need.max())} tokens from one peer, {fits} C"
    )
