"""The all-gather CP region for packed documents (varlen_attn under the thd / thd_zigzag layouts).

One all-gather of K/V, then one varlen kernel call a rank (layouts.thd): nothing to merge. thd reads the
gathered buffer as it is; thd_zigzag first copies it into its key buffer (each document's front-chunk keys,
then its back-chunk keys) and folds that buffer's gradient back in fp32 before the reduce-scatter (a gather
over each token's copies, `layouts.thd.PackedLayout.key_buffer`).
"""

from __future__ import annotations

import torch

from ... import executor
from ...comm.collectives import all_gather_dim0 as _gather
from ...comm.collectives import reduce_scatter_dim0 as _reduce
from ...comm.pending import in_backward
from ...executor.blocks import decode_varlen, encode_varlen
from ...executor.packed_kv import pack_kv, unpack_kv
from ...executor.varlen_meta import prepare_blocks
from ...layouts.block import NO_WINDOW
from ...layouts.thd import get_packed_layout
from ...precision import acc_dtype


def read_keys(
    gathered: torch.Tensor, key_index: torch.Tensor | None, window: tuple[int, int] | None = None
) -> torch.Tensor:
    """The key buffer the block reads: the gathered (T, 2, Hkv, D) K/V itself (MLA: (T, Hkv, D + Dv),
    executor.packed_kv), the slice [start, stop) of it that the rank can read (`window`, layouts' key_window:
    a view), or its copy through key_index."""
    if key_index is not None:
        return gathered.index_select(0, key_index)
    return gathered if window is None else gathered[window[0] : window[1]]


def widen_key_grads(dkeys: torch.Tensor, window: tuple[int, int] | None, total: int) -> torch.Tensor:
    """The gradient of a `window` slice of the gathered buffer as the whole buffer's: zeros outside it."""
    if window is None:
        return dkeys
    pad = [0, 0] * (dkeys.dim() - 1) + [window[0], total - window[1]]
    return torch.nn.functional.pad(dkeys, pad)


def fold_key_grads(dk: torch.Tensor, dv: torch.Tensor, key_fold: torch.Tensor | None) -> torch.Tensor:
    """The key buffer's dK/dV as the gathered buffer's (T, 2, Hkv, D) gradient in the reduce dtype: a gather
    over each token's copies (layouts.thd.PackedLayout.key_buffer; a key held twice gets both parts, summed in
    fp32). In the region's backward graph Inductor fuses the stack, gather, sum and cast into one kernel."""
    dkeys = pack_kv(dk, dv, 1)
    acc = acc_dtype(dk.dtype)
    if key_fold is None:
        return dkeys.to(acc)
    parts = dkeys[key_fold.clamp(min=0)].to(acc)  # (copies, T, 2, Hkv, D)
    held = (key_fold >= 0)[(..., *(None,) * (dkeys.dim() - 1))]  # broadcast over (2,) Hkv, D
    return torch.where(held, parts, 0).sum(0)


def gathered_blocks(blocks: list, q_len: int, keys_len: int, kernel: str) -> tuple[list[int], list[torch.Tensor]]:
    """(spec, tensors) of the rank's blocks for `attend_gathered`: their encoding and, as one list, their
    ranges then their metadata (executor.varlen_meta), built once per batch in the region's graph."""
    spec, ranges = encode_varlen(blocks), [b.ranges for b in blocks]
    return spec, ranges + prepare_blocks(ranges, spec, q_len, [keys_len], kernel)


def _cut(spec: list[int], tensors) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """`gathered_blocks`' tensors back into (ranges, metadata): one ranges tensor a block."""
    n = len(decode_varlen(spec))
    return list(tensors[:n]), list(tensors[n:])


def attend_gathered(q, gathered, key_index, tensors, spec, scale, kernel, window=None):
    """(out, lse, keys) of the rank's block over the gathered K/V (no communication); `tensors`: the ranges and
    metadata of `gathered_blocks`."""
    keys = read_keys(gathered, key_index, window)
    k, v = unpack_kv(keys, 1, q.shape[-1])
    ranges, meta = _cut(spec, tensors)
    out, lse = executor.attend_varlen(q, [k], [v], ranges, spec, scale, kernel, meta)
    return out, lse, keys


def attend_gathered_backward(dout, q, keys, out, lse, key_fold, tensors, spec, scale, kernel):
    """(dq, the gathered buffer's gradient in the reduce dtype), no communication."""
    k, v = unpack_kv(keys, 1, q.shape[-1])
    ranges, meta = _cut(spec, tensors)
    dq, (dk,), (dv,) = executor.attend_varlen_backward(
        dout.contiguous(), q, [k], [v], out, lse, ranges, spec, scale, kernel, meta
    )
    return dq, fold_key_grads(dk, dv, key_fold)


