"""torchtitan under cpcompile: shard a torchtitan batch for its decoder models (Llama3 and the other `Decoder`s).

torchtitan's own CP takes FlexAttention only, so packed documents (its VarlenAttention) have no CP there. Under
cpcompile they do, but the batch must be what the rewritten attention expects, and getting that wrong by hand
is silent: RoPE needs the GLOBAL positions (with `positions=None` it uses each rank's local 0..L/cp-1), and the
varlen metadata must describe the GLOBAL packed buffer (torchtitan's `get_attention_masks` on a rank's local
positions builds local offsets; the run-time packed check then fails every rank). `shard_batch` builds all of
it from the global batch, on the host, in the data pipeline:

    batch = shard_batch(model, tokens, labels, positions, strategy="thd", mesh=mesh)
    logits = compiled(**batch.inputs)          # tokens=, positions=, attention_masks=
    loss = token_loss_sum(logits, batch.labels) / batch.num_tokens

Packed documents: cu_seqlens is padded to a fixed length and max_q/max_k are a fixed bound, so new documents
never recompile. torchtitan is imported only when a function here needs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import CPCompileError
from ..layouts import LAYOUTS, THD_LAYOUTS, get_layout, get_packed_layout
from ..mesh import resolve_group
from ..sharding import pad_cu_seqlens, pad_documents, shard
from ..token_local import mark_token_local

ATTENTION_STRATEGIES = {"sdpa": tuple(LAYOUTS), "varlen": tuple(THD_LAYOUTS)}
"""torchtitan inner attention -> the strategies that rewrite it: ScaledDotProductAttention (causal over each
row) takes the chunk layouts, VarlenAttention (packed documents) the packed ones."""


@dataclass
class GlobalBatch:
    """The padded global batch every rank starts from (before sharding)."""

    tokens: torch.Tensor
    """(B, L') for SDPA; (1, T) for packed documents: the rows flattened into one packed buffer, which is what
    VarlenAttention's reshape of (B, L) to (B*L) tokens sees."""
    labels: torch.Tensor
    positions: torch.Tensor
    cu_seqlens: torch.Tensor | None
    """packed: global document offsets into the flattened buffer, padded to max_documents + 2 entries."""
    max_seqlen: int | None
    """packed: max_q/max_k, a bound fixed by the shapes (not the batch's longest document)."""
    padding: int
    """tokens of padding added (pad_id, position 0, label ignore_index)."""
    num_tokens: int
    """labels that count (not ignore_index), over the whole global batch: divide the summed loss by it."""


@dataclass
class TitanBatch:
    """This rank's part: `model(**inputs)`, the loss on `labels`, normalised by the global `num_tokens`."""

    inputs: dict[str, Any]
    labels: torch.Tensor
    num_tokens: int
    padding: int


def _torchtitan_attention_classes() -> dict[str, type]:
    try:
        from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention, VarlenAttention
    except ImportError as e:
        raise CPCompileError(
            f"cpcompile.integrations.torchtitan needs torchtitan (import failed: {e}). Fix: pip install torchtitan; "
            "on a machine without a GPU it also needs triton, which torchtitan's expert-parallel module imports."
        ) from e
    return {"sdpa": ScaledDotProductAttention, "varlen": VarlenAttention, "flex": FlexAttention}


_ROPE_MARKED = False


def _mark_rope_token_local() -> None:
    """torchtitan's RoPE looks its cache up at each token's position (`cache[positions]`, an aten.index by a
    sequence-sharded tensor), which DTensor has no sharding rule for, so the token guard cannot tell that it is
    token-local and refuses it. It is token-local (each token reads the cache row of its own position): mark it,
    once. A torchtitan without that function is left to the guard, which then refuses rather than guesses."""
    global _ROPE_MARKED
    if _ROPE_MARKED:
        return
    from torchtitan.models.common import rope

    lookup = getattr(rope, "_reshape_for_broadcast", None)
    if lookup is not None:
        mark_token_local(lookup)
    _ROPE_MARKED = True


def check_model(model: torch.nn.Module) -> str:
    """The torchtitan inner attention every layer of `model` uses (compiled or not): "sdpa" or "varlen".

    FlexAttention (torchtitan's default, attn_backend="flex"), a mix of kinds, or none raise CPCompileError.
    Also marks torchtitan's RoPE cache lookup token-local for the token guard (see _mark_rope_token_local):
    call it, or shard_batch, before the compiled model's first call."""
    model = getattr(model, "_orig_mod", model)
    classes = _torchtitan_attention_classes()
    found = {kind for m in model.modules() for kind, cls in classes.items() if isinstance(m, cls)}
    if "flex" in found:
        raise CPCompileError(
            "the model uses torchtitan's FlexAttention (attn_backend='flex', torchtitan's default), which cpcompile "
            "does not rewrite (its token guard refuses flex_attention). Fix: build the model with "
            "attn_backend='varlen' for packed documents (strategy 'thd' or 'thd_zigzag'), or set every layer's "
            "attention.inner_attention = ScaledDotProductAttention.Config() for causal attention over each row "
            "(strategy 'flat' or 'zigzag')."
        )
    if len(found) != 1:
        raise CPCompileError(
            f"expected one torchtitan inner attention (ScaledDotProductAttention or VarlenAttention) in the model, "
            f"found {sorted(found) or 'none'}. Fix: pass the torchtitan Decoder (e.g. Llama3Model) whose layers "
            "all use one of them."
        )
    _mark_rope_token_local()
    return found.pop()


def document_offsets(positions: torch.Tensor) -> torch.Tensor:
    """Global cu_seqlens (int32) of the (B, L) rows flattened into one buffer: a document starts wherever a
    position is 0 and at every row start (rows never attend to each other, as in torchtitan's masks)."""
    b, length = positions.shape
    starts = positions == 0
    starts[:, 0] = True
    flat = torch.nonzero(starts.flatten()).flatten()
    return torch.cat((flat, flat.new_tensor([b * length]))).to(torch.int32)


def _check_strategy(strategy: str) -> None:
    if strategy not in (*LAYOUTS, *THD_LAYOUTS):
        raise CPCompileError(f"unknown strategy {strategy!r}. Fix: use one of {sorted((*LAYOUTS, *THD_LAYOUTS))}.")


def _check_inputs(tokens, labels, positions, strategy: str) -> torch.Tensor:
    _check_strategy(strategy)
    if tokens.dim() != 2 or labels.shape != tokens.shape:
        raise CPCompileError(
            f"torchtitan batches are (batch, seq): got tokens {tuple(tokens.shape)} and labels "
            f"{tuple(labels.shape)}. Fix: pass the GLOBAL (unsharded) tokens and labels, both (batch, seq)."
        )
    if positions is None:
        return torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    if positions.shape != tokens.shape or positions.is_floating_point() or bool((positions < 0).any()):
        raise CPCompileError(
            f"positions must be the GLOBAL per-token positions, non-negative integers shaped like tokens "
            f"{tuple(tokens.shape)}; got {positions.dtype} {tuple(positions.shape)}. Fix: pass the batch's "
            "positions before sharding (0 where a packed document starts), or None for 0..seq-1 in every row."
        )
    return positions


def _pad_end(x: torch.Tensor, extra: int, value: int) -> torch.Tensor:
    return F.pad(x, (0, extra), value=value) if extra else x


def pack_batch(
    tokens: torch.Tensor,
    labels: torch.Tensor,
    positions: torch.Tensor | None = None,
    *,
    strategy: str,
    cp: int,
    max_documents: int | None = None,
    ignore_index: int = -100,
    pad_id: int = 0,
) -> GlobalBatch:
    """Pad the GLOBAL batch for `strategy` on `cp` ranks and, for packed documents, build its global offsets.

    flat / zigzag: each row is padded at its end to the layout's multiple (cp, 2*cp). thd / thd_zigzag: the rows
    are flattened into one packed buffer (1, B*L); thd pads it to a multiple of cp (one more document),
    thd_zigzag pads every document to a multiple of 2*cp and the buffer to a length fixed by `max_documents`.
    cu_seqlens always has max_documents + 2 entries (default max_documents for thd: B*L, every token could
    start a document; thd_zigzag needs it given, as it sizes the padded buffer), so neither its shape nor the
    packed length changes between batches of one shape: no recompiles. Padding tokens are `pad_id` at position 0
    with label `ignore_index`; under causal attention no real token sees them.
    """
    positions = _check_inputs(tokens, labels, positions, strategy)
    num_tokens = int((labels != ignore_index).sum())
    rows, length = tokens.shape
    if strategy in LAYOUTS:
        extra = -length % get_layout(strategy).required_multiple(cp)
        padded = [_pad_end(t, extra, v) for t, v in ((tokens, pad_id), (labels, ignore_index), (positions, 0))]
        return GlobalBatch(*padded, cu_seqlens=None, max_seqlen=None, padding=extra * rows, num_tokens=num_tokens)
    total = rows * length
    cu = document_offsets(positions)
    flat = [t.reshape(1, total) for t in (tokens, labels, positions)]
    docs = cu.numel() - 1
    if max_documents is None and strategy == "thd":
        max_documents = total
    if not isinstance(max_documents, int) or max_documents < 1:
        raise CPCompileError(
            f"strategy {strategy!r} needs max_documents=, the most documents a batch can hold (got "
            f"{max_documents!r}): it pads every document to a multiple of 2*cp={2 * cp} and the packed buffer to a "
            "length fixed by it, so batches never recompile. Fix: pass max_documents=<an upper bound>."
        )
    if docs > max_documents:
        raise CPCompileError(
            f"this batch holds {docs} documents (rows and position resets), more than max_documents="
            f"{max_documents}. Fix: pass a larger max_documents (a new value recompiles once)."
        )
    if strategy == "thd":
        fixed = total + (-total % get_packed_layout(strategy).required_multiple(cp))
        max_seqlen = max(length, fixed - total)
    else:
        multiple = get_packed_layout(strategy).doc_multiple_per_cp * cp
        padded_docs = [pad_documents(t, cu, multiple, dim=1, value=v) for t, v in zip(flat, (pad_id, ignore_index, 0))]
        flat, cu = [t for t, _ in padded_docs], padded_docs[0][1]
        row = length + (-length % multiple)
        fixed = total + max_documents * (multiple - 1)
        fixed += -fixed % multiple
        max_seqlen = max(row, fixed - (total + (-total % multiple)))
    extra = fixed - flat[0].shape[1]
    flat = [_pad_end(t, extra, v) for t, v in zip(flat, (pad_id, ignore_index, 0))]
    cu = pad_cu_seqlens(cu, fixed, max_documents + 2)
    return GlobalBatch(*flat, cu_seqlens=cu, max_seqlen=max_seqlen, padding=fixed - total, num_tokens=num_tokens)


def varlen_metadata(cu_seqlens: torch.Tensor, max_seqlen: int):
    """torchtitan's VarlenMetadata for the GLOBAL offsets: what VarlenAttention reads from attention_masks."""
    from torchtitan.models.common.attention import VarlenMetadata

    return VarlenMetadata(cu_seq_q=cu_seqlens, cu_seq_k=cu_seqlens, max_q=max_seqlen, max_k=max_seqlen)


def _check_rope(model: torch.nn.Module, positions: torch.Tensor) -> None:
    """RoPE gathers its cache at each position; torchtitan checks the bound only outside torch.compile."""
    config = getattr(getattr(model, "_orig_mod", model), "config", None)
    try:
        limit = config.max_seq_len
    except (AttributeError, ValueError):
        return
    top = int(positions.max()) if positions.numel() else 0
    if top >= limit:
        raise CPCompileError(
            f"positions reach {top}, past the model's RoPE cache of max_seq_len={limit} (torchtitan does not check "
            "it under torch.compile). Fix: pass per-document positions below max_seq_len, or raise it."
        )


def shard_batch(
    model: torch.nn.Module,
    tokens: torch.Tensor,
    labels: torch.Tensor,
    positions: torch.Tensor | None = None,
    *,
    strategy: str,
    mesh=None,
    group=None,
    max_documents: int | None = None,
    ignore_index: int = -100,
    pad_id: int = 0,
) -> TitanBatch:
    """This rank's part of a GLOBAL torchtitan batch (tokens, labels and positions (batch, seq); positions None:
    0..seq-1 per row), for `model` compiled with cpcompile.backend(strategy=strategy, ...).

    The strategy must fit the model's attention: ScaledDotProductAttention takes "flat" / "zigzag" (causal over
    each row; it ignores documents), VarlenAttention "thd" / "thd_zigzag" (causal within each document, where
    positions reset to 0 or a row starts). Padding, offsets and metadata: `pack_batch`. inputs holds tokens=,
    the GLOBAL positions of this rank's tokens, and attention_masks= (packed: VarlenMetadata of the GLOBAL
    offsets, the same on every rank; SDPA: None)."""
    _check_strategy(strategy)
    kind = check_model(model)
    if strategy not in ATTENTION_STRATEGIES[kind]:
        raise CPCompileError(
            f"strategy {strategy!r} does not fit the model's torchtitan {kind} attention, which takes "
            f"{' or '.join(map(repr, ATTENTION_STRATEGIES[kind]))}. Fix: use one of those, here and in "
            "cpcompile.backend(strategy=...)."
        )
    cp = resolve_group(mesh, group)
    full = pack_batch(
        tokens,
        labels,
        positions,
        strategy=strategy,
        cp=cp.size,
        max_documents=max_documents,
        ignore_index=ignore_index,
        pad_id=pad_id,
    )
    _check_rope(model, full.positions)
    local = [
        shard(t, strategy=strategy, seq_dim=1, mesh=mesh, group=group, cu_seqlens=full.cu_seqlens)
        for t in (full.tokens, full.labels, full.positions)
    ]
    masks = None
    if full.cu_seqlens is not None:
        masks = varlen_metadata(full.cu_seqlens.to(tokens.device), full.max_seqlen)
    inputs = {"tokens": local[0], "positions": local[2], "attention_masks": masks}
    return TitanBatch(inputs=inputs, labels=local[1], num_tokens=full.num_tokens, padding=full.padding)


__all__ = [
    "ATTENTION_STRATEGIES",
    "GlobalBatch",
    "TitanBatch",
    "check_model",
    "document_offsets",
    "pack_batch",
    "shard_batch",
    "varlen_metadata",
]
