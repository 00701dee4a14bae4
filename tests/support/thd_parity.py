"""Parity machinery for packed documents: per-document single-process SDPA references and the CP run."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.varlen import varlen_attn

import cpcompile
from cpcompile.testing.varlen_model import GQA
from tests.support.parity import bf16_rule, max_err


def random_lengths(gen: torch.Generator, total: int, unit: int = 1) -> list[int]:
    """Random document lengths (multiples of `unit`) summing to `total`: 1-token and very long ones mixed."""
    lengths, left = [], total // unit
    while left:
        kind = torch.randint(0, 3, (1,), generator=gen).item()
        cap = 1 if kind == 0 else (3 if kind == 1 else left)
        n = min(left, torch.randint(1, cap + 1, (1,), generator=gen).item())
        lengths.append(n * unit)
        left -= n
    return lengths


def cu_of(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def packed_case(seed: int, total: int, hq: int, hkv: int, d: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(total, h, d, generator=g, dtype=torch.float64) for h in (hq, hkv, hkv, hq)]


def window_mask(n: int, window: tuple[int, int]) -> torch.Tensor:
    """(n, n) bool: key j visible to query i of one document under flash-attn's window_size (left, right)."""
    rel = torch.arange(n)[None, :] - torch.arange(n)[:, None]
    left, right = window
    return ((rel >= -left) | (left < 0)) & ((rel <= right) | (right < 0))


def doc_reference(q, k, v, dout, cu: torch.Tensor, causal: bool, dtype: torch.dtype, window=None):
    """(out, dq, dk, dv) of SDPA run separately on every document, in `dtype` (with a window: its mask)."""
    leaves = [t.detach().to(dtype).clone().requires_grad_() for t in (q, k, v)]
    outs = []
    bounds = cu.tolist()
    for a, b in zip(bounds, bounds[1:]):
        if b == a:
            continue
        qd, kd, vd = (t[a:b].transpose(0, 1) for t in leaves)
        mask = {} if window is None else {"attn_mask": window_mask(b - a, window).to(qd.device)}
        causal_doc = causal and window is None
        out = F.scaled_dot_product_attention(qd, kd, vd, is_causal=causal_doc, enable_gqa=True, **mask)
        outs.append(out.transpose(0, 1))
    out = torch.cat(outs)
    out.backward(dout.to(dtype))
    return [out.detach()] + [t.grad for t in leaves]


MAX_DOC = 64
"""varlen_attn's max_q/max_k in the packed parity cases: a bound above every document (and every rank's piece)."""


def causal_attn(q, k, v, cu):
    return varlen_attn(q, k, v, cu, cu, MAX_DOC, MAX_DOC, window_size=(-1, 0), **GQA)


def full_attn(q, k, v, cu):
    return varlen_attn(q, k, v, cu, cu, MAX_DOC, MAX_DOC, **GQA)


def attn(causal: bool, max_doc: int = MAX_DOC):
    if max_doc != MAX_DOC:  # a tighter bound: what the ring's step skipping reads (comms/ring/schedule.thd_reach)
        return windowed_attn((-1, 0) if causal else (-1, -1), max_doc)
    return causal_attn if causal else full_attn


def windowed_attn(window: tuple[int, int], max_doc: int = MAX_DOC):
    def fn(q, k, v, cu):
        return varlen_attn(q, k, v, cu, cu, max_doc, max_doc, window_size=window, **GQA)

    return fn


def cp_varlen(q, k, v, dout, cu, *, strategy, causal, dtype, backend=None, window=None, max_doc=MAX_DOC):
    """(out, dq, dk, dv) of the compiled CP region on this rank's shards, in local layout."""
    shard = lambda t: cpcompile.shard(t.to(dtype), strategy=strategy, seq_dim=0, cu_seqlens=cu)  # noqa: E731
    leaves = [shard(t).detach().requires_grad_() for t in (q, k, v)]
    be = backend or cpcompile.backend(strategy=strategy, inner="aot_eager")
    fn = attn(causal, max_doc) if window is None else windowed_attn(window, max_doc)
    torch._dynamo.reset()
    model_cu = cpcompile.plan_documents(cu, strategy=strategy)  # thd_balanced: the offsets and the plan
    out = torch.compile(fn, backend=be, fullgraph=True)(*leaves, model_cu)
    out.backward(shard(dout))
    return [out.detach()] + [t.grad for t in leaves]


def compare_packed(
    strategy, causal, dtype, lengths, heads=(4, 2), d=8, seed=0, backend=None, window=None, max_doc=MAX_DOC
) -> dict:
    """Per-tensor (cp error, allowed error) of one packed-document case on this rank.

    window: a varlen window_size (left, right) other than causal/full; `causal` is then ignored. max_doc:
    varlen_attn's max_q/max_k (at least the longest document)."""
    cu = cu_of(lengths)
    q, k, v, dout = packed_case(seed, int(cu[-1]), *heads, d)
    exact = doc_reference(q, k, v, dout, cu, causal, torch.float64, window)
    low = doc_reference(q, k, v, dout, cu, causal, dtype, window) if dtype == torch.bfloat16 else exact
    assert max_doc >= max(lengths), "max_q/max_k below a document: wrong on one device too"
    kw = dict(backend=backend, window=window, max_doc=max_doc)
    got = cp_varlen(q, k, v, dout, cu, strategy=strategy, causal=causal, dtype=dtype, **kw)
    shard = lambda t: cpcompile.shard(t, strategy=strategy, seq_dim=0, cu_seqlens=cu)  # noqa: E731
    report = {}
    for name, g, e, lo in zip(("out", "dq", "dk", "dv"), got, exact, low):
        err = max_err(g, shard(e))
        report[name] = (err, bf16_rule(err, max_err(shard(lo), shard(e)), dtype))
    return report
