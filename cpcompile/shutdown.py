"""cpcompile.destroy_process_group(): torch.distributed.destroy_process_group(), after releasing what keeps process
groups alive behind the script's back, so that it really destroys them while Python is whole.

A process group outlives destroy_process_group while anything holds it, and on gloo its worker threads then run on
into interpreter shutdown: one that frees a collective's tensor there needs the GIL, is ended by Python, and the
process aborts ("terminate called without an active exception" after a run that printed `done:`, 1 run in 7 on a
busy machine; issue 43). What holds a group after a CP run: the script's own mesh (and modules or tensors placed on
it: FSDP2), Dynamo's caches (they keep every backend, and a backend its mesh), DTensor's redistribute planners
(compat/dtensor_planners.py) and torch.distributed.nn.functional's default arguments (compat/dist_nn_defaults.py,
unpinned at `import cpcompile`). cpcompile's plans hold the group weakly (mesh.CPGroup). The script drops its own
references; this drops the rest.
"""

from __future__ import annotations

import gc

import torch
import torch.distributed as dist

from .compat.dtensor_planners import release_planners


def destroy_process_group() -> None:
    """Release Dynamo's compiled code and caches (torch.compiler.reset(): call it when the compiled model is done
    with), DTensor's planners and unreachable reference cycles, then torch.distributed.destroy_process_group().
    Drop your own mesh, backend and compiled model (and FSDP modules) first: a group still held is not destroyed."""
    torch.compiler.reset()
    release_planners()
    gc.collect()  # reference cycles (autograd graphs, FSDP's hooks and states) that still hold the group
    dist.destroy_process_group()
