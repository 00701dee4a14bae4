"""GPU: HF hybrids' token mixers on CUDA, declared by attn_implementation="cpcompile" itself (hf_hybrid builds them
out of the box), through transformers' torch fallbacks (neither mamba_ssm nor fla-core is on the GPU machine): Jamba
(causal conv, Mamba1 selective scan with B/C all-gathered whole, MoE) and Qwen3-Next (causal conv, gated delta rule,
MoE); Bamba, FalconH1 (attention and Mamba2 side by side), Zamba2 (its shared attention block) and GraniteMoeHybrid
(Mamba2, MoE); fp32, 2 gloo ranks sharing the GPU (tests/gpu/test_gpu.py's host hop), zigzag all_gather: logits, the
loss and every parameter gradient against the same model on one GPU.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import cpcompile
from cpcompile.testing.distributed import run_ranks
from tests.gpu.test_gpu import _rank_setup
from tests.support.parity import rel_err

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

FP32_TOL = 1e-4  # relative to the largest reference value: fp32 on both sides, TF32 off
SEQ, BATCH, VOCAB = 16, 2, 32


def _hybrids(rank, world, names):
    _rank_setup()
    torch.backends.cudnn.allow_tf32 = False  # the causal conv: fp32 against fp32
    from tests.support.hybrid import hf_hybrid

    results = {}
    for name in names:
        torch.manual_seed(0)
        model = hf_hybrid(name, world, VOCAB, attn_head_dim=16).cuda()  # flex_softcap: fp32, head dims >= 16
        g = torch.Generator().manual_seed(1)
        ids, labels = (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g).cuda() for _ in range(2))
        positions = torch.arange(SEQ, device="cuda").expand(BATCH, SEQ)
        cp_model = copy.deepcopy(model)
        logits = model(ids, positions)
        F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum").div(labels.numel()).backward()

        def local(x):
            return cpcompile.shard(x, strategy="zigzag", seq_dim=1)

        be = cpcompile.backend(strategy="zigzag", comm="all_gather", inner="aot_eager")
        torch._dynamo.reset()
        out = torch.compile(cp_model, backend=be, fullgraph=True)(local(ids), local(positions))
        cp_loss = F.cross_entropy(out.flatten(0, 1), local(labels).flatten(), reduction="sum") / labels.numel()
        cp_loss.backward()
        summed = cp_loss.detach().cpu()
        dist.all_reduce(summed)  # through host memory (gloo)
        ref_loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / labels.numel()
        errors = {
            "logits": rel_err(out.detach().cpu(), local(logits.detach()).cpu()),
            "loss": rel_err(summed, ref_loss.cpu()),
        }
        grads = dict(model.named_parameters())
        for n, p in cp_model.named_parameters():
            if p.grad is None:  # an expert no token was routed to, in both runs
                assert grads[n].grad is None, n
                continue
            total = p.grad.detach().cpu()
            dist.all_reduce(total)
            errors[n] = rel_err(total, grads[n].grad.cpu())
        results[name] = errors
    return results


@pytest.mark.multirank
def test_gpu_hf_hybrids_match_one_gpu(monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.setenv("CPCOMPILE_TEST_PG_TIMEOUT", "300")
    _check(run_ranks(_hybrids, 2, ("jamba", "qwen3_next"), timeout=420))


@pytest.mark.multirank
def test_gpu_hf_mamba2_hybrids_match_one_gpu(monkeypatch):
    """The Mamba2 hybrids, declared out of the box: Bamba, FalconH1, Zamba2, GraniteMoeHybrid."""
    pytest.importorskip("transformers")
    monkeypatch.setenv("CPCOMPILE_TEST_PG_TIMEOUT", "300")
    _check(run_ranks(_hybrids, 2, ("bamba", "falcon_h1", "zamba2", "granitemoehybrid"), timeout=420))


def _check(reports) -> None:
    for rank, results in enumerate(reports):
        for name, errors in results.items():
            assert any("conv1d" in n for n in errors), (name, sorted(errors))
            bad = {n: e for n, e in errors.items() if not e <= FP32_TOL}
            assert not bad, f"rank {rank} {name}: {bad}"
