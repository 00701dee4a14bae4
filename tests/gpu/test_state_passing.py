"""GPU: state passing (hf_token_mixers(model, comm="state")) on CUDA through transformers' torch fallbacks: HF
Qwen3-Next's causal conv (a halo from the previous rank) and gated delta rule (chunk transitions all-gathered and
composed), MoE, fp32, 2 gloo ranks sharing the GPU (tests/gpu/test_gpu.py's host hop), all_gather attention, flat
and zigzag (two chunks a rank: the halo shifts and the transitions of both chunks): logits, the loss and every
parameter gradient against the same model on one GPU."""

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


def _qwen3_next(rank, world, strategy, mixer_layout="same"):
    _rank_setup()
    torch.backends.cudnn.allow_tf32 = False  # the causal conv: fp32 against fp32
    torch.backends.cuda.matmul.allow_tf32 = False
    from tests.support.hybrid import hf_hybrid

    torch.manual_seed(0)
    model = hf_hybrid("qwen3_next", world, VOCAB, attn_head_dim=16).cuda()  # flex_softcap: fp32, head dims >= 16
    assert len(cpcompile.hf_token_mixers(model, comm="state")) == 2
    seq = 20 if mixer_layout == "flat" else SEQ  # relayouts: 10 tokens a rank, a size no other dim has
    g = torch.Generator().manual_seed(1)
    ids, labels = (torch.randint(0, VOCAB, (BATCH, seq), generator=g).cuda() for _ in range(2))
    positions = torch.arange(seq, device="cuda").expand(BATCH, seq)
    cp_model = copy.deepcopy(model)
    logits = model(ids, positions)
    ref_loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / labels.numel()
    ref_loss.backward()

    def local(x):
        return cpcompile.shard(x, strategy=strategy, seq_dim=1)

    be = cpcompile.backend(strategy=strategy, comm="all_gather", inner="aot_eager", mixer_layout=mixer_layout)
    torch._dynamo.reset()
    out = torch.compile(cp_model, backend=be, fullgraph=True)(local(ids), local(positions))
    cp_loss = F.cross_entropy(out.flatten(0, 1), local(labels).flatten(), reduction="sum") / labels.numel()
    cp_loss.backward()
    summed = cp_loss.detach().cpu()
    dist.all_reduce(summed)  # through host memory (gloo)
    errors = {
        "logits": rel_err(out.detach().cpu(), local(logits.detach()).cpu()),
        "loss": rel_err(summed, ref_loss.detach().cpu()),
    }
    grads = dict(model.named_parameters())
    for n, p in cp_model.named_parameters():
        if p.grad is None:  # an expert no token was routed to, in both runs
            assert grads[n].grad is None, n
            continue
        total = p.grad.detach().cpu()
        dist.all_reduce(total)
        errors[n] = rel_err(total, grads[n].grad.cpu())
    return errors


@pytest.mark.multirank
@pytest.mark.parametrize("strategy", ["flat", "zigzag"])
def test_gpu_qwen3_next_state_passing_matches_one_gpu(monkeypatch, strategy):
    """SEQ=16 at 2 ranks: zigzag's chunks hold 4 tokens, more than the conv's 3-token halo."""
    pytest.importorskip("transformers")
    monkeypatch.setenv("CPCOMPILE_TEST_PG_TIMEOUT", "300")
    for rank, errors in enumerate(run_ranks(_qwen3_next, 2, strategy, timeout=420)):
        assert "model.model.layers.0.linear_attn.A_log" in errors, sorted(errors)
        bad = {n: e for n, e in errors.items() if not e <= FP32_TOL}
        assert not bad, f"rank {rank}: {bad}"


@pytest.mark.multirank
def test_gpu_qwen3_next_between_relayouts_matches_one_gpu(monkeypatch):
    """mixer_layout="flat" under zigzag: the GDN layer runs on flat chunks between two relayouts (the relayout
    region's uneven all-to-all, through the host hop here), the attention on zigzag; 20 tokens, 10 a rank."""
    pytest.importorskip("transformers")
    monkeypatch.setenv("CPCOMPILE_TEST_PG_TIMEOUT", "300")
    for rank, errors in enumerate(run_ranks(_qwen3_next, 2, "zigzag", "flat", timeout=420)):
        assert "model.model.layers.0.linear_attn.A_log" in errors, sorted(errors)
        bad = {n: e for n, e in errors.items() if not e <= FP32_TOL}
        assert not bad, f"rank {rank}: {bad}"


class _PackedGDN(torch.nn.Module):
    """Two GDN layers over packed documents (tests/support/gdn.py, conv and scan declared with
    documents="cu_seqlens"), no attention: (T,) ids and the GLOBAL cu_seqlens -> (T, vocab) logits."""

    def __init__(self) -> None:
        super().__init__()
        from tests.support.gdn import GDNLayer

        self.embed = torch.nn.Embedding(VOCAB, 32)
        self.layers = torch.nn.ModuleList(GDNLayer(32, 2, 8, 6, documents=True) for _ in range(2))
        self.head = torch.nn.Linear(32, VOCAB)

    def forward(self, ids, cu_seqlens):
        x = self.embed(ids)[None]
        for layer in self.layers:
            x = layer(x, cu_seqlens)
        return self.head(x[0])


def _packed_gdn(rank, world, device):
    """Packed documents under thd on `device` (the offsets on it too): fp32 against the same model on one device."""
    if device == "cuda":
        _rank_setup()
        torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    model = _PackedGDN().to(device)
    cu = torch.tensor([0, 3, 8, 9, 11, 16, 16], dtype=torch.int32, device=device)  # a start at the chunk edge
    g = torch.Generator().manual_seed(1)
    ids, labels = (torch.randint(0, VOCAB, (16,), generator=g).to(device) for _ in range(2))
    cp_model = copy.deepcopy(model)
    logits = model(ids, cu)
    F.cross_entropy(logits, labels, reduction="sum").backward()
    local = cpcompile.shard_batch(dict(input_ids=ids, labels=labels, cu_seqlens=cu), strategy="thd", seq_dim=0)
    be = cpcompile.backend(strategy="thd", comm="all_gather", inner="aot_eager")
    torch._dynamo.reset()
    out = torch.compile(cp_model, backend=be, fullgraph=True)(local["input_ids"], local["cu_seqlens"])
    F.cross_entropy(out, local["labels"], reduction="sum").backward()
    full = cpcompile.unshard(out.detach(), strategy="thd", seq_dim=0, cu_seqlens=cu)
    errors = {"logits": rel_err(full.cpu(), logits.detach().cpu())}
    grads = dict(model.named_parameters())
    for n, p in cp_model.named_parameters():
        total = p.grad.detach().cpu()
        dist.all_reduce(total)
        errors[n] = rel_err(total, grads[n].grad.cpu())
    return errors


@pytest.mark.multirank
def test_gpu_packed_documents_state_passing_matches_one_gpu(monkeypatch):
    """Packed documents (strategy thd): the per-chunk offsets, the carried-in document's mask and the carried-out
    document's index are traced tensor ops on the offsets' device (CUDA here), 2 ranks, fp32."""
    monkeypatch.setenv("CPCOMPILE_TEST_PG_TIMEOUT", "300")
    for rank, errors in enumerate(run_ranks(_packed_gdn, 2, "cuda", timeout=420)):
        assert len(errors) == 1 + len(list(_PackedGDN().parameters())), sorted(errors)
        bad = {n: e for n, e in errors.items() if not e <= FP32_TOL}
        assert not bad, f"rank {rank}: {bad}"
