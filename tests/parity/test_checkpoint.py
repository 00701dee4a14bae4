"""Attention inside higher-order-op bodies: activation checkpointing (both torch.utils.checkpoint APIs, and
torchtitan's order: checkpoint_wrapper per block, then compile per block) and torch.cond, on 2 gloo ranks.

Without the pass searching those bodies, every rank attended to its own tokens only (logits off by 0.2-0.5).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F

import cpcompile
from cpcompile.testing.distributed import run_ranks
from cpcompile.testing.model import TinyConfig, TinyLlama, token_loss_sum
from cpcompile.testing.varlen_model import VarlenTinyLlama, document_position_ids
from tests.support.parity import max_err
from tests.support.thd_parity import cu_of

CFG = TinyConfig(vocab=64, dim=32, layers=2, heads=4, kv_heads=2, hidden=64)
SEQ = 16


def _compile(model, be, mode: str):
    """The model compiled whole (checkpoint inside it), or torchtitan's way: each block wrapped by
    checkpoint_wrapper, then compiled on its own."""
    if mode != "titan":
        return torch.compile(model, backend=be, fullgraph=True)
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for i, block in enumerate(model.blocks):
        wrapped = checkpoint_wrapper(block)
        wrapped.compile(backend=be, fullgraph=True)
        model.blocks[i] = wrapped
    return model


def _grads(model) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g)  # each rank's grads come from its own tokens
        out[name.replace("._checkpoint_wrapped_module", "")] = g
    return out


def _dense(rank, world, mode, strategy):
    torch.manual_seed(0)
    cfg = dataclasses.replace(CFG, checkpoint=None if mode == "titan" else mode)
    ref = TinyLlama(CFG).double()
    cp_model = TinyLlama(cfg).double()
    cp_model.load_state_dict(ref.state_dict())
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, CFG.vocab, (2, SEQ), generator=g)
    labels = torch.randint(0, CFG.vocab, (2, SEQ), generator=g)
    pos = torch.arange(SEQ).expand(2, SEQ)
    ref_logits = ref(ids, pos)
    token_loss_sum(ref_logits, labels).backward()
    be = cpcompile.backend(strategy=strategy, inner="aot_eager")
    torch._dynamo.reset()
    compiled = _compile(cp_model, be, mode)
    local = cpcompile.shard_batch({"input_ids": ids, "labels": labels, "position_ids": pos}, strategy=strategy)
    logits = compiled(local["input_ids"], local["position_ids"])
    token_loss_sum(logits, local["labels"]).backward()
    full = cpcompile.unshard(logits.detach(), strategy=strategy, seq_dim=1)
    grads = _grads(cp_model)
    return {
        "sites": len(be.plans),
        "logits": max_err(full, ref_logits.detach()),
        "grads": max(max_err(grads[n], p.grad) for n, p in ref.named_parameters()),
    }


def _packed(rank, world, mode, strategy):
    lengths = [3, 9, 1, 11] if strategy == "thd" else [4, 8, 12]
    cu = cu_of(lengths)
    total = int(cu[-1])
    torch.manual_seed(0)
    cfg = dataclasses.replace(CFG, checkpoint=None if mode == "titan" else mode)
    ref = VarlenTinyLlama(CFG, causal=True, max_len=total).double().use_per_document_sdpa()
    cp_model = VarlenTinyLlama(cfg, causal=True, max_len=total).double()
    cp_model.load_state_dict(ref.state_dict())
    g = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(0, CFG.vocab, (total,), generator=g), torch.randint(0, CFG.vocab, (total,), generator=g)
    pos = document_position_ids(cu)
    ref_logits = ref(ids, pos, cu)
    token_loss_sum(ref_logits[None], labels[None]).backward()
    be = cpcompile.backend(strategy=strategy, inner="aot_eager")
    torch._dynamo.reset()
    compiled = _compile(cp_model, be, mode)
    batch = {"input_ids": ids, "labels": labels, "position_ids": pos, "cu_seqlens": cu}
    local = cpcompile.shard_batch(batch, strategy=strategy, seq_dim=0)
    logits = compiled(local["input_ids"], local["position_ids"], cu)
    token_loss_sum(logits[None], local["labels"][None]).backward()
    full = cpcompile.unshard(logits.detach(), strategy=strategy, seq_dim=0, cu_seqlens=cu)
    grads = _grads(cp_model)
    return {
        "sites": len(be.plans),
        "logits": max_err(full, ref_logits.detach()),
        "grads": max(max_err(grads[n], p.grad) for n, p in ref.named_parameters()),
    }


def _sweep(rank, world):
    out = {}
    for mode in ("non_reentrant", "reentrant", "titan"):
        out[("dense", mode)] = _dense(rank, world, mode, "zigzag")
    for mode in ("non_reentrant", "titan"):
        out[("thd", mode)] = _packed(rank, world, mode, "thd")
    out[("thd_zigzag", "non_reentrant")] = _packed(rank, world, "non_reentrant", "thd_zigzag")
    return out


def test_checkpointed_blocks_train_with_cp():
    """Per-block checkpointing with both checkpoint APIs and the compile-per-block order, dense and packed:
    logits and parameter grads match one process (fp64), and every block's attention was rewritten."""
    failures = []
    for rank, results in enumerate(run_ranks(_sweep, 2, timeout=400)):
        for case, r in results.items():
            # compiled per block, the blocks share one compiled graph (same code, same shapes): one site
            expected = 1 if case[1] == "titan" else CFG.layers
            if r["sites"] != expected:
                failures.append(f"rank {rank} {case}: {r['sites']} sites rewritten, expected {expected}")
            for what in ("logits", "grads"):
                if not r[what] <= 1e-9:
                    failures.append(f"rank {rank} {case}: {what} error {r[what]:.3g}")
    assert not failures, "\n".join(failures)


def _attn(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _cond_model(q, k, v, flag):
    return torch.cond(flag.sum() > 0, lambda q, k, v: _attn(q, k, v), lambda q, k, v: 2 * _attn(q, k, v), (q, k, v))


def _cond(rank, world, agree: bool):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 8, generator=g, dtype=torch.float64) for _ in range(3))
    flag = torch.tensor([1.0 if (agree or rank == 0) else -1.0])
    ref = _cond_model(q, k, v, flag if agree else torch.tensor([1.0]))
    shard = lambda t: cpcompile.shard(t, strategy="zigzag", seq_dim=2)  # noqa: E731
    be = cpcompile.backend(strategy="zigzag", inner="aot_eager")
    torch._dynamo.reset()
    try:
        out = torch.compile(_cond_model, backend=be, fullgraph=True)(shard(q), shard(k), shard(v), flag)
    except RuntimeError as e:
        return {"sites": len(be.plans), "error": str(e)}
    return {"sites": len(be.plans), "err": max_err(out, shard(ref))}


def test_cond_branches_are_rewritten():
    """Attention in both branches of a torch.cond is rewritten (2 sites) and matches one process."""
    for r in run_ranks(_cond, 2, True, timeout=300):
        assert r["sites"] == 2 and r["err"] <= 1e-12, r


def test_cond_that_differs_between_ranks_fails_on_every_rank():
    """Ranks that would take different branches get one clear error each, not a hang or a wrong answer."""
    for r in run_ranks(_cond, 2, False, timeout=300):
        assert "condition of a torch.cond around attention differs between CP ranks" in r.get("error", ""), r
