"""DTensor caches one redistribute planner per (weak reference to a DeviceMesh, tensor meta), and the planner keeps
its mesh strongly: the cache's values keep every mesh a DTensor was redistributed on, and the mesh its process
groups, for the life of the process (FSDP2's DTensor parameters do this). destroy_process_group then cannot destroy
those groups, and gloo's worker threads outlive them into interpreter shutdown (cpcompile/shutdown.py).

`release_planners()` empties the cache (torch's own clear function) where torch has it; a cache rebuilt on demand,
so nothing but time is lost."""

from __future__ import annotations

TORCH_VERSIONS = ("2.13",)
"""Where the cache is known to pin its meshes (tests/unit/test_compat.py checks it on the installed torch)."""


def release_planners() -> bool:
    """Empty DTensor's redistribute planner cache; False where this torch has none."""
    try:
        from torch.distributed.tensor._redistribute import clear_redistribute_planner_cache
    except ImportError:
        return False
    clear_redistribute_planner_cache()
    return True
