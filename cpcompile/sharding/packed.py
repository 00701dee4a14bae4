"""Sharding helpers for packed documents (thd, thd_zigzag, thd_balanced): cu_seqlens-aware shard/unshard,
the per-batch plan (thd_balanced) and padding.

These run in the user's data pipeline, so they may read cu_seqlens on the host to check the document rules
and raise a clear CPCompileError (the compiled region cannot: it never syncs). unshard stays on device, except
that thd_balanced reads (or plans) cu_seqlens on the host first.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..comm.collectives import all_gather_dim0
from ..errors import CPCompileError
from ..layouts.thd import THD_LAYOUTS, get_packed_layout
from ..mesh import resolve_group
from .dims import checked_dim


def _describe(cu) -> str:
    if isinstance(cu, torch.Tensor):
        return f"a {cu.dim()}-D {cu.dtype} tensor of shape {tuple(cu.shape)}"
    return f"{type(cu).__name__} {cu!r}"[:120]


def _need_cu(cu_seqlens, strategy: str, helper: str) -> torch.Tensor:
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point():
        raise CPCompileError(
            f"{helper}(strategy={strategy!r}) needs cu_seqlens= (the global document offsets, a 1-D integer "
            f"tensor), got {_describe(cu_seqlens)}. Fix: pass cu_seqlens=<the batch's cu_seqlens> as a 1-D "
            "int32/int64 tensor (torch.tensor(offsets, dtype=torch.int32))."
        )
    return cu_seqlens


def check_documents(cu_seqlens: torch.Tensor, total: int, strategy: str, cp: int) -> None:
    """Raise CPCompileError when `cu_seqlens` and the packed length break the rules of `strategy` (host check)."""
    layout = get_packed_layout(strategy)
    offsets = cu_seqlens.tolist()
    reason = layout.document_error(offsets, total, cp)
    if reason is None:
        return
    if not (offsets and offsets[0] == 0 and offsets[-1] == total and offsets == sorted(offsets)):
        fix = (
            f"pass the batch's own GLOBAL document offsets: from 0, non-decreasing, ending at the packed length "
            f"{total} of the tensor being sharded (padding at the end is one more document: "
            "cpcompile.pad_cu_seqlens(cu_seqlens, padded_length))"
        )
    elif layout.doc_multiple_per_cp:
        fix = (
            f"pad every document to a multiple of {layout.doc_multiple_per_cp * cp} tokens "
            f"(cpcompile.pad_documents(x, cu_seqlens, {layout.doc_multiple_per_cp * cp}, dim=...)), or use "
            "strategy='thd', which takes documents of any length"
        )
    else:
        fix = (
            f"pad the packed buffer to a multiple of {layout.required_multiple(cp)} tokens "
            f"(cpcompile.pad_to_multiple(x, {layout.required_multiple(cp)}, dim=...)) and append the padding "
            "as one more document (cpcompile.pad_cu_seqlens(cu_seqlens, padded_length))"
        )
    raise CPCompileError(f"cannot shard packed documents: {reason}. Fix: {fix}.")


def model_cu_seqlens(cu_seqlens: torch.Tensor, total: int, strategy: str, cp: int) -> torch.Tensor:
    """The cu_seqlens the compiled model and the index math take, checked on the host: the offsets themselves,
    or for a layout with a per-batch plan (thd_balanced) the plan, made from plain offsets or checked as given."""
    layout = get_packed_layout(strategy)
    if layout.is_plan(cu_seqlens):
        return layout.prepare(cu_seqlens, total, cp)
    check_documents(cu_seqlens, total, strategy, cp)
    return layout.prepare(cu_seqlens, total, cp)


def plan_documents(cu_seqlens, *, strategy: str, mesh=None, group=None) -> torch.Tensor:
    """The cu_seqlens to pass to the compiled model for this batch under `strategy`: the GLOBAL offsets as they
    are for thd / thd_zigzag; for thd_balanced the offsets plus this batch's plan (which pieces of which
    documents each rank owns), a longer tensor of the same dtype that shard/unshard also take. shard_batch
    calls this and puts the result in batch["cu_seqlens"]."""
    if strategy not in THD_LAYOUTS:
        raise CPCompileError(
            f"plan_documents(strategy={strategy!r}) is for packed documents. "
            f"Fix: use strategy in {sorted(THD_LAYOUTS)}."
        )
    cp = resolve_group(mesh, group)
    cu = _need_cu(cu_seqlens, strategy, "plan_documents")
    layout = get_packed_layout(strategy)
    offsets = layout.offsets(cu, cp.size) if layout.is_plan(cu) else cu
    return model_cu_seqlens(cu, int(offsets[-1]) if offsets.numel() else 0, strategy, cp.size)


def shard_packed(x: torch.Tensor, *, strategy: str, seq_dim: int, cu_seqlens, mesh=None, group=None) -> torch.Tensor:
    """This rank's tokens of the packed tensor `x` under a THD layout (a new tensor)."""
    cp = resolve_group(mesh, group)
    cu = _need_cu(cu_seqlens, strategy, "shard")
    seq_dim = checked_dim(x, seq_dim, "shard")
    total = x.shape[seq_dim]
    cu = model_cu_seqlens(cu, total, strategy, cp.size)
    index = get_packed_layout(strategy).shard_index(cu.to(x.device), total, cp.size, cp.rank)
    return x.index_select(seq_dim, index)


