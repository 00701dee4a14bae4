"""Sliding windows (cpcompile.attention) under CP on the dense layouts, forward and backward, against the same op
on one process: flat and zigzag x all_gather, a2a and ring, causal and bidirectional windows, softcapped cases, and
the ring at cp=4 where it skips the steps no window reaches.

One spawn of 2 ranks and one of 4 (fp64, eager inner compiler: the op-level path; tests/parity/test_hf_zoo.py runs windows
through HF models and aot_eager). Windows are shorter than a chunk, span chunks and reach past the sequence, so
blocks are skipped, cut and whole. The blocks themselves are checked exhaustively in tests/unit/test_window_blocks.py.
"""

from __future__ import annotations

import torch

import cpcompile
from cpcompile.testing.distributed import run_ranks

SEQ, HQ, HKV, D = 24, 4, 2, 8
CASES = [
    # (strategy, comm, causal, window, softcap)
    ("zigzag", "all_gather", True, (3, 0), 0.0),  # inside a chunk (6 tokens)
    ("zigzag", "all_gather", False, (7, 2), 0.0),  # spans chunks, asymmetric
    ("zigzag", "a2a", True, (9, 0), 0.0),
    ("flat", "all_gather", True, (13, 0), 0.0),  # reaches past a rank's half
    ("flat", "a2a", False, (4, 4), 0.0),
    ("zigzag", "all_gather", True, (5, 0), 20.0),  # softcapped: the CPU reference kernel
    ("zigzag", "ring", True, (3, 0), 0.0),
    ("flat", "ring", False, (7, 2), 0.0),
    ("zigzag", "ring", True, (5, 0), 20.0),
    ("zigzag", "ring+deferred", True, (5, 0), 20.0),  # backend(deferred_merge=True): steps over some rows
]
RING_4 = [  # cp=4 (chunks of 6 flat, 3 zigzag): the ring skips the steps no window reaches
    ("flat", "ring", True, (3, 0), 0.0),  # visits steps 0 and 1
    ("zigzag", "ring", False, (2, 1), 0.0),  # 0, 1 and 3
    ("zigzag", "ring+deferred", False, (2, 1), 0.0),
]


def _errors(strategy, comm, causal, window, softcap) -> list[float]:
    g = torch.Generator().manual_seed(0)
    shapes = ((1, HQ, SEQ, D), (1, HKV, SEQ, D), (1, HKV, SEQ, D), (1, HQ, SEQ, D))
    q, k, v, dout = (torch.randn(s, generator=g, dtype=torch.float64) for s in shapes)

    def attn(q, k, v):
        return cpcompile.attention(q, k, v, is_causal=causal, window=window, softcap=softcap)

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = attn(*leaves)
    ref.backward(dout)
    shard = lambda t: cpcompile.shard(t, strategy=strategy, seq_dim=2)  # noqa: E731
    local = [shard(t).requires_grad_() for t in (q, k, v)]
    comm, _, option = comm.partition("+")  # "ring+deferred": backend(deferred_merge=True)
    be = cpcompile.backend(strategy=strategy, comm=comm, inner="eager", deferred_merge=option == "deferred")
    torch._dynamo.reset()
    out = torch.compile(attn, backend=be, fullgraph=True)(*local)
    out.backward(shard(dout))
    (plan,) = be.plans
    assert plan.window == window and plan.softcap == softcap, (plan.window, plan.softcap)
    errs = [(out - shard(ref)).abs().max().item()]
    return errs + [(t.grad - shard(r.grad)).abs().max().item() for t, r in zip(local, leaves)]


def _run_all(rank, world):
    return {case: _errors(*case) for case in (CASES if world == 2 else RING_4)}


def _assert_exact(results):
    bad = {(r, case): e for r, found in enumerate(results) for case, e in found.items() if max(e) > 1e-10}
    assert not bad, bad


def test_windowed_attention_parity_2_ranks():
    _assert_exact(run_ranks(_run_all, 2, timeout=600))


def test_windowed_ring_skips_steps_parity_4_ranks():
    from cpcompile.comms.ring.schedule import visited_steps
    from cpcompile.layouts import LAYOUTS

    for strategy, _, causal, window, _ in RING_4:  # the cases do skip steps
        chunk = SEQ // LAYOUTS[strategy].num_chunks(4)
        assert len(visited_steps(LAYOUTS[strategy], 4, chunk, causal, window)) < 4, (strategy, window)
    _assert_exact(run_ranks(_run_all, 4, timeout=600))
