"""torchtitan's Llama3 (its default FlexAttention, document masks from global positions) trained under cpcompile.

2 SGD steps of a 2-layer debugmodel on 2 gloo ranks (zigzag, all_gather, aot_eager) against the same model in one
process: logits, loss and every parameter after the steps. The mask is built once per batch for the GLOBAL
sequence with the model's own `get_attention_masks(positions)`, and each rank's model gets
`cpcompile.shard_block_mask` of it. Two substitutions, both for CPU only: torchtitan's compiled flex_attention and
create_block_mask run uncompiled (Inductor has no CPU flex backward; the compiled mask builder would cost an
Inductor compile per rank), and torch's CPU backward gate is lifted (tests/support/flex.py).
"""

from __future__ import annotations

import pytest
import torch

import cpcompile
from cpcompile.testing.distributed import run_ranks
from tests.support.flex import cpu_flex_backward

pytest.importorskip("torchtitan")

SEQ = 512  # zigzag at cp=2: chunks of 128 tokens, whole blocks of torchtitan's 128-token BlockMask
DOCS = (100, 250, 162)
STEPS = 2


def _model():
    from torchtitan.models.llama3 import model_registry

    config = model_registry("debugmodel").model
    config.layers = config.layers[:2]
    torch.manual_seed(0)
    model = config.build()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.05)
    return model


def _uncompiled_flex():
    """torchtitan's compiled flex_attention and mask builder, uncompiled (see the module docstring); its RoPE
    marked token-local (the token guard cannot analyse its `rope_cache[positions]`: DTensor has no rule for it)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    from torchtitan.models.common import attention, decoder
    from torchtitan.models.common.rope import ComplexRoPE

    cpcompile.mark_token_local(ComplexRoPE)
    attention.FlexAttention._compiled_flex_attn = flex_attention
    decoder.create_attention_mask = create_block_mask


def _batch(step: int):
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, 2048, (1, SEQ + 1), generator=g)
    positions = torch.cat([torch.arange(n) for n in DOCS]).unsqueeze(0)
    return tokens[:, :-1], tokens[:, 1:], positions


def _train(model, forward, shard, world: int):
    """STEPS SGD steps; (logits of step 0 in this rank's layout, losses, parameters after)."""
    import torch.distributed as dist

    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    logits0, losses = None, []
    for step in range(STEPS):
        tokens, labels, positions = _batch(step)
        mask = model.get_attention_masks(positions)  # the GLOBAL sequence's BlockMask, as on one GPU
        logits = forward(shard(tokens), shard(positions), mask)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), shard(labels).flatten(), reduction="sum") / SEQ
        loss.backward()
        if world > 1:
            for p in model.parameters():
                dist.all_reduce(p.grad)
            loss = loss.detach().clone()
            dist.all_reduce(loss)
        opt.step()
        opt.zero_grad()
        logits0 = logits.detach() if logits0 is None else logits0
        losses.append(loss.item())
    return logits0, losses, [p.detach().clone() for p in model.parameters()]


def _rank(rank, world):
    _uncompiled_flex()
    with cpu_flex_backward():
        ref_model = _model()
        ref = _train(ref_model, lambda t, p, m: ref_model(t, p, attention_masks=m), lambda t: t, 1)
        model = _model()
        be = cpcompile.backend(strategy="zigzag", inner="aot_eager")
        compiled = torch.compile(model, backend=be, fullgraph=True)

        def shard(t):
            return cpcompile.shard(t, strategy="zigzag", seq_dim=1)

        def forward(tokens, positions, mask):
            return compiled(tokens, positions, attention_masks=cpcompile.shard_block_mask(mask, strategy="zigzag"))

        got = _train(model, forward, shard, world)
    sites = sorted({p.site.kind for p in be.plans})
    logits_err = (got[0] - shard(ref[0])).abs().max().item()
    params_err = max((a - b).abs().max().item() for a, b in zip(got[2], ref[2]))
    loss_err = max(abs(a - b) for a, b in zip(got[1], ref[1]))
    return sites, len(be.plans), logits_err, loss_err, params_err


def test_torchtitan_llama3_flex_trains_under_cp():
    for sites, n_plans, logits_err, loss_err, params_err in run_ranks(_rank, 2, timeout=900):
        assert sites == ["flex"] and n_plans == 2, (sites, n_plans)  # both layers' flex_attention rewritten
        assert logits_err < 1e-4 and loss_err < 1e-5 and params_err < 1e-5, (logits_err, loss_err, params_err)
