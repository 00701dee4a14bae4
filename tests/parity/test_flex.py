"""FlexAttention under CP, forward and backward, against one process: every mask kind x layout x comm, cp 2 and 4.

One spawn per CP size runs its cases (fp64, aot_eager): causal + ALiBi (a score_mod whose slopes get gradients),
a sliding window, a document mask, a per-head prefix-LM mask + tanh softcap, and no mask at all.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import cpcompile
from cpcompile.testing.distributed import run_ranks
from tests.support.flex import SEQ, attention, block_mask, cpu_flex_backward, mask_and_score

CASES = {
    2: [
        ("causal_alibi", "zigzag", "all_gather"), ("window", "flat", "all_gather"), ("full", "zigzag", "all_gather"),
        ("document", "zigzag", "a2a"), ("prefix_softcap", "flat", "a2a"), ("prefix_softcap", "zigzag", "all_gather"),
    ],
    4: [("causal_alibi", "zigzag", "a2a")],
}  # fmt: skip
"""Every mask kind and every (layout, comm) pair at cp=2 (CI has 2 cores: each case is a compile on every rank);
cp=4 with 2 kv heads covers a2a's kv-head replication (Hkv < cp) and ALiBi's global head index there. The block
tables themselves are checked exhaustively in tests/unit/test_flex_blocks.py (flex's CPU path ignores them)."""


def _case(seed: int, b: int, hq: int, hkv: int, d: int = 8):
    g = torch.Generator().manual_seed(seed)
    shapes = ((b, hq, SEQ, d), (b, hkv, SEQ, d), (b, hkv, SEQ, d), (b, hq, SEQ, d))
    return [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]


def _errors(kind, strategy, comm, hq, hkv):
    """Max errors (out, dq, dk, dv, d-buffers summed over ranks) of one case on this rank."""
    import torch.distributed as dist

    q, k, v, dout = _case(0, 2, hq, hkv)
    _, score_mod, buffers, _ = mask_and_score(kind, hq)
    mask = block_mask(kind, 2, hq)
    attn = attention(score_mod)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = attn(*leaves, mask)
    ref.backward(dout)
    ref_buffers = [t.grad.clone() for t in buffers]
    for t in buffers:
        t.grad = None
    shard = lambda t: cpcompile.shard(t, strategy=strategy, seq_dim=2)  # noqa: E731
    local = [shard(t).requires_grad_() for t in (q, k, v)]
    be = cpcompile.backend(strategy=strategy, comm=comm, inner="aot_eager")
    sharded = cpcompile.shard_block_mask(mask, strategy=strategy) if mask is not None else None
    torch._dynamo.reset()
    out = torch.compile(attn, backend=be, fullgraph=True)(*local, sharded)
    out.backward(shard(dout))
    assert len(be.plans) == 1 and be.plans[0].site.kind == "flex"
    errs = [(out - shard(ref)).abs().max().item()]
    errs += [(t.grad - shard(r.grad)).abs().max().item() for t, r in zip(local, leaves)]
    for t, r in zip(buffers, ref_buffers):
        dist.all_reduce(t.grad)  # each rank's share of a score_mod parameter's gradient
        errs.append((t.grad - r).abs().max().item())
    return errs


def _run_all(rank, world, heads):
    with cpu_flex_backward():
        found = {}
        for kind, strategy, comm in CASES[world]:
            found[(kind, strategy, comm)] = _errors(kind, strategy, comm, *heads)
        return found


@pytest.mark.parametrize("world,heads", [(2, (4, 2)), (4, (4, 2))])
def test_flex_parity(world, heads):
    results = run_ranks(_run_all, world, heads, timeout=900)
    bad = {(r, key): e for r, found in enumerate(results) for key, e in found.items() if max(e) > 1e-10}
    assert not bad, bad


def test_reference_backward_is_sdpa():
    """The gate-lifted CPU flex backward the references use is SDPA's (causal, fp64)."""
    q, k, v, dout = _case(1, 1, 4, 2)
    with cpu_flex_backward():
        a = [t.clone().requires_grad_() for t in (q, k, v)]
        attention(None)(*a, None).backward(dout)  # full attention
        c = [t.clone().requires_grad_() for t in (q, k, v)]
        mask = block_mask("causal_alibi", 1, 4)
        out = attention(None)(*c, mask)
        out.backward(dout)
    b = [t.clone().requires_grad_() for t in (q, k, v)]
    F.scaled_dot_product_attention(*b, is_causal=True, enable_gqa=True).backward(dout)
    d = [t.clone().requires_grad_() for t in (q, k, v)]
    F.scaled_dot_product_attention(*d, enable_gqa=True).backward(dout)
    for x, y, z, w in zip(a, d, c, b):
        assert (x.grad - y.grad).abs().max() < 1e-12 and (z.grad - w.grad).abs().max() < 1e-12
