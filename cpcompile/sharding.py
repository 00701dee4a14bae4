"""User-facing sharding helpers: cut a global batch into this rank's tokens, and put it back together."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
import torch.nn.functional as F

from .comm import all_gather_dim0
from .errors import CPCompileError
from .groups import resolve_group
from .layouts import ChunkLayout, get_layout
from .layouts.thd import THD_LAYOUTS
from .sharding_thd import shard_packed, unshard_packed

SEQUENCE_KEYS = frozenset(
    {
        "input_ids",
        "labels",
        "position_ids",
        "loss_mask",
        "attention_mask",
        "token_type_ids",
        "inputs_embeds",
        "target_ids",
    }
)
"""Batch entries that carry the sequence dim and are sharded like the tokens."""

METADATA_KEYS = frozenset({"num_items_in_batch", "cu_seqlens", "max_seqlen", "use_cache", "return_dict"})
"""Tensor batch entries that are not per-token and pass through unchanged."""


def _check_length(seq_len: int, layout: ChunkLayout, cp: int, what: str) -> None:
    need = layout.required_multiple(cp)
    if seq_len % need:
        pad = -seq_len % need
        raise CPCompileError(
            f"{what} has {seq_len} tokens; layout {layout.name!r} with cp={cp} needs a multiple of {need}. "
            f"Fix: pad {pad} more tokens (cpcompile.pad_to_multiple(x, {need}, dim=...), with labels padded "
            "by an ignored index) before sharding."
        )


def pad_to_multiple(x: torch.Tensor, multiple: int, dim: int, value: float = 0) -> torch.Tensor:
    """Pad `x` at the end of `dim` with `value` up to the next multiple of `multiple` (no-op when it fits).

    Use it before shard() for lengths a layout cannot take; pad labels with the loss's ignore index.
    """
    if multiple < 1:
        raise CPCompileError(f"pad_to_multiple needs multiple >= 1, got {multiple}.")
    dim = dim % x.dim()
    extra = -x.shape[dim] % multiple
    if extra == 0:
        return x
    pad = [0, 0] * (x.dim() - dim - 1) + [0, extra]
    return F.pad(x, pad, value=value)


def _packed(strategy: str, cu_seqlens, helper: str) -> bool:
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
    """
    if _packed(strategy, cu_seqlens, "shard"):
        if as_dtensor:
            raise CPCompileError(
                f"shard(strategy={strategy!r}, as_dtensor=True): packed documents are not DTensor-sharded. "
                "Fix: shard plain tensors with cu_seqlens= and pass the global cu_seqlens to the model."
            )
        return shard_packed(x, strategy=strategy, seq_dim=seq_dim, cu_seqlens=cu_seqlens, mesh=mesh, group=group)
    if as_dtensor:
        from .sharding_dtensor import local_to_dtensor

        local = shard(x, strategy=strategy, seq_dim=seq_dim, mesh=mesh, group=group)
        return local_to_dtensor(local, seq_dim % x.dim(), mesh)
    cp = resolve_group(mesh, group)
    layout = get_layout(strategy)
    seq_dim = seq_dim % x.dim()
    _check_length(x.shape[seq_dim], layout, cp.size, f"tensor of shape {tuple(x.shape)} (seq_dim={seq_dim})")
    chunk = x.shape[seq_dim] // layout.num_chunks(cp.size)
    pieces = [x.narrow(seq_dim, c * chunk, chunk) for c in layout.rank_chunks(cp.rank, cp.size)]
    return torch.cat(pieces, dim=seq_dim) if len(pieces) > 1 else pieces[0].clone()


