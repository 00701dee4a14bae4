"""A CPU stand-in for cudnn-frontend's `torch.ops.cudnn.sdpa_fwd/_bwd` (THD path), for the provider's CPU tests.

It follows the contract read from nvidia-cudnn-frontend 1.32's cudnn/sdpa/fwd/torch_op.py: packed (T, H, D)
q/k/v, one cu_seqlens prefix array a side (a sequence's offset and length), max lengths > 0, the band keywords
(is_causal / window_left / window_right / causal_bottom_right, cuDNN's left bound counting the diagonal; without
causal_bottom_right the band is anchored TOP-LEFT, as the real op's, so a top-left mask on a rectangular range
gives other results than the provider's contract), LSE
returned token-major (T, Hq, 1) and taken back PADDED (B, Hq, max_q, 1) fp32 by the backward (cpcompile's graph
ops also take them back ragged, as written: `cudnn_graph.reads_ragged_stats`); and it records the
graph-cache key the real op builds per shape. The math is cpu_varlen_ref's, per sequence. Everything the real
kernel may leave undefined is poisoned with NaN, so the provider has to handle it: rows of no sequence or of a
sequence without keys, and in backward keys of no sequence, of a sequence without rows, or that no row sees.
"""

from __future__ import annotations

import torch

from cpcompile.kernels import cudnn_graph
from cpcompile.kernels.base import range_ids
from cpcompile.kernels.cpu_varlen_ref import CPUVarlenReference, _mask

REF = CPUVarlenReference()
TOP_LEFT = CPUVarlenReference()
TOP_LEFT.top_left = True  # the same math on the top-left diagonal (cuDNN's default anchor)


def _round64(n: int) -> int:
    return (n + 63) // 64 * 64


