"""Train TinyLlama for a few steps with CP, or on one process over the full sequence, to compare the two.

Both runs see the same batches and initial weights. With CP each rank feeds its shard of every batch,
normalises its loss by the GLOBAL token count and sums parameter gradients over the CP group, so the CP
losses and updated weights must equal the single-process ones.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

import cpcompile

from .model import TinyConfig, TinyLlama, token_loss_sum


@dataclass
class TrainResult:
    losses: list[float]
    params: dict[str, torch.Tensor]
    rewritten: int = 0


def sgd_step(model: torch.nn.Module, opt: torch.optim.Optimizer, loss: torch.Tensor, sharded: bool) -> float:
    """One optimizer step on this rank's share of the loss; under CP the grads and the loss are summed over
    ranks first (each rank's grads come from its own tokens only). Returns the whole batch's loss."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    total = loss.detach().clone()
    if sharded:
        for p in model.parameters():
            dist.all_reduce(p.grad)
        dist.all_reduce(total)
    opt.step()
    return total.item()


def train_result(model: torch.nn.Module, losses: list[float], backend) -> TrainResult:
    """The losses, a CPU fp32 copy of the trained parameters, and how many sites the backend rewrote."""
    params = {k: v.detach().float().cpu().clone() for k, v in model.named_parameters()}
    return TrainResult(losses, params, len(backend.plans) if backend else 0)


def make_batches(cfg: TinyConfig, steps: int, batch: int, seq: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Learnable token batches: a noisy chain where token t+1 = (5 * t + 3) % vocab 90% of the time.

    Labels are the next tokens (last position ignored); positions run 0..seq-1.
    """
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.empty(batch, seq + 1, dtype=torch.long)
        ids[:, 0] = torch.randint(0, cfg.vocab, (batch,), generator=g)
        noise = torch.rand(batch, seq, generator=g) < 0.1
        random_next = torch.randint(0, cfg.vocab, (batch, seq), generator=g)
        for t in range(seq):
            ids[:, t + 1] = torch.where(noise[:, t], random_next[:, t], (5 * ids[:, t] + 3) % cfg.vocab)
        labels = ids[:, 1:].clone()
        labels[:, -1] = -100
        out.append({"input_ids": ids[:, :-1], "labels": labels, "position_ids": torch.arange(seq).expand(batch, seq)})
    return out


def _tiny_logits(model: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids, position_ids)


MODELS = ("tiny", "hf-llama")
"""train(model=...): TinyLlama, or transformers' LlamaForCausalLM of the same sizes (testing/hf_llama.py)."""


def _model(cfg: TinyConfig, seed: int, dtype: torch.dtype, device: torch.device, model: str) -> torch.nn.Module:
    torch.manual_seed(seed)
    if model == "hf-llama":
        from .hf_llama import hf_llama

        return hf_llama(cfg).to(device=device, dtype=dtype)
    if model != "tiny":
        raise ValueError(f"model must be one of {MODELS}, not {model!r}")
    return TinyLlama(cfg).to(device=device, dtype=dtype)


def train(
    cfg: TinyConfig,
    batches: list[dict[str, torch.Tensor]],
    *,
    strategy: str | None = None,
    comm: str = "all_gather",
    inner: str = "aot_eager",
    lr: float = 0.5,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    on_step: Callable[[int, float], None] | None = None,
    model: str = "tiny",
) -> TrainResult:
    """Train `model` (see MODELS) on `batches`: single-process when strategy is None, else CP over the default
    group."""
    device = torch.device(device)
    forward = _tiny_logits
    if model == "hf-llama":
        from .hf_llama import hf_logits as forward
    model = _model(cfg, seed, dtype, device, model)
    opt = torch.optim.SGD(model.parameters(), lr=lr)  # plain SGD: weight error tracks gradient error
    backend = None
    if strategy is None:
        step_model = torch.compile(model, backend=inner, fullgraph=True)
    else:
        backend = cpcompile.backend(strategy=strategy, comm=comm, inner=inner)
        step_model = torch.compile(model, backend=backend, fullgraph=True)
    losses = []
    for i, full in enumerate(batches):
        n_tokens = int((full["labels"] != -100).sum())
        batch = full if strategy is None else cpcompile.shard_batch(full, strategy=strategy)
        batch = {k: v.to(device) for k, v in batch.items()}
        logits = forward(step_model, batch["input_ids"], batch["position_ids"])
        loss = token_loss_sum(logits, batch["labels"]) / n_tokens
        losses.append(sgd_step(model, opt, loss, sharded=strategy is not None))
        if on_step is not None:
            on_step(i, losses[-1])
    return train_result(model, losses, backend)
