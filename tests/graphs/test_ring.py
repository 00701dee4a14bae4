"""The ring region's graphs (fake process group, one process): the rewritten call, collectives per forward and
backward, what the forward saves for backward (never another rank's K/V), and Inductor's forward schedule (each
step's shift issued before the held chunk's blocks run, waited after)."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch._inductor.utils import run_and_get_code

import cpcompile
from cpcompile.testing.model import TinyConfig, TinyLlama
from tests.support.fake_pg import capture_graphs, fake_group, rewritten_graph
from tests.support.graphs import _collectives


def gqa_attention(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def _qkv(s=16, requires_grad=True):
    return [torch.randn(1, h, s, 16, requires_grad=requires_grad) for h in (4, 2, 2)]


def test_rewritten_graph_snapshot():
    with fake_group(rank=1, world=4):
        code = rewritten_graph(gqa_attention, *_qkv(8, False), strategy="zigzag", comm="ring")
    assert "cpcompile_regions_ring_ring_attention(l_q_, l_k_, l_v_, layout = 'zigzag', causal = True" in code
    assert "group_name = '0', rank = 1, world = 4)" in code


@pytest.mark.parametrize("strategy", ["flat", "zigzag"])
def test_collectives_per_step_and_saved_tensors(strategy):
    """cp - 1 K/V shifts forward; backward cp - 1 K/V shifts and cp gradient shifts (the last one brings the
    rank's own K/V gradient home); only local tensors are saved for backward."""
    world = 4
    with fake_group(rank=1, world=world):
        be = cpcompile.backend(strategy=strategy, comm="ring", inner="aot_eager")
        graphs = capture_graphs(gqa_attention, be, *_qkv())
    fw, bw = (_collectives(graphs[n]) for n in ("fw", "bw"))
    assert [str(n.target) for n in fw] == ["_c10d_functional.all_to_all_single.default"] * (world - 1)
    assert [str(n.target) for n in bw] == ["_c10d_functional.all_to_all_single.default"] * (2 * world - 1)
    bw_inputs = [n for n in graphs["bw"].graph.nodes if n.op == "placeholder"]
    kv_like = [n for n in bw_inputs if tuple(n.meta["val"].shape) == (16, 1, 2, 1, 2, 16)]  # (L, 1, 2, B, Hkv, D)
    assert len(kv_like) == 1, f"the forward saves {len(kv_like)} K/V buffers; only the rank's own may be saved"


def test_inductor_forward_issues_each_shift_before_the_step():
    cfg = TinyConfig(layers=1)
    torch.manual_seed(0)
    model = TinyLlama(cfg)
    ids, pos = torch.randint(0, cfg.vocab, (1, 16)), torch.arange(16)[None]
    with fake_group(rank=1, world=4):
        compiled = torch.compile(model, backend=cpcompile.backend(strategy="zigzag", comm="ring"), fullgraph=True)
        _, codes = run_and_get_code(lambda: compiled(ids, pos).sum().backward())
    fwd = codes[0]
    events = re.findall(r"(all_to_all_single|wait_tensor|attend_blocks|merge_partial)\.default\(", fwd)
    step = ["all_to_all_single", "attend_blocks", "merge_partial", "wait_tensor"]  # step 0 has nothing to merge into
    assert events == [*step[:2], step[3], *step, *step, "attend_blocks", "merge_partial"], events


def _checkpointed_block(x, wq, wk, wv):
    def block(x, wq, wk, wv):
        q, k, v = ((x @ w).view(1, 16, -1, 16).transpose(1, 2) for w in (wq, wk, wv))
        return gqa_attention(q, k, v).transpose(1, 2).reshape(1, 16, 64)

    return torch.utils.checkpoint.checkpoint(block, x, wq, wk, wv, use_reentrant=False)


@pytest.mark.parametrize("comm,regather", [("all_gather", False), ("all_gather", True), ("ring", False)])
def test_checkpointed_block_saves_only_its_inputs(comm, regather):
    """Under per-block activation checkpointing the forward saves only the block's inputs, whatever the comm:
    the recompute gathers (or circulates) K/V again, so regather only adds a third backward collective."""
    inputs = [torch.randn(1, 16, 64, requires_grad=True)] + [
        torch.randn(64, n, requires_grad=True) for n in (64, 32, 32)
    ]
    with fake_group(rank=1, world=4):
        be = cpcompile.backend(strategy="zigzag", comm=comm, inner="aot_eager", regather=regather)
        graphs = capture_graphs(_checkpointed_block, be, *inputs)
    shapes = {tuple(t.shape) for t in inputs}
    saved = [n for n in graphs["bw"].graph.nodes if n.op == "placeholder" and "tangents" not in n.name]
    assert {tuple(n.meta["val"].shape) for n in saved} <= shapes, [tuple(n.meta["val"].shape) for n in saved]
    backward = {("all_gather", False): 2, ("all_gather", True): 3, ("ring", False): 3 + 3 + 4}[(comm, regather)]
    assert len(_collectives(graphs["bw"])) == backward


def test_inductor_overlaps_every_step_of_a_plain_layer():
    """On a bare SDPA layer Inductor's peak-memory reordering sank each shift down to its wait (no overlap);
    cpcompile compiles region graphs without it, so every attention call but the last, forward and backward,
    runs while a shift is in flight."""
    from bench.probes.ring_trace import blocks_without_overlap

    q, k, v = _qkv(32)
    with fake_group(rank=1, world=4):
        be = cpcompile.backend(strategy="zigzag", comm="ring", kernel="cpu_flash")
        fn = torch.compile(gqa_attention, backend=be, fullgraph=True)
        _, (fwd, bwd) = run_and_get_code(lambda: fn(q, k, v).sum().backward())
    assert blocks_without_overlap(fwd) == [] and blocks_without_overlap(bwd) == []
