"""Train the packed-documents TinyLlama (varlen_attn) for a few steps with CP, or on one process, to compare.

Every batch is (rows, seq) token rows holding random documents (positions restart at 0 at each); the rows are
packed into one buffer with its GLOBAL cu_seqlens, padded for the layout to a fixed shape (integrations/rows.py),
so new documents never recompile. The single-process run attends document by document with SDPA (varlen_attn
has no CPU kernel).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

import cpcompile
from cpcompile.integrations.rows import pack_rows

from .model import TinyConfig, token_loss_sum
from .training import TrainResult, sgd_step, train_result
from .varlen_model import VarlenTinyLlama


def chain_rows(vocab: int, steps: int, rows: int, seq: int, *, documents: bool, seed: int = 0) -> list[dict]:
    """Learnable batches of tokens, labels, positions, each (rows, seq): token t+1 = (5t + 3) % vocab 90% of the
    time; the last label of a row is ignored (-100). documents=True cuts each row into random documents."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.empty(rows, seq + 1, dtype=torch.long)
        ids[:, 0] = torch.randint(0, vocab, (rows,), generator=g)
        noise = torch.rand(rows, seq, generator=g) < 0.1
        random_next = torch.randint(0, vocab, (rows, seq), generator=g)
        for t in range(seq):
            ids[:, t + 1] = torch.where(noise[:, t], random_next[:, t], (5 * ids[:, t] + 3) % vocab)
        labels = ids[:, 1:].clone()
        labels[:, -1] = -100
        positions = torch.arange(seq).repeat(rows, 1)
        if documents:
            for row in positions:
                start = 0
                while start < seq:
                    n = int(torch.randint(1, max(2, seq // 2), (1,), generator=g))
                    row[start : start + n] = torch.arange(min(n, seq - start))
                    start += n
        out.append({"tokens": ids[:, :-1], "labels": labels, "positions": positions})
    return out


def train_packed(
    cfg: TinyConfig,
    batches: list[dict],
    *,
    strategy: str | None = None,
    comm: str = "all_gather",
    inner: str = "aot_eager",
    lr: float = 0.5,
    seed: int = 0,
    max_documents: int | None = None,
    device: torch.device | str = "cpu",
    on_step: Callable[[int, float], None] | None = None,
) -> TrainResult:
    """Train VarlenTinyLlama (causal per document): single-process when strategy is None, else CP over the
    default group with strategy "thd", "thd_zigzag" or "thd_balanced" (whose per-batch plan rides in the
    cu_seqlens the model and shard get: plan_documents)."""
    device = torch.device(device)
    cp = dist.get_world_size() if strategy is not None else 1
    packed = [
        pack_rows(**b, strategy=strategy or "thd", cp=cp, max_documents=max_documents) for b in batches
    ]  # every batch has one shape, so one max_seqlen
    torch.manual_seed(seed)
    model = VarlenTinyLlama(cfg, causal=True, max_len=packed[0].max_seqlen).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    backend = None
    if strategy is None:
        step_model = model.use_per_document_sdpa()
    else:
        torch._dynamo.reset()
        backend = cpcompile.backend(strategy=strategy, comm=comm, inner=inner)
        step_model = torch.compile(model, backend=backend, fullgraph=True)
    losses = []
    for i, full in enumerate(packed):
        cu = full.cu_seqlens
        ids, labels, pos = full.tokens[0], full.labels[0], full.positions[0]
        if strategy is not None:
            cu = cpcompile.plan_documents(cu, strategy=strategy)  # thd, thd_zigzag: the offsets as they are
            ids, labels, pos = (
                cpcompile.shard(t, strategy=strategy, seq_dim=0, cu_seqlens=cu) for t in (ids, labels, pos)
            )
        logits = step_model(ids.to(device), pos.to(device), cu.to(device))
        loss = token_loss_sum(logits[None], labels.to(device)[None]) / full.num_tokens
        losses.append(sgd_step(model, opt, loss, sharded=strategy is not None))
        if on_step is not None:
            on_step(i, losses[-1])
    return train_result(model, losses, backend)
