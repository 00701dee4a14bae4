"""Flattening two dims of a DeviceMesh into one process group: `DeviceMesh._flatten`, a private method on every
torch cpcompile supports (2.11 to 2.14.1). It creates the flattened group once per mesh (collectively, on every
rank of the mesh) and returns the cached one afterwards; the flattened rank is the row-major index over the dims.
"""

from __future__ import annotations

import torch.distributed as dist

TORCH_VERSIONS = ("2.11", "2.12", "2.13", "2.14")
"""The torch releases whose DeviceMesh has `_flatten` (tests/unit/test_compat.py checks the installed one)."""


def flatten_dims(mesh, names: tuple[str, ...]) -> dist.ProcessGroup:
    """The process group of `mesh`'s dims `names` flattened (rank = row-major index over those dims)."""
    return mesh[names]._flatten().get_group()
