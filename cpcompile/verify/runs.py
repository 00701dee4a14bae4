"""The two runs verify() compares: the model whole in this process, and sharded through the compiled model on the
CP group. Each runs on its own deep copy, so the user's model (weights, grads, compiled caches) is untouched.

What a run yields (`Outcome`): the GLOBAL logits (the CP run unshards its own), the loss (the CP run sums its
ranks' losses) and every parameter gradient (the CP run sums them over the ranks, as training does).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..errors import CPCompileError
from ..mesh import CPGroup
from ..sharding import shard, unshard

Forward = Callable[[torch.nn.Module, Mapping[str, Any]], Any]
LossFn = Callable[[Any, Mapping[str, Any]], torch.Tensor]


@dataclass
class Outcome:
    logits: torch.Tensor | None
    loss: torch.Tensor | None
    grads: dict[str, torch.Tensor | None] = field(default_factory=dict)
    probe: torch.Tensor | None = None
    """The logits' weights in the loss when the model has no loss of its own (run_whole makes it)."""


@dataclass(frozen=True)
class Layout:
    """How the batch and the logits are cut: the backend's strategy, the CP group, the seq dims, the cu_seqlens
    shard/unshard take for packed documents (thd_balanced: the plan)."""

    strategy: str
    mesh: object
    group: object
    cp: CPGroup
    logits_seq_dim: int
    cu_seqlens: torch.Tensor | None

    def shard(self, x: torch.Tensor) -> torch.Tensor:
        return shard(x, strategy=self.strategy, seq_dim=self.logits_seq_dim, mesh=self.mesh, group=self.group,
                     cu_seqlens=self.cu_seqlens)  # fmt: skip

    def unshard(self, x: torch.Tensor) -> torch.Tensor:
        return unshard(x, strategy=self.strategy, seq_dim=self.logits_seq_dim, mesh=self.mesh, group=self.group,
                       cu_seqlens=self.cu_seqlens)  # fmt: skip


def logits_of(output: Any) -> torch.Tensor | None:
    """The logits of a model's output: the output itself when it is a tensor, else its `.logits` (HF)."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    return logits if isinstance(logits, torch.Tensor) else None


def make_probe(logits: torch.Tensor, seed: int) -> torch.Tensor:
    """Fixed random weights of the global logits' shape (fp64, seeded)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(logits.shape, generator=g, dtype=torch.float64).to(logits.device)


def own_loss(output: Any, batch: Mapping[str, Any], loss_fn: LossFn | None) -> torch.Tensor | None:
    """loss_fn(output, batch), else the output's own `.loss` (HF), else None."""
    if loss_fn is not None:
        return loss_fn(output, batch)
    loss = getattr(output, "loss", None)
    return loss if isinstance(loss, torch.Tensor) else None


def probe_loss(output: Any, probe: torch.Tensor | None) -> torch.Tensor:
    """The logits weighted by `probe` and summed, so that every logit reaches the gradients."""
    logits = logits_of(output)
    if logits is None or probe is None:
        raise CPCompileError(
            "verify: the model's output has no logits and no .loss, so there is nothing to compare. "
            "Fix: pass loss_fn=(output, batch) -> loss, or forward= returning the logits."
        )
    return (logits.double() * probe.to(logits.device)).sum()


def fresh_copy(model: torch.nn.Module, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """A deep copy of the model without gradients (in `dtype` when given)."""
    twin = copy.deepcopy(model)
    for p in twin.parameters():
        p.grad = None
    return twin if dtype is None else twin.to(dtype)


def cast_floats(batch: Mapping[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    return {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in batch.items()}


def run_whole(model: torch.nn.Module, batch: Mapping[str, Any], forward: Forward, loss_fn: LossFn | None,
              probe: torch.Tensor | None, seed: int) -> Outcome:  # fmt: skip
    """The model (a fresh copy) over the whole batch in this process, eager."""
    torch.manual_seed(seed)
    output = forward(model, batch)
    logits = logits_of(output)
    loss = own_loss(output, batch, loss_fn)
    if loss is None:
        probe = make_probe(logits, seed) if probe is None and logits is not None else probe
        loss = probe_loss(output, probe)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    return Outcome(None if logits is None else logits.detach(), loss.detach(), grads, probe)


def run_sharded(compiled: Callable, params: torch.nn.Module, local: Mapping[str, Any], forward: Forward,
                loss_fn: LossFn | None, probe: torch.Tensor | None, layout: Layout, seed: int) -> Outcome:  # fmt: skip
    """The compiled copy over this rank's share of the batch; losses and grads summed over the CP group, the
    logits gathered in global order."""
    torch.manual_seed(seed)
    output = forward(compiled, local)
    loss = own_loss(output, local, loss_fn)
    if loss is None:
        loss = probe_loss(output, None if probe is None else layout.shard(probe))
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total, group=layout.cp.group)
    grads: dict[str, torch.Tensor | None] = {}
    for name, p in params.named_parameters():
        if not p.requires_grad:
            continue
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(grad, group=layout.cp.group)  # every rank takes part, with or without a grad
        grads[name] = grad if p.grad is not None or grad.any() else None
    logits = logits_of(output)
    with torch.no_grad():
        whole = None if logits is None else layout.unshard(logits.detach())
    return Outcome(whole, total, grads)
