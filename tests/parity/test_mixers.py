"""Multi-rank parity of declared token mixers (cpcompile.token_mixer) against one process: a hybrid model of a
depthwise causal conv + a chunked gated recurrence (head-parallel a2a regions) and a softmax attention layer;
the logits, the loss and every parameter gradient, fp64, gloo ranks, aot_eager. One pool of 4 ranks: cp=4, and
cp=2 as the "cp" dim of a (dp=2, cp=2) mesh."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import cpcompile
from cpcompile.testing.distributed import RankPool
from tests.support.hybrid import HybridModel

SEQ, BATCH, VOCAB = 16, 2, 32
TOL = 1e-9


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _compare(rank, world, cp, strategy, comm):
    mesh = init_device_mesh("cpu", (world // cp, cp), mesh_dim_names=("dp", "cp"))
    group = mesh.get_group("cp")
    torch.manual_seed(0)
    model = HybridModel(vocab=VOCAB).double()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    labels = torch.randint(0, VOCAB, (BATCH, SEQ))
    cp_model = copy.deepcopy(model)

    logits = model(ids)
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / labels.numel()
    loss.backward()

    def local(x):
        return cpcompile.shard(x, strategy=strategy, seq_dim=1, mesh=mesh)

    be = cpcompile.backend(strategy=strategy, comm=comm, mesh=mesh, inner="aot_eager")
    out = torch.compile(cp_model, backend=be, fullgraph=True)(local(ids))
    cp_loss = F.cross_entropy(out.flatten(0, 1), local(labels).flatten(), reduction="sum") / labels.numel()
    cp_loss.backward()
    summed = cp_loss.detach().clone()
    dist.all_reduce(summed, group=group)
    full = cpcompile.unshard(out.detach(), strategy=strategy, seq_dim=1, mesh=mesh)
    errors = {"logits": _rel(full, logits.detach()), "loss": _rel(summed, loss.detach())}
    grads = dict(model.named_parameters())
    for name, p in cp_model.named_parameters():
        dist.all_reduce(p.grad, group=group)
        errors[name] = _rel(p.grad, grads[name].grad)
    return errors


@pytest.fixture(scope="module")
def ranks4():
    pool = RankPool(4)
    yield pool
    pool.close()


@pytest.mark.parametrize("cp,strategy,comm", [(4, "zigzag", "all_gather"), (2, "zigzag", "a2a"), (2, "flat", "ring")])
def test_hybrid_model_matches_one_process(ranks4, cp, strategy, comm):
    for rank, errors in enumerate(ranks4.run(_compare, cp, strategy, comm, timeout=600)):
        assert len(errors) == 2 + len(list(HybridModel().parameters())), errors
        bad = {n: e for n, e in errors.items() if not e <= TOL}
        assert not bad, f"rank {rank}: {bad}"
