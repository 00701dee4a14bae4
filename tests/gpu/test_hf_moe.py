"""GPU: an HF MoE model's aux loss (output_router_logits=True) under CP on CUDA: the experts' counts summed over the
CP group (cpcompile::rank_total's all-gather, through host memory for 2 gloo ranks sharing the GPU), each rank
returning its share; Qwen3-MoE, fp32 (HF's batched_mm experts), batch 2, zigzag all_gather, the aux loss in the loss
with coefficient 1: the summed loss, aux loss and every parameter gradient against one GPU running transformers' own
load_balancing_loss_func."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist

import cpcompile
from cpcompile.testing.distributed import run_ranks
from tests.gpu.test_gpu import _rank_setup
from tests.support.parity import rel_err

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

FP32_TOL = 1e-4  # relative to the largest reference value: fp32 on both sides, TF32 off


def _aux_loss(rank, world):
    _rank_setup()
    torch.backends.cuda.matmul.allow_tf32 = False
    from cpcompile.integrations.hf_moe import original
    from tests.support.hf_zoo import batch, build

    config = dict(output_router_logits=True, router_aux_loss_coef=1.0, _experts_implementation="batched_mm")
    full = {k: v.cuda() for k, v in batch("qwen3_moe", 2, 32).items()}
    model = build("qwen3_moe", "cpcompile", dtype=torch.float32, **config).cuda()
    modeling = sys.modules[type(model).__module__]
    ours, modeling.load_balancing_loss_func = modeling.load_balancing_loss_func, original(modeling.__name__)
    try:
        reference = build("qwen3_moe", "sdpa", dtype=torch.float32, **config).cuda()
        ref = reference(**full, use_cache=False)
        ref.loss.backward()
    finally:
        modeling.load_balancing_loss_func = ours
    local = cpcompile.shard_batch(full, strategy="zigzag", hf_loss="causal_lm")
    be = cpcompile.backend(strategy="zigzag", inner="aot_eager")
    out = torch.compile(model, backend=be, fullgraph=True)(**local, use_cache=False)
    out.loss.backward()
    totals = torch.stack([out.loss.detach(), out.aux_loss.detach()]).cpu()
    dist.all_reduce(totals)  # through host memory (gloo)
    errors = {"loss": rel_err(totals[0], ref.loss.detach().cpu()), "aux_loss": rel_err(totals[1], ref.aux_loss.cpu())}
    grads = dict(reference.named_parameters())
    for n, p in model.named_parameters():
        assert (p.grad is None) == (grads[n].grad is None), n
        if p.grad is not None:
            total = p.grad.detach().cpu()
            dist.all_reduce(total)
            errors[n] = rel_err(total, grads[n].grad.cpu())
    return errors


@pytest.mark.multirank
def test_gpu_hf_moe_aux_loss_matches_one_gpu(monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.setenv("CPCOMPILE_TEST_PG_TIMEOUT", "300")
    for rank, errors in enumerate(run_ranks(_aux_loss, 2, timeout=420)):
        assert any("gate" in n for n in errors), sorted(errors)
        bad = {n: e for n, e in errors.items() if not e <= FP32_TOL}
        assert not bad, f"rank {rank}: {bad}"