class _Unshard(torch.autograd.Function):
    """All-gather in forward; backward keeps this rank's slice of the (replicated) gradient.

    Downstream of unshard every rank holds the same full tensor, so its gradient is the same on every rank
    (as for DTensor Shard -> Replicate): summing it across ranks would count it cp times.
    """

    @staticmethod
    def forward(ctx, x, seq_dim, layout_name, group_name, rank, world):
        layout = get_layout(layout_name)
        ctx.seq_dim, ctx.layout, ctx.rank, ctx.world = seq_dim, layout_name, rank, world
        gathered = all_gather_dim0(x.movedim(seq_dim, 0).contiguous(), group_name)
        chunk = x.shape[seq_dim] // layout.chunks_per_rank
        order = layout.unshard_chunk_order(world)
        if order != sorted(order):
            pieces = gathered.unflatten(0, (len(order), chunk))
            gathered = pieces[torch.tensor(order, device=x.device)].flatten(0, 1)
        return gathered.movedim(0, seq_dim)

    @staticmethod
    def backward(ctx, grad):
        layout = get_layout(ctx.layout)
        seq_dim = ctx.seq_dim
        chunk = grad.shape[seq_dim] // layout.num_chunks(ctx.world)
        mine = [grad.narrow(seq_dim, c * chunk, chunk) for c in layout.rank_chunks(ctx.rank, ctx.world)]
        return torch.cat(mine, dim=seq_dim), None, None, None, None, None


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
    from torch.distributed.tensor import DTensor

    if isinstance(x_local, DTensor):
        from .sharding_dtensor import dtensor_local

        x_local, seq_dim, mesh = dtensor_local(x_local, seq_dim, mesh, group)
        group = None
    if seq_dim is None:
        raise CPCompileError("unshard of a plain tensor needs seq_dim=. Fix: pass the sequence dim.")
    if _packed(strategy, cu_seqlens, "unshard"):
        return unshard_packed(
            x_local, strategy=strategy, seq_dim=seq_dim, cu_seqlens=cu_seqlens, mesh=mesh, group=group
        )
    cp = resolve_group(mesh, group)
    layout = get_layout(strategy)
    seq_dim = seq_dim % x_local.dim()
    if x_local.shape[seq_dim] % layout.chunks_per_rank:
        raise CPCompileError(
            f"unshard got {x_local.shape[seq_dim]} local tokens; layout {layout.name!r} holds "
            f"{layout.chunks_per_rank} equal chunks per rank. Fix: pass the output of cpcompile.shard."
        )
    return _Unshard.apply(x_local, seq_dim, layout.name, cp.name, cp.rank, cp.size)


def shard_batch(
    batch: Mapping[str, object],
    *,
    strategy: str,
    mesh=None,
    group=None,
    seq_dim: int = 1,
    seq_keys: Iterable[str] = (),
    passthrough_keys: Iterable[str] = (),
    cu_seqlens: torch.Tensor | None = None,
) -> dict[str, object]:
    """Shard every per-token tensor of a batch; pass metadata and non-tensors through; refuse the unknown.

    Per-token keys: SEQUENCE_KEYS plus `seq_keys`. Passed through: METADATA_KEYS plus `passthrough_keys`,
    0-dim tensors and non-tensors. Any other tensor raises, since guessing wrong silently corrupts training.
    Packed documents ("thd", "thd_zigzag"): the layout follows cu_seqlens= or else batch["cu_seqlens"], which
    stays in the batch unchanged (the model gets the GLOBAL offsets).
    """
    if strategy in THD_LAYOUTS and cu_seqlens is None:
        cu_seqlens = batch.get("cu_seqlens")
    _packed(strategy, cu_seqlens, "shard_batch")
    seq = SEQUENCE_KEYS | set(seq_keys)
    meta = METADATA_KEYS | set(passthrough_keys)
    out: dict[str, object] = {}
    for key, value in batch.items():
        if not isinstance(value, torch.Tensor) or key in meta or (value.dim() == 0 and key not in seq):
            out[key] = value
        elif key in seq:
            if value.dim() <= seq_dim % max(value.dim(), 1):
                raise CPCompileError(
                    f"batch[{key!r}] has shape {tuple(value.shape)}, with no sequence dim {seq_dim}. "
                    "Fix: pass seq_dim= to match the batch layout."
                )
            out[key] = shard(value, strategy=strategy, seq_dim=seq_dim, mesh=mesh, group=group, cu_seqlens=cu_seqlens)
        else:
            raise CPCompileError(
                f"shard_batch does not know whether batch[{key!r}] (shape {tuple(value.shape)}) is per-token. "
                f"Fix: name it in seq_keys=[{key!r}] to shard it or passthrough_keys=[{key!r}] to keep it whole."
            )
    return out
