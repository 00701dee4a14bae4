"""Cut explain()'s GLOBAL example batch into one rank's part, with the rules shard_batch uses, on a stand-in group.

Positional tensors are cut along `seq_dim` (1 for the chunk layouts' (batch, seq, ...), 0 for packed tokens);
keyword tensors follow shard_batch's names (SEQUENCE_KEYS and `seq_keys` are cut, METADATA_KEYS and
`passthrough_keys` pass whole, any other tensor is refused rather than guessed); packed layouts' cu_seqlens (the
tensor given as `cu_seqlens=`, or the `cu_seqlens` keyword) passes whole wherever it appears, since the model
takes the GLOBAL offsets. 0-dim tensors and non-tensors pass whole.
"""

from __future__ import annotations

import torch

from ..errors import CPCompileError
from ..layouts import THD_LAYOUTS
from ..mesh import CP_LEVEL_NAMES, CPGroup, CPLevel
from ..sharding.batch import METADATA_KEYS, SEQUENCE_KEYS
from ..sharding.dense import shard_chunks
from ..sharding.packed import check_documents, model_cu_seqlens

GROUP_NAME = "cpcompile-explain"
"""The stand-in CP group's name: explain() plans for it and never creates a process group."""


def stand_in_group(rank: int, world: int, levels: tuple[int, int] | None = None) -> CPGroup:
    """CP rank `rank` of `world`; with `levels` (inter, intra) a 2-D CP mesh's, rank = inter rank * intra + intra
    rank (mesh.py)."""
    if levels is None:
        return CPGroup(group=None, name=GROUP_NAME, rank=rank, size=world)
    inter, intra = levels
    dims = (CPLevel(f"{GROUP_NAME}-{CP_LEVEL_NAMES[0]}", rank // intra, inter),
            CPLevel(f"{GROUP_NAME}-{CP_LEVEL_NAMES[1]}", rank % intra, intra))  # fmt: skip
    return CPGroup(group=None, name=GROUP_NAME, rank=rank, size=world, levels=dims)


def packed_offsets(strategy: str, cu_seqlens, kwargs: dict) -> torch.Tensor | None:
    """The global cu_seqlens of a packed strategy (cu_seqlens= or the `cu_seqlens` keyword); None otherwise."""
    if strategy not in THD_LAYOUTS:
        if cu_seqlens is not None:
            raise CPCompileError(
                f"explain(strategy={strategy!r}) got cu_seqlens=, which only the packed-document strategies use. "
                f"Fix: use strategy in {sorted(THD_LAYOUTS)} for varlen_attn models, or drop cu_seqlens=."
            )
        return None
    cu = cu_seqlens if cu_seqlens is not None else kwargs.get("cu_seqlens")
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.is_floating_point():
        raise CPCompileError(
            f"explain(strategy={strategy!r}) needs the batch's GLOBAL document offsets to cut it: pass "
            "cu_seqlens=<the 1-D integer tensor you give the model> (the same tensor object)."
        )
    return cu


def model_offsets(strategy: str, cu: torch.Tensor | None, world: int) -> torch.Tensor | None:
    """What the model takes as cu_seqlens for the example batch: the offsets, or thd_balanced's plan of them for
    `world` ranks (made, or checked as given, as shard_batch does)."""
    if cu is None or not THD_LAYOUTS[strategy].carries_plan:
        return cu
    layout = THD_LAYOUTS[strategy]
    total = int((layout.offsets(cu, world) if layout.is_plan(cu) else cu)[-1])
    return model_cu_seqlens(cu, total, strategy, world)


def _is_offsets(x: torch.Tensor, cu: torch.Tensor | None) -> bool:
    if cu is None:
        return False
    if x is cu:
        return True
    return x.shape == cu.shape and not x.is_floating_point() and x.device == cu.device and bool(torch.equal(x, cu))


def local_inputs(
    args: tuple,
    kwargs: dict,
    *,
    strategy: str,
    rank: int,
    world: int,
    seq_dim: int | None,
    cu_seqlens: torch.Tensor | None,
    seq_keys=(),
    passthrough_keys=(),
    model_cu: torch.Tensor | None = None,
) -> tuple[tuple, dict]:
    """Rank `rank`'s (args, kwargs) of the global example batch, or the sharding helpers' CPCompileError.
    `model_cu` (thd_balanced: the plan, `model_offsets`) replaces `cu_seqlens` wherever the batch holds it."""
    model_cu = cu_seqlens if model_cu is None else model_cu
    packed = strategy in THD_LAYOUTS
    dim = (0 if packed else 1) if seq_dim is None else seq_dim
    if not isinstance(dim, int) or dim < 0:
        raise CPCompileError(
            f"explain(seq_dim={seq_dim!r}): pass the non-negative index of the sequence dim of the example tensors "
            "(1 for (batch, seq, ...), 0 for packed tokens)."
        )

    def cut(x: torch.Tensor, what: str) -> torch.Tensor:
        if x.dim() <= dim:
            raise CPCompileError(
                f"explain cannot cut {what} (shape {tuple(x.shape)}): it has no sequence dim {dim}. Fix: pass "
                "seq_dim= to match the batch, or pass it by keyword and name it in passthrough_keys= (kept whole) "
                "or seq_keys= (cut)."
            )
        if not packed:
            return shard_chunks(x, strategy, dim, stand_in_group(rank, world))
        total = x.shape[dim]
        if model_cu is cu_seqlens:  # (a plan was checked when it was made)
            check_documents(cu_seqlens, total, strategy, world)
        index = THD_LAYOUTS[strategy].shard_index(model_cu.to(x.device), total, world, rank)
        return x.index_select(dim, index)

    def whole(x) -> bool:
        return not isinstance(x, torch.Tensor) or x.dim() == 0 or _is_offsets(x, cu_seqlens)

    def given(x):
        return model_cu if isinstance(x, torch.Tensor) and _is_offsets(x, cu_seqlens) else x

    out_args = tuple(given(a) if whole(a) else cut(a, f"positional argument {i}") for i, a in enumerate(args))
    seq, meta = SEQUENCE_KEYS | set(seq_keys), METADATA_KEYS | set(passthrough_keys)
    out_kwargs = {}
    for key, value in kwargs.items():
        if whole(value) or key in meta:
            out_kwargs[key] = given(value)
        elif key in seq:
            out_kwargs[key] = cut(value, f"keyword {key!r}")
        else:
            raise CPCompileError(
                f"explain does not know whether keyword {key!r} (shape {tuple(value.shape)}) is per-token. Fix: name "
                f"it in seq_keys=[{key!r}] to cut it like the tokens or passthrough_keys=[{key!r}] to keep it whole."
            )
    return out_args, out_kwargs
