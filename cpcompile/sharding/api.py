"""shard / unshard: one entry for every layout (chunk, packed) and for DTensors; the layout modules do the work."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from ..errors import CPCompileError
from ..layouts import THD_LAYOUTS
from ..mesh import resolve_group
from ..token_marks import mark_sharded
from .dense import shard_chunks, unshard_chunks
from .dims import checked_dim
from .dtensor import dtensor_local, local_to_dtensor
from .packed import shard_packed, unshard_packed


def is_packed(strategy: str, cu_seqlens, helper: str) -> bool:
    """Whether `strategy` is a packed-document layout (which needs cu_seqlens); refuse cu_seqlens otherwise."""
    if strategy in THD_LAYOUTS:
        return True
    if cu_seqlens is not None:
        raise CPCompileError(
            f"{helper}(strategy={strategy!r}) got cu_seqlens=, which only the packed-document strategies use. "
            f"Fix: use strategy in {sorted(THD_LAYOUTS)} for packed documents, or drop cu_seqlens=."
        )
    return False


def shard(
    x: torch.Tensor,
    *,
    strategy: str,
    seq_dim: int,
    mesh=None,
    group=None,
    as_dtensor: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """This rank's tokens of the global tensor `x`, in the layout's local order (a new tensor).

    as_dtensor=True wraps them as a DTensor on `mesh`, Shard(seq_dim) on its CP dim (for "flat" this equals
    distribute_tensor(x, mesh, [Shard(seq_dim)])); such DTensors can be fed to a model compiled with the backend.
    Packed documents (strategy "thd" / "thd_zigzag") also need cu_seqlens=, the global document offsets.
    The result is marked (token_marks.py) with its token dim, layout and CP size: a compiled graph with no
    attention fed it knows where its tokens are, and one compiled for another layout refuses it.
    """
    seq_dim = checked_dim(x, seq_dim, "shard")
    if is_packed(strategy, cu_seqlens, "shard"):
        if as_dtensor:
            raise CPCompileError(
                f"shard(strategy={strategy!r}, as_dtensor=True): packed documents are not DTensor-sharded. "
                "Fix: shard plain tensors with cu_seqlens= and pass the global cu_seqlens to the model."
            )
        local = shard_packed(x, strategy=strategy, seq_dim=seq_dim, cu_seqlens=cu_seqlens, mesh=mesh, group=group)
        return mark_sharded(local, seq_dim, strategy, resolve_group(mesh, group).size)
    if as_dtensor:
        local = shard(x, strategy=strategy, seq_dim=seq_dim, mesh=mesh, group=group)
        return local_to_dtensor(local, seq_dim, mesh)
    cp = resolve_group(mesh, group)
    return mark_sharded(shard_chunks(x, strategy, seq_dim, cp), seq_dim, strategy, cp.size)


def unshard(
    x_local: torch.Tensor,
    *,
    strategy: str,
    seq_dim: int | None = None,
    mesh=None,
    group=None,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """The full sequence in global order on every rank, from each rank's local tokens (differentiable).

    `x_local` may be a DTensor sharded over a CP mesh dim: mesh and seq_dim then come from its placement, and
    for "flat" the result equals x_local.full_tensor() (as a plain tensor; other mesh dims stay local).
    Packed documents (strategy "thd" / "thd_zigzag") also need cu_seqlens=, the global document offsets.
    """
    if isinstance(x_local, DTensor):
        x_local, seq_dim, mesh = dtensor_local(x_local, seq_dim, mesh, group)
        group = None
    if seq_dim is None:
        raise CPCompileError("unshard of a plain tensor needs seq_dim=. Fix: pass the sequence dim.")
    seq_dim = checked_dim(x_local, seq_dim, "unshard")
    if is_packed(strategy, cu_seqlens, "unshard"):
        return unshard_packed(
            x_local, strategy=strategy, seq_dim=seq_dim, cu_seqlens=cu_seqlens, mesh=mesh, group=group
        )
    return unshard_chunks(x_local, strategy, seq_dim, resolve_group(mesh, group))