class _UnshardPacked(torch.autograd.Function):
    """All-gather, then put the tokens in packed (global) order; backward keeps this rank's tokens."""

    @staticmethod
    def forward(ctx, x, cu, seq_dim, strategy, group_name, rank, world):
        layout = get_packed_layout(strategy)
        total = x.shape[seq_dim] * world
        gathered = all_gather_dim0(x.movedim(seq_dim, 0), group_name)
        where = torch.cat([layout.shard_index(cu, total, world, p) for p in range(world)])
        order = torch.empty_like(where).scatter_(0, where, torch.arange(total, device=where.device))
        ctx.seq_dim, ctx.index = seq_dim, layout.shard_index(cu, total, world, rank)
        return gathered.index_select(0, order).movedim(0, seq_dim)

    @staticmethod
    def backward(ctx, grad):
        return grad.index_select(ctx.seq_dim, ctx.index), None, None, None, None, None, None


def unshard_packed(x_local: torch.Tensor, *, strategy: str, seq_dim: int, cu_seqlens, mesh=None, group=None):
    """The packed tensor in global order on every rank, from each rank's local tokens (differentiable)."""
    cp = resolve_group(mesh, group)
    cu = _need_cu(cu_seqlens, strategy, "unshard")
    seq_dim = checked_dim(x_local, seq_dim, "unshard")
    if get_packed_layout(strategy).carries_plan:  # the plan, read or made on the host
        cu = model_cu_seqlens(cu, x_local.shape[seq_dim] * cp.size, strategy, cp.size)
    cu = cu.to(x_local.device).long()
    return _UnshardPacked.apply(x_local, cu, seq_dim, strategy, cp.name, cp.rank, cp.size)


def pad_cu_seqlens(cu_seqlens, total: int, length: int | None = None) -> torch.Tensor:
    """cu_seqlens for a packed buffer padded to `total` tokens: the padding becomes one more document.

    With `length`, also repeat the last offset (empty documents) up to `length` entries, so that cu_seqlens
    keeps one shape across batches and the compiled model never recompiles for a new number of documents.
    `cu_seqlens` may be a 1-D integer tensor or a list of offsets (then an int32 tensor is returned).
    """
    if isinstance(cu_seqlens, (list, tuple)):
        cu_seqlens = torch.tensor(cu_seqlens, dtype=torch.int32)
    if (
        not isinstance(cu_seqlens, torch.Tensor)
        or cu_seqlens.dim() != 1
        or cu_seqlens.numel() == 0
        or cu_seqlens.is_floating_point()
    ):
        raise CPCompileError(
            f"pad_cu_seqlens needs the document offsets as a non-empty 1-D integer tensor or a list of ints, got "
            f"{_describe(cu_seqlens)}. Fix: pass torch.tensor(offsets, dtype=torch.int32)."
        )
    last = int(cu_seqlens[-1])
    if total < last:
        raise CPCompileError(f"pad_cu_seqlens: total={total} is shorter than the documents ({last} tokens).")
    out = torch.cat((cu_seqlens, cu_seqlens.new_tensor([total]))) if total > last else cu_seqlens
    if length is not None:
        if length < out.numel():
            raise CPCompileError(
                f"pad_cu_seqlens: cu_seqlens needs {out.numel()} entries, more than length={length}. "
                "Fix: pass a larger length (the most documents a batch can hold, plus 2)."
            )
        out = torch.cat((out, out.new_full((length - out.numel(),), total)))
    return out


def pad_documents(
    x: torch.Tensor, cu_seqlens: torch.Tensor, multiple: int, dim: int, value: float = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad every document of the packed `x` at its end to a multiple of `multiple` tokens (for thd_zigzag).

    Returns (padded x, its cu_seqlens). Under causal attention real tokens never see the padding after them;
    pad labels with the loss's ignore index. For non-causal attention prefer strategy='thd' (no padding).
    """
    dim = checked_dim(x, dim, "pad_documents", "dim")
    cu_seqlens = _need_cu(cu_seqlens, "thd_zigzag", "pad_documents")
    if not isinstance(multiple, int) or multiple < 1:
        raise CPCompileError(f"pad_documents needs an integer multiple >= 1, got {multiple!r}.")
    bounds = cu_seqlens.tolist()
    if not bounds or bounds[0] != 0 or bounds[-1] != x.shape[dim] or bounds != sorted(bounds):
        raise CPCompileError(
            f"pad_documents: cu_seqlens must start at 0, never decrease and end at x.shape[{dim}]={x.shape[dim]} "
            f"(every token in a document; tokens past the last offset would be dropped), got "
            f"{bounds[:8]}{'...' if len(bounds) > 8 else ''}. Fix: pass the offsets of x's documents, with any "
            "trailing padding as one more document (cpcompile.pad_cu_seqlens(cu_seqlens, x.shape[dim]))."
        )
    pieces, new_cu = [], [0]
    for a, b in zip(bounds, bounds[1:]):
        piece = x.narrow(dim, a, b - a)
        extra = -(b - a) % multiple
        if extra:
            piece = F.pad(piece, [0, 0] * (x.dim() - dim - 1) + [0, extra], value=value)
        pieces.append(piece)
        new_cu.append(new_cu[-1] + b - a + extra)
    return torch.cat(pieces, dim=dim), cu_seqlens.new_tensor(new_cu)


__all__ = [
    "check_documents",
    "model_cu_seqlens",
    "pad_cu_seqlens",
    "pad_documents",
    "plan_documents",
    "shard_packed",
    "unshard_packed",
]
