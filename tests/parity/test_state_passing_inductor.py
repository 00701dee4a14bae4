"""State passing (token_mixer(comm="state")) under the default inner compiler, Inductor: every rank must issue the
same collectives in the same order, forward and backward, or gloo waits forever. Two Gated DeltaNet layers of one
shape (a causal conv with a halo, the gated delta rule with its transitions all-gathered), flat at cp 2 and zigzag
at cp 3, fp64, against one process: logits, loss and every parameter gradient. No attention layer, so Inductor's
peak-memory reordering stays on (the backend turns it off only around ring and all-gather attention).

The hang this guards against (fixed in mixers/state_region.py and passing.py): a rank with no tail to send (flat:
the last) sent zero padding; the two layers' shifts of the same zeros were one node to Inductor's CSE, so that
rank issued one shift fewer than the others. Tiny shapes (kernel 2: a 1-token halo, 2 tokens a chunk) keep the CPU
Inductor compiles short; the group's collectives time out after 60 s, so a hang fails."""

from __future__ import annotations

import copy
import datetime

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import cpcompile
from cpcompile.testing.distributed import RankPool
from tests.support.gdn import GDNLayer
from tests.support.parity import rel_err

BATCH, VOCAB, CHUNK = 2, 16, 2
TOL = 1e-9


class TwoGDN(nn.Module):
    """embed -> two GDN layers of one shape (kernel 2) -> head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.layers = nn.ModuleList([GDNLayer(16, 2, 4, 4, kernel=2) for _ in range(2)])
        self.head = nn.Linear(16, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _compare(rank, world, cp, strategy):
    torch._dynamo.reset()
    torch.manual_seed(0)
    # every rank creates it; ranks past cp idle. A collective that waits 60 s fails the test (a hang)
    group = dist.new_group(list(range(cp)), timeout=datetime.timedelta(seconds=60))
    if rank >= cp:
        return {}
    seq = CHUNK * cp * (2 if strategy == "zigzag" else 1)
    model = TwoGDN().double()
    ids = torch.randint(0, VOCAB, (BATCH, seq))
    labels = torch.randint(0, VOCAB, (BATCH, seq))
    cp_model = copy.deepcopy(model)
    loss = F.cross_entropy(model(ids).flatten(0, 1), labels.flatten(), reduction="sum") / labels.numel()
    loss.backward()

    def local(x):
        return cpcompile.shard(x, strategy=strategy, seq_dim=1, group=group)

    be = cpcompile.backend(strategy=strategy, inner="inductor", group=group)
    out = torch.compile(cp_model, backend=be, fullgraph=True)(local(ids))
    cp_loss = F.cross_entropy(out.flatten(0, 1), local(labels).flatten(), reduction="sum") / labels.numel()
    cp_loss.backward()
    summed = cp_loss.detach().clone()
    dist.all_reduce(summed, group=group)
    full = cpcompile.unshard(out.detach(), strategy=strategy, seq_dim=1, group=group)
    errors = {"logits": rel_err(full, model(ids).detach()), "loss": rel_err(summed, loss.detach())}
    grads = dict(model.named_parameters())
    for name, p in cp_model.named_parameters():
        dist.all_reduce(p.grad, group=group)
        errors[name] = rel_err(p.grad, grads[name].grad)
    return errors


@pytest.fixture(scope="module")
def ranks3():
    pool = RankPool(3)
    yield pool
    pool.close()


@pytest.mark.parametrize("strategy,cp", [("flat", 2), ("zigzag", 3)])
def test_state_passing_under_inductor_matches_one_process(ranks3, cp, strategy):
    """Flat at cp 2 (the hang above), zigzag at cp 3 (two shifts a layer, +1 and -1, chained; three ranks'
    different graphs). Each case is two to four minutes of CPU Inductor compiles on a loaded 2-core machine, so
    flat cp 3 and zigzag cp 2 (which pass too) are left to a manual run: add them to the list."""
    for rank, errors in enumerate(ranks3.run(_compare, cp, strategy, timeout=400)[:cp]):
        assert len(errors) == 2 + len(list(TwoGDN().parameters())), errors
        bad = {n: e for n, e in errors.items() if not e <= TOL}
        assert not bad, f"rank {rank}: {bad}"
