"""Multi-rank parity of declared token mixers (cpcompile.token_mixer) against one process: a hybrid model of a
depthwise causal conv + a chunked gated recurrence (head-parallel a2a regions) and a softmax attention layer;
the logits, the loss and every parameter gradient, fp64, gloo ranks, aot_eager. One pool of 4 ranks: cp=4, cp=2
as the "cp" dim of a (dp=2, cp=2) mesh, cp=3 as a group of ranks 0-2 (6 mixer heads)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import cpcompile
from cpcompile.testing.distributed import RankPool
from tests.support.hybrid import HybridModel, hf_hybrid

SEQ, BATCH, VOCAB = 16, 2, 32
TOL = 1e-9
HF_TOL = 2e-6
"""HF's scans and decays run in fp32 inside an fp64 model (`.to(torch.float32)`, `A_log.float()`, `.float()`):
fp32 rounding (seen: up to 2.3e-7 of a gradient's largest value), not fp64's."""


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _compare(rank, world, cp, strategy, comm, name="hybrid"):
    torch._dynamo.reset()  # the pool's ranks compiled other lengths before: no automatic dynamic shapes
    torch.manual_seed(0)
    seq = SEQ
    if world % cp or name != "hybrid":  # ranks 0..cp-1 (every rank creates the group); the others idle
        group = dist.new_group(list(range(cp)))  # (HF models: no data-parallel replica, half the work at cp 2)
        if rank >= cp:
            return {}
        model = hf_hybrid(name, cp, VOCAB).double() if name != "hybrid" else None
        if model is None:  # cp=3: 6 heads, 12 tokens
            model, seq = HybridModel(vocab=VOCAB, heads=6, head_dim=4).double(), 12
        where = {"group": group}
    else:
        mesh = init_device_mesh("cpu", (world // cp, cp), mesh_dim_names=("dp", "cp"))
        group, where = mesh.get_group("cp"), {"mesh": mesh}
        model = HybridModel(vocab=VOCAB).double()
    ids = torch.randint(0, VOCAB, (BATCH, seq))
    labels = torch.randint(0, VOCAB, (BATCH, seq))
    cp_model = copy.deepcopy(model)
    positions = () if name == "hybrid" else (torch.arange(seq).expand(BATCH, seq),)

    logits = model(ids)
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / labels.numel()
    loss.backward()

    def local(x):
        return cpcompile.shard(x, strategy=strategy, seq_dim=1, **where)

    be = cpcompile.backend(strategy=strategy, comm=comm, inner="aot_eager", **where)
    out = torch.compile(cp_model, backend=be, fullgraph=True)(local(ids), *(local(p) for p in positions))
    cp_loss = F.cross_entropy(out.flatten(0, 1), local(labels).flatten(), reduction="sum") / labels.numel()
    cp_loss.backward()
    summed = cp_loss.detach().clone()
    dist.all_reduce(summed, group=group)
    full = cpcompile.unshard(out.detach(), strategy=strategy, seq_dim=1, **where)
    errors = {"logits": _rel(full, logits.detach()), "loss": _rel(summed, loss.detach())}
    grads = dict(model.named_parameters())
    for param, p in cp_model.named_parameters():
        if p.grad is None:  # an expert no token was routed to, in both runs (checked below)
            assert grads[param].grad is None, param
            continue
        dist.all_reduce(p.grad, group=group)
        errors[param] = _rel(p.grad, grads[param].grad)
    missing = {n for n, p in model.named_parameters() if p.grad is None}
    assert not missing or name != "hybrid", missing
    return {n: e for n, e in errors.items() if n not in missing}


@pytest.fixture(scope="module")
def ranks4():
    pool = RankPool(4)
    yield pool
    pool.close()


@pytest.mark.parametrize(
    "cp,strategy,comm", [(4, "zigzag", "all_gather"), (2, "flat", "a2a"), (3, "zigzag", "all_gather")]
)
def test_hybrid_model_matches_one_process(ranks4, cp, strategy, comm):
    for rank, errors in enumerate(ranks4.run(_compare, cp, strategy, comm, timeout=600)[:cp]):
        assert len(errors) == 2 + len(list(HybridModel().parameters())), errors
        bad = {n: e for n, e in errors.items() if not e <= TOL}
        assert not bad, f"rank {rank}: {bad}"


@pytest.mark.parametrize(
    "name,cp",
    [
        ("qwen3_next", 4),
        ("bamba", 2),
        ("granitemoehybrid", 2),
        ("falcon_h1", 4),
        ("zamba2", 2),
        ("nemotron_h", 2),
        ("jamba", 2),
    ],
)
def test_hf_hybrids_match_one_process(ranks4, name, cp):
    """HF hybrids on their torch fallbacks (causal_conv1d_fn and torch_chunk_gated_delta_rule or
    mamba2_chunk_scan, declared by cpcompile.hf_token_mixers) under zigzag with their own attention layer."""
    for rank, errors in enumerate(ranks4.run(_compare, cp, "zigzag", "all_gather", name, timeout=600)[:cp]):
        layer = {"qwen3_next": "linear_attn", "nemotron_h": "mixer"}.get(name, "mamba")
        assert f"model.model.layers.0.{layer}.conv1d.weight" in errors, sorted(errors)
        bad = {n: e for n, e in errors.items() if not e <= HF_TOL}
        assert not bad, f"rank {rank}: {bad}"
