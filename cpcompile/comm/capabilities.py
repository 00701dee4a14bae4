"""What a comm's regions can run, in one place: the packed layouts it takes, the windows, the lse, the head rule,
the block features, the overlap, the regather, each with the refusal the planner raises when a site needs what
the comm lacks.

Every comm's registry entry (comms/registry.py) holds one Capabilities. The planners (families/*/plan.py), the cost
model (cost/model.py), the backend (its Inductor patch, its regather check), explain() (through the planners) and
the bench (bench/gpu_speed.refused_by_design) read it there; nothing else lists which comm takes what.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from ..layouts import THD_LAYOUTS
from ..layouts.block import NO_WINDOW
from ..layouts.heads import head_split_problem

PackedWindows = Literal["causal_or_full", "sliding_causal", "any"]


@dataclass(frozen=True)
class Capabilities:
    """What a comm's regions take. The defaults are the all-gather's: every packed layout, causal sliding windows,
    no head split."""

    packed_layouts: tuple[str, ...] = tuple(THD_LAYOUTS)
    """The packed layouts (strategy=) its varlen region takes."""
    packed_refusals: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    """(rule broken, fix) for a packed layout it does not take, where it says why (the others get the registry's
    generic refusal: comms/registry.packed_layout_problem)."""
    packed_windows: PackedWindows = "sliding_causal"
    """The varlen_attn windows its varlen region takes besides causal (-1, 0) and full (-1, -1): "causal_or_full"
    none (hierarchical: its ring's node pieces have no window blocks yet), "sliding_causal" (w, 0) (all_gather:
    every rank's q pieces end their key ranges, so the bottom-right window is right; ring: layouts/packed_band.py
    cuts each held piece into blocks whose window is the same for every document), "any" (it attends with cp=1's
    mask after an exchange)."""
    lse_on_demand: bool = False
    """Whether the varlen region takes `return_lse` (the lse costs it a collective, sent only when read)."""
    splits_heads: bool = False
    """Whether each rank attends a share of the heads (then the head counts must split over cp, and a flex site
    must not read the lse or max scores, which it computes for a share of the heads of every token)."""
    dense_features: tuple[str, ...] = ("window", "softcap")
    """The block features (kernels.FEATURES) its dense region builds blocks for."""
    dense_refusal: tuple[str, str] | None = None
    """(rule, fix) for SDPA and flex sites when it has no dense region."""
    overlaps: bool = False
    """Whether its dense and varlen regions overlap collectives with blocks in program order (the backend then
    turns off Inductor's peak-memory reordering, which would sink the collective to its wait: backend.py)."""
    regathers: bool = False
    """Whether its regions take `regather` (keep only the local K/V for backward, gather them again there)."""
    defers_merge: bool = False
    """Whether its regions take `deferred_merge` (keep every step's partial, merge them once at the end)."""
    levels: bool = False
    """Whether it runs on the two dims of a 2-D CP mesh (mesh.CP_LEVEL_NAMES): its region takes `levels`, its
    head split is over the intra dim, and a CP group without levels is refused (`levels_problem`)."""

    def levels_problem(self, comm: str, levels: tuple[int, int] | None) -> tuple[str, str] | None:
        """(rule, fix) when the comm needs a 2-D CP mesh and the CP group has no levels, else None."""
        if not self.levels or levels is not None:
            return None
        return (
            f"comm={comm!r} runs an all-to-all inside a node and a ring across nodes, so it needs a 2-D CP mesh, "
            f"but the CP group is one flat group",
            "pass mesh=init_device_mesh(device, (nodes, ranks_a_node), mesh_dim_names=('cp_inter', 'cp_intra')) to "
            "cpcompile.backend and cpcompile.shard_batch (other dims, e.g. 'dp', may come first), or use a 1-D comm "
            "('all_gather', 'a2a', 'ring')",
        )

    def packed_window_problem(self, comm: str, window: tuple[int, int], causal: bool) -> tuple[str, str] | None:
        """(rule, fix) when the varlen region cannot take varlen_attn's window_size `window`, else None."""
        if window not in ((-1, 0), NO_WINDOW) and self.packed_windows == "causal_or_full":
            return (
                f"window_size={window}: comm={comm!r} takes causal (-1, 0) and full (-1, -1) attention of packed "
                "documents, not sliding windows",
                "use comm='ring' or 'all_gather' (causal windows (w, 0)) or comm='a2a' with strategy='thd' (any "
                "window)",
            )
        if not causal and window != NO_WINDOW and self.packed_windows != "any":
            return (
                f"window_size={window}: a sliding window that reaches right of the diagonal is not supported by the "
                f"{comm} THD region (causal (-1, 0), sliding causal (w, 0) and full (-1, -1) are)",
                "use comm='a2a' (strategy='thd') for two-sided windows, or a causal window (w, 0)",
            )
        return None

    def head_problem(
        self, q_heads: int, kv_heads: int, cp: int, levels: tuple[int, int] | None = None
    ) -> tuple[str, str] | None:
        """(rule, fix) when the comm splits heads and these do not split over its ranks (cp; a comm on `levels`:
        the intra dim's), else None."""
        if not self.splits_heads:
            return None
        if not (self.levels and levels is not None):
            return head_split_problem(q_heads, kv_heads, cp)
        intra = levels[1]
        if head_split_problem(q_heads, kv_heads, intra) is None:
            return None
        return (
            f"comm='hierarchical' splits the heads over the {intra} ranks of a node (the 'cp_intra' dim): q heads "
            f"({q_heads}) must divide by {intra}, and kv heads ({kv_heads}) must divide by {intra} or {intra} by "
            "them",
            "use a 'cp_intra' size that divides the head counts (a smaller node dim, a larger 'cp_inter'), or a 1-D "
            "comm ('all_gather', 'ring') on the same mesh",
        )
