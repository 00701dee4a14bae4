"""torchtitan's Llama3 (its smallest flavor, its own modules) trained under cpcompile or on one process.

Used by the torchtitan example and tests. Random init and synthetic tokens: nothing is downloaded. The CP run
shards each global batch with cpcompile.integrations.torchtitan.shard_batch. The single-process reference runs
the same model eagerly; for packed documents its VarlenAttention is swapped for `DocumentCausalSDPA` (varlen_attn
has no CPU kernel), which keeps VarlenAttention's bf16 inputs and attends under a mask built independently from
the positions, the way torchtitan's own document masks read them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

import cpcompile
from cpcompile.integrations.torchtitan import shard_batch

from .model import token_loss_sum
from .packed_training import chain_rows
from .training import TrainResult, sgd_step, train_result

FLAVOR = "debugmodel"
"""torchtitan's smallest Llama3 flavor: dim 256, 16 heads, 6 layers, vocab 2048."""
VOCAB = 2048


def llama3(attention: str, layers: int | None = None, seed: int = 0, device: torch.device | str = "cpu") -> nn.Module:
    """torchtitan's Llama3 `debugmodel`, built from its own config and modules, with its first `layers` layers.

    attention "varlen": torchtitan's VarlenAttention (packed documents). "sdpa": its ScaledDotProductAttention
    (causal over each row), set on every layer's config, since torchtitan 0.3.0 no longer offers "sdpa" by name
    for language models."""
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import llama3_configs

    if attention not in ("sdpa", "varlen"):
        raise ValueError(f"attention must be 'sdpa' or 'varlen', not {attention!r}")
    config = llama3_configs[FLAVOR](attn_backend="varlen")
    if layers is not None:
        config.layers = config.layers[:layers]
    if attention == "sdpa":
        for layer in config.layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    torch.manual_seed(seed)
    model = config.build()
    model.init_states()
    return model.to(device)


class DocumentCausalSDPA(nn.Module):
    """The single-process stand-in for torchtitan's VarlenAttention: the same bf16 inputs and bf16 output, fp32
    attention in between (as the varlen kernels compute), under `attention_masks`, a (B, 1, L, L) bool mask."""

    def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks, scale=None, enable_gqa=False, **kwargs):
        q, k, v = (t.transpose(1, 2).to(torch.bfloat16).float() for t in (q_BLNH, k_BLNH, v_BLNH))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_masks, scale=scale, enable_gqa=enable_gqa)
        return out.to(torch.bfloat16).transpose(1, 2).to(q_BLNH.dtype)


def use_document_sdpa(model: nn.Module) -> nn.Module:
    """Swap every layer's VarlenAttention for DocumentCausalSDPA (in place); returns the model."""
    for layer in model.layers.values():
        layer.attention.inner_attention = DocumentCausalSDPA()
    return model


def document_causal_mask(positions: torch.Tensor) -> torch.Tensor:
    """(B, 1, L, L) bool: causal within each document, a document starting where a position is 0 or a row
    starts (torchtitan's get_document_mask_mod with its causal mask)."""
    starts = positions == 0
    starts[:, 0] = True
    doc = torch.cumsum(starts.int(), dim=1)
    length = positions.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=positions.device).tril()
    return ((doc[:, :, None] == doc[:, None, :]) & causal)[:, None]


def titan_batches(steps: int, batch: int, seq: int, *, documents: bool, seed: int = 0) -> list[dict]:
    """Learnable synthetic batches (tokens, labels, positions), each (batch, seq), over torchtitan's vocab;
    documents=True packs random documents into each row (positions restart at 0 at each)."""
    return chain_rows(VOCAB, steps, batch, seq, documents=documents, seed=seed)


def train_titan(
    batches: list[dict],
    *,
    attention: str,
    strategy: str | None = None,
    comm: str = "all_gather",
    inner: str = "aot_eager",
    layers: int | None = None,
    lr: float = 0.1,
    max_documents: int | None = None,
    device: torch.device | str = "cpu",
    on_step: Callable[[int, float, int], None] | None = None,
) -> TrainResult:
    """Train torchtitan's Llama3 on `batches`: on one process (eager) when strategy is None, else with CP over
    the default group. on_step(step, loss, padding) after each step."""
    model = llama3(attention, layers, device=device)
    opt = torch.optim.SGD(model.parameters(), lr=lr)  # plain SGD: weight error tracks gradient error
    backend = None
    if strategy is None:
        if attention == "varlen":
            use_document_sdpa(model)
        step_model = model
    else:
        torch._dynamo.reset()  # a fresh compile: an earlier model's shapes would make these dims dynamic
        backend = cpcompile.backend(strategy=strategy, comm=comm, inner=inner)
        step_model = torch.compile(model, backend=backend, fullgraph=True)
    losses = []
    for i, full in enumerate(batches):
        full = {k: v.to(device) for k, v in full.items()}
        padding = 0
        if strategy is None:
            masks = document_causal_mask(full["positions"]) if attention == "varlen" else None
            logits = step_model(full["tokens"], full["positions"], masks)
            labels, n_tokens = full["labels"], int((full["labels"] != -100).sum())
        else:
            part = shard_batch(model, **full, strategy=strategy, max_documents=max_documents)
            logits = step_model(**part.inputs)
            labels, n_tokens, padding = part.labels, part.num_tokens, part.padding
        loss = token_loss_sum(logits, labels) / n_tokens
        losses.append(sgd_step(model, opt, loss, sharded=strategy is not None))
        if on_step is not None:
            on_step(i, losses[-1], padding)
    return train_result(model, losses, backend)