class _GatherAttend(torch.autograd.Function):
    """All-gather packed K/V (tokens on dim 0, K and V in one collective), run the rank's block; backward keeps
    the K/V gradient in fp32 from the kernel through the reduce-scatter and rounds once."""

    @staticmethod
    def forward(ctx, q, k, v, key_index, key_fold, window, spec, scale, kernel, group_name, regather, *tensors):
        packed = pack_kv(k, v, 1)  # (L, 2, Hkv, D); MLA: (L, Hkv, D + Dv)
        gathered = _gather(packed, group_name)
        out, lse, keys = attend_gathered(q, gathered, key_index, tensors, spec, scale, kernel, window)
        # regather: only the local K/V stay alive until backward (keys: the key buffer or the read slice)
        ctx.save_for_backward(q, packed if regather else keys, out, lse, key_index, key_fold, *tensors)
        ctx.spec, ctx.scale, ctx.kernel, ctx.group_name, ctx.regather = spec, scale, kernel, group_name, regather
        ctx.window, ctx.total = window, gathered.shape[0]
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, keys, out, lse, key_index, key_fold, *tensors = ctx.saved_tensors  # None index/fold: saved as None
        if ctx.regather:  # the local K/V tied to a backward value, or the partitioner saves the forward's gather
            keys = read_keys(_gather(in_backward(keys, dout), ctx.group_name), key_index, ctx.window)
        args = (tensors, ctx.spec, ctx.scale, ctx.kernel)
        dq, dkeys = attend_gathered_backward(dout, q, keys, out, lse, key_fold, *args)
        dkeys = widen_key_grads(dkeys, ctx.window, ctx.total)
        dkv = _reduce(dkeys, ctx.group_name).to(keys.dtype)  # (L, 2, Hkv, D): this rank's K/V gradient
        return (dq.to(q.dtype), *unpack_kv(dkv, 1, q.shape[-1]), *([None] * (8 + len(tensors))))


def rank_blocks(
    layout: str,
    causal: bool,
    rank: int,
    world: int,
    local_len: int,
    cu_seqlens: torch.Tensor,
    max_doc: int | None = None,
    window: tuple[int, int] = NO_WINDOW,
) -> list:
    """The varlen blocks this rank runs (layouts.thd), over its key buffer, for these documents."""
    return get_packed_layout(layout).blocks(cu_seqlens, local_len, world, rank, causal, max_doc, tuple(window))


def all_gather_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    layout: str,
    causal: bool,
    scale: float,
    kernel: str,
    group_name: str,
    rank: int,
    world: int,
    max_doc: int | None = None,
    window: tuple[int, int] = NO_WINDOW,
    regather: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """varlen_attn of this rank's packed q over every rank's K/V, same document only (causal when asked,
    within a (left, 0) sliding window when given); `regather`: keep only the local K/V for backward and gather
    them again there.

    cu_seqlens are the GLOBAL document offsets. The layout turns them into the block's ranges and the key
    buffer's index with device ops of static shape (no host sync, no recompiles when documents change).
    `max_doc` (the call's max_q/max_k: the longest document, the same contract as single-device varlen_attn)
    tightens the block's static length bounds, which size the kernel's grid. Returns what
    torch_attn._varlen_attn returns: (out, lse (Hq, T_local) fp32, rng_state), so the node's users are unchanged.
    """
    lay = get_packed_layout(layout)
    local = q.shape[0]
    # thd: only the keys the rank can reach (max_doc, window, causal) go to the kernel, whose backward then
    # zero-fills and reduces (GQA) dK/dV over that slice, not over all T keys
    blocks, read = lay.kernel_blocks(cu_seqlens, local, world, rank, causal, max_doc, tuple(window))
    key_index, key_fold = lay.key_buffer(cu_seqlens, local, world, rank, causal) or (None, None)
    assert read is None or key_index is None, f"layout {layout!r}: a key slice must be of the gathered buffer"
    keys_len = world * local if key_index is None else key_index.shape[0]
    spec, tensors = gathered_blocks(blocks, local, keys_len if read is None else read[1] - read[0], kernel)
    args = (key_index, key_fold, read, spec, scale, kernel, group_name, regather)
    out, lse = _GatherAttend.apply(q, k, v, *args, *tensors)
    rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)
    return out, lse.to(torch.float32), rng_state
