"""FSDP2 x CP on a 2-D (dp=2, cp=2) mesh trains TinyLlama exactly like one process on the whole batch.

Two gradient-reduction recipes, both exact (fp64, several SGD steps: losses, last grads, final params):
- "flat_mesh" (torchtitan's): plain local tokens; fully_shard over the flattened dp*cp mesh, so FSDP's
  reduce-scatter sums the partial grads of the cp ranks and the dp replicas in one collective.
- "dtensor": DTensor inputs Shard(1) on the cp mesh, parameters Replicate on the cp mesh, fully_shard over dp.
  DTensor marks the parameter grads Partial over cp; FSDP2 redistributes them to Replicate (all-reduce over cp)
  and then reduce-scatters over dp.
Either way FSDP must sum, not average: set_gradient_divide_factor(1.0) on every FSDP module, and each rank's
loss is its token-loss sum over the GLOBAL token count.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import distribute_module
from torch.distributed.tensor.experimental import implicit_replication

import cpcompile
from cpcompile.testing.distributed import run_ranks
from cpcompile.testing.model import TinyLlama, token_loss_sum

DP, CP, BATCH, SEQ, STEPS, LR = 2, 2, 2, 16, 3, 0.5


def _data():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (DP * BATCH, SEQ), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full((DP * BATCH, 1), -100)], 1)
    labels[0, :5] = -100  # uneven valid tokens across ranks: the global count must be used
    return ids, labels, torch.arange(SEQ).expand(DP * BATCH, SEQ)


def _train(model, step_loss):
    """SGD for STEPS steps; returns (global losses, last grads, final params) as full tensors."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        loss = step_loss()
        loss.backward()
        losses.append(loss.detach().clone())
        grads = {k: p.grad for k, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    return losses, grads, dict(model.named_parameters())


def _reference():
    torch.manual_seed(0)
    model = TinyLlama().double()
    ids, labels, pos = _data()
    count = (labels != -100).sum()
    losses, grads, params = _train(model, lambda: token_loss_sum(model(ids, pos), labels) / count)
    return [x.item() for x in losses], grads, {k: p.detach() for k, p in params.items()}


def _fsdp(module, mesh):
    for block in module.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(module, mesh=mesh)
    for m in module.modules():
        if hasattr(m, "set_gradient_divide_factor"):
            m.set_gradient_divide_factor(1.0)  # sum over ranks: each rank's loss is already / global count


def _run_recipe(recipe: str, mesh) -> dict:
    torch.manual_seed(0)
    model = TinyLlama().double()
    be = cpcompile.backend(strategy="flat", mesh=mesh if recipe != "dtensor" else None, inner="aot_eager")
    if recipe == "dtensor":
        distribute_module(model, mesh["cp"])  # parameters Replicate over cp
    if recipe != "whole_model":
        for block in model.blocks:
            block.compile(backend=be, fullgraph=True)  # compile per block, then shard: the torchtitan order
    _fsdp(model, mesh["dp"] if recipe == "dtensor" else mesh["dp", "cp"]._flatten("dp_cp"))
    compiled = torch.compile(model, backend=be) if recipe == "whole_model" else model
    ids, labels, pos = _data()
    count = (labels != -100).sum()
    mine = slice(mesh.get_local_rank("dp") * BATCH, (mesh.get_local_rank("dp") + 1) * BATCH)
    cp_mesh = mesh["cp"] if recipe == "dtensor" else mesh
    batch = {"input_ids": ids[mine], "labels": labels[mine], "position_ids": pos[mine]}
    local = cpcompile.shard_batch(batch, strategy="flat", mesh=cp_mesh)
    if recipe == "dtensor":
        as_dt = dict(strategy="flat", seq_dim=1, mesh=cp_mesh, as_dtensor=True)
        local["input_ids"] = cpcompile.shard(batch["input_ids"], **as_dt)
        local["position_ids"] = cpcompile.shard(batch["position_ids"], **as_dt)

    def step_loss():
        with implicit_replication():  # rope's plain torch.arange meets DTensor activations (dtensor recipe)
            logits = compiled(local["input_ids"], local["position_ids"])
        if recipe == "dtensor":
            logits = logits.to_local()
        return token_loss_sum(logits, local["labels"]) / count

    losses, grads, params = _train(model, step_loss)
    for loss in losses:
        dist.all_reduce(loss)  # sum of the ranks' shares = the global mean loss
    ref_losses, ref_grads, ref_params = _reference()
    strip = lambda k: k.replace("_orig_mod.", "")  # noqa: E731
    return {
        "plans": len(be.plans),
        "losses": max(abs(a.item() - b) for a, b in zip(losses, ref_losses)),
        "grads": max((g.full_tensor() - ref_grads[strip(k)]).abs().max().item() for k, g in grads.items()),
        "params": max((p.detach().full_tensor() - ref_params[strip(k)]).abs().max().item() for k, p in params.items()),
    }


def _recipes(rank, world):
    mesh = init_device_mesh("cpu", (DP, CP), mesh_dim_names=("dp", "cp"))
    out = {}
    for recipe in ("flat_mesh", "dtensor", "whole_model"):
        torch._dynamo.reset()
        out[recipe] = _run_recipe(recipe, mesh)
    return out


def test_fsdp2_2d_mesh_matches_single_process():
    failures = []
    for rank, results in enumerate(run_ranks(_recipes, DP * CP, timeout=600)):
        for recipe, r in results.items():
            # the loss is summed in fp32 (token_loss_sum), everything else is fp64
            if not (r["plans"] >= 1 and r["losses"] < 1e-5 and r["grads"] < 1e-12 and r["params"] < 1e-12):
                failures.append(f"rank {rank} {recipe}: {r}")
    assert not failures, "\n".join(failures)