class CuDNNStandIn:
    def __init__(self):
        self.graphs: set[tuple] = set()

    def _mask_args(self, is_causal, causal_bottom_right, window_left, window_right):
        band = is_causal or window_left >= 0 or window_right >= 0
        if causal_bottom_right and not band:
            raise ValueError("causal_bottom_right only re-anchors an active diagonal band")
        if is_causal and window_right > 0:
            raise ValueError("is_causal masks every future column but window_right admits some")
        if window_left == 0:
            raise ValueError("sliding-window length must be >= 1")
        causal = is_causal or window_right == 0
        window = (window_left - 1 if window_left >= 0 else -1, -1 if causal else window_right)
        return causal, window, (band and not causal_bottom_right)

    def _sequences(self, cu_q, cu_k, max_q, max_k, ranges=None):
        if max_q <= 0 or max_k <= 0:
            raise ValueError("varlen path needs max_seqlen_q, max_seqlen_kv > 0")
        if ranges is None:  # the frontend's cu_seqlens: each sequence starts where the previous one ends
            ranges = torch.stack((cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:])).long()
        assert int((ranges[1] - ranges[0]).max()) <= max_q and int((ranges[3] - ranges[2]).max()) <= max_k
        return ranges

    def sdpa_fwd(self, q, k, v, attn_scale, *, is_causal=False, causal_bottom_right=False, window_left=-1,
                 window_right=-1, cu_seqlens_q=None, cu_seqlens_kv=None, max_seqlen_q=0, max_seqlen_kv=0,
                 return_lse=True, ranges=None):  # fmt: skip
        assert q.ndim == 3 and return_lse and k.shape[-1] == q.shape[-1]
        causal, window, top_left = self._mask_args(is_causal, causal_bottom_right, window_left, window_right)
        ranges = self._sequences(cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, ranges)
        b = ranges.shape[1]
        key = (q.dtype, b, q.shape[1], k.shape[1], v.shape[1], max_seqlen_q, max_seqlen_kv, q.shape[-1], v.shape[-1])
        self.graphs.add(("fwd", *key, q.stride(), k.stride(), v.stride(), attn_scale, causal, window, top_left))
        ref = TOP_LEFT if top_left else REF
        out, lse = ref.forward(q, k, v, ranges, max_seqlen_q, max_seqlen_kv, causal, attn_scale, window)
        qs, qe, ks, ke = ranges
        rid = range_ids(qs, qe, q.shape[0])
        live = (rid >= 0) & (ke - ks > 0)[rid.clamp(min=0)]
        out = torch.where(live[:, None, None], out, float("nan")).to(q.dtype)
        stats = torch.where(live[None], lse, float("nan")).float().t().contiguous().unsqueeze(-1)
        return out, stats

    def sdpa_bwd(self, grad_out, q, k, v, o, lse, attn_scale, *, is_causal=False, causal_bottom_right=False,
                 window_left=-1, window_right=-1, cu_seqlens_q=None, cu_seqlens_kv=None, max_seqlen_q=0,
                 max_seqlen_kv=0, is_deterministic=False, ranges=None):  # fmt: skip
        causal, window, top_left = self._mask_args(is_causal, causal_bottom_right, window_left, window_right)
        ranges = self._sequences(cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, ranges)
        b, hq, tq, tk = ranges.shape[1], q.shape[1], q.shape[0], k.shape[0]
        assert lse.dtype == torch.float32 and lse.is_contiguous() and lse.shape == (b, hq, max_seqlen_q, 1)
        key = (q.dtype, b, hq, k.shape[1], v.shape[1], _round64(tq), _round64(tk), max_seqlen_q, max_seqlen_kv)
        strides = (q.stride(), k.stride(), v.stride(), o.stride())
        self.graphs.add(("bwd", *key, *strides, attn_scale, causal, window, top_left))
        qs, qe, ks, ke = ranges
        rid = range_ids(qs, qe, tq)
        seq, pos = rid.clamp(min=0), torch.arange(tq) - qs[rid.clamp(min=0)]
        live = (rid >= 0) & (ke - ks > 0)[seq]
        # the kernel reads each sequence's own stats rows and never mixes sequences: give undefined rows finite
        # stand-ins (cpu_varlen_ref would let them leak into other rows' sums), then poison what it may leave
        flat = lse[seq, :, pos.clamp(0, max_seqlen_q - 1), 0].t()
        row_lse = torch.where(live[None], flat.double(), 0.0)
        clean = [torch.where(live[:, None, None], t, 0) for t in (grad_out, o)]
        ref = TOP_LEFT if top_left else REF
        dq, dk, dv = ref.backward(*clean[:1], q, k, v, clean[1], row_lse, ranges, 0, 0, causal, attn_scale, window)
        seen = _mask(ranges, tq, tk, causal, window, top_left).any(0)
        dq = torch.where(live[:, None, None], dq, float("nan"))
        dk, dv = (torch.where(seen[:, None, None], g, float("nan")) for g in (dk, dv))
        return dq.to(q.dtype), dk.to(q.dtype), dv.to(q.dtype)

    # cpcompile's graph ops (kernels/cudnn_graph): the same contract with the ragged metadata made by the caller.
    # A sequence starts at its offset and runs its length: each offset column must be the side's token starts
    # times that tensor's token stride (cu_seqlens when the sequences are adjacent; any starts otherwise, as the
    # split calls address each range directly). The stand-in recovers the starts, checks every column, and that
    # the sequences lie inside their tensors and do not overlap on a side (the kernel writes each side's rows or
    # gradients there), so wrong metadata (a stride, an order, a dtype, a length) fails here as on the GPU.

    @staticmethod
    def _ranges(meta, tokens, tq: int, tk: int) -> torch.Tensor:
        """(4, B) ranges (qs, qe, ks, ke) from FWD_META / BWD_META-ordered columns; `tokens`: each offset column's
        token stride, q side first (its count: len(tokens) - k_count), then k side."""
        (len_q, len_k, *offs), (nq, strides) = meta, tokens
        b = len_q.shape[0]
        assert len_q.dtype == len_k.dtype == torch.int32 and len_q.shape == len_k.shape == (b, 1, 1, 1)
        assert all(o.dtype == torch.int64 and o.shape == (b + 1, 1, 1, 1) and o.is_contiguous() for o in offs)
        assert len(offs) == len(strides) and all(n.is_contiguous() for n in (len_q, len_k))
        starts = [offs[0].view(-1) // strides[0], offs[nq].view(-1) // strides[nq]]
        for i, (o, s) in enumerate(zip(offs, strides)):
            assert torch.equal(o.view(-1), starts[i >= nq] * s), f"offset column {i}: not token starts x stride {s}"
        ranges = []
        for st, n, t in zip(starts, (len_q, len_k), (tq, tk)):
            a, z = st[:-1], st[:-1] + n.view(-1).long()
            assert bool((n >= 0).all()) and bool((a >= 0).all()) and bool((z <= t).all()), "a sequence out of bounds"
            live = z > a
            order = torch.argsort(a[live])
            assert bool((a[live][order][1:] >= z[live][order][:-1]).all()), "sequences overlap on one side"
            ranges += [a, z]
        return torch.stack(ranges)

    @staticmethod
    def _padded(stats: torch.Tensor, ranges: torch.Tensor, max_q: int) -> torch.Tensor:
        """Ragged (Tq, Hq, 1) stats as the padded (B, Hq, max_q, 1) the reference backward reads: each sequence's
        rows from its own offset, the rest NaN (the kernel reads only rows of its sequences)."""
        b, hq = ranges.shape[1], stats.shape[1]
        padded = torch.full((b, hq, max_q, 1), float("nan"))
        for i, (a, z) in enumerate(zip(ranges[0].tolist(), ranges[1].tolist())):
            n = min(z - a, max_q)
            padded[i, :, :n, 0] = stats[a : a + n, :, 0].t()
        return padded

    def cudnn_thd_fwd(self, q, k, v, meta, tokens, scale, max_q, max_k, is_causal, bottom_right, left, right):
        assert list(tokens) == [t.stride(0) for t in (q, k, v)], "tokens: the inputs' real token strides"
        tokens = (3, (q.stride(0), q.shape[1] * v.shape[2], q.shape[1], k.stride(0), v.stride(0)))
        ranges = self._ranges(meta, tokens, q.shape[0], k.shape[0])
        return self.sdpa_fwd(q, k, v, scale, is_causal=is_causal, causal_bottom_right=bottom_right,
                             window_left=left, window_right=right, max_seqlen_q=max_q, max_seqlen_kv=max_k,
                             ranges=ranges)  # fmt: skip

    def cudnn_thd_bwd(self, dout, q, k, v, out, stats, meta, tokens, scale, max_q, max_k, is_causal, bottom_right,
                      left, right, deterministic):  # fmt: skip
        assert all(t.is_contiguous() for t in (dout, out)), "dO and O share one offsets column: both packed"
        assert all(t.shape[0] < 2 or t.stride(0) == n for t, n in zip((q, out, k, v), tokens)), "tokens: q, o, k, v"
        hq, hk, hv, d, dv = q.shape[1], k.shape[1], v.shape[1], q.shape[2], v.shape[2]
        tq_tk = (q.shape[0], k.shape[0])
        ragged = stats.dim() == 3  # the forward's own (Tq, Hq, 1), offsets cu_seqlens_q x Hq (BWD_META_RAGGED_STATS)
        q_side = (tokens[0], hq * dv, hq * d) + ((hq,) if ragged else ())  # q where it lies; o, dq packed
        ranges = self._ranges(meta, (len(q_side), (*q_side, tokens[2], tokens[3], hk * d, hv * dv)), *tq_tk)
        if ragged:
            assert cudnn_graph.reads_ragged_stats(q.device), "ragged stats where the backward takes them padded"
            assert stats.dtype == torch.float32 and stats.is_contiguous() and stats.shape == (q.shape[0], hq, 1)
            stats = self._padded(stats, ranges, max_q)
        return self.sdpa_bwd(dout, q, k, v, out, stats, scale, is_causal=is_causal, causal_bottom_right=bottom_right,
                             window_left=left, window_right=right, max_seqlen_q=max_q, max_seqlen_kv=max_k,
                             is_deterministic=deterministic, ranges=ranges)  # fmt: skip
