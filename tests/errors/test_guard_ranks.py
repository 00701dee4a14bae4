"""The token guard and the batch check on real ranks (2 gloo ranks, one RankPool for the module): every refusal
on every rank, never a hang or a silently wrong result.

- graphs without attention (issue 45): a cumsum or conv1d over the sequence in a separately compiled function fed
  shard_batch's tokens is refused; an MLP and a norm there run like one process;
- HF's dynamic RoPE without fullgraph (each rank's max(position_ids) would pick its own frequencies);
- the run-time batch check (regions/batch_check.py, issues 43 and 44): a batch sharded for another layout, positions
  of the local length, a forgotten shard_batch (with and without positions, the plain model and an HF model) are
  one error on every rank; a sharded batch runs, and check_batch=False lets a bad one through.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import cpcompile
from cpcompile.testing.distributed import RankPool
from cpcompile.testing.model import TinyConfig, TinyLlama
from tests.errors.test_token_guard_breaks import B, H, L, conv_over_sequence, running_sum


def _cp_error_of(e: BaseException) -> BaseException | None:
    while e is not None and not isinstance(e, cpcompile.CPCompileError):
        e = e.__cause__ or e.__context__
    return e


@pytest.fixture(scope="module")
def ranks2():
    pool = RankPool(2)
    yield pool
    pool.close()


def _hf_rope(rank: int, world: int, rope_type: str) -> str:
    """HF Llama with `rope_type` RoPE, compiled without fullgraph on the CP ranks against one process: the
    error on this rank, or the largest relative error of logits and summed gradients."""
    import transformers as T

    def build(impl):
        cfg = T.LlamaConfig(
            vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=16,
            rope_parameters={"rope_type": rope_type, "factor": 2.0, "rope_theta": 10000.0},
        )  # fmt: skip
        cfg._attn_implementation = impl
        torch.manual_seed(0)
        return T.LlamaForCausalLM(cfg).double().train()

    ids = torch.randint(3, 128, (1, 32), generator=torch.Generator().manual_seed(1))
    full = {"input_ids": ids, "labels": ids.clone()}
    ref = build("sdpa")
    out = ref(**full, use_cache=False)
    out.loss.backward()
    model = build("cpcompile")
    local = cpcompile.shard_batch(full, strategy="zigzag", hf_loss="causal_lm")
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=cpcompile.backend(strategy="zigzag", inner="eager"))
    try:
        got = compiled(**local, use_cache=False)
    except Exception as e:  # noqa: BLE001
        return str(_cp_error_of(e))
    got.loss.backward()
    logits = cpcompile.shard(out.logits.detach(), strategy="zigzag", seq_dim=1)
    errors = [((got.logits - logits).abs().max() / logits.abs().max()).item()]
    for p, q in zip(model.parameters(), ref.parameters()):
        dist.all_reduce(p.grad)
        errors.append(((p.grad - q.grad).abs().max() / q.grad.abs().max()).item())
    return f"error {max(errors):.3g}"


@pytest.mark.multirank
def test_hf_dynamic_rope_without_fullgraph_fails_every_rank(ranks2):
    """Each rank's max(position_ids) picks its own RoPE frequencies (logits 1e-3, grads 0.15 off unchecked)."""
    pytest.importorskip("transformers")
    for rank, msg in enumerate(ranks2.run(_hf_rope, "dynamic", timeout=600)):
        assert "node 'gt'" in msg and "in dynamic_frequency_update" in msg, (rank, msg)
        assert "max(position_ids)" in msg, (rank, msg)
    for rank, msg in enumerate(ranks2.run(_hf_rope, "linear", timeout=600)):  # the same breaks, no branch on max
        assert msg.startswith("error") and float(msg.split()[1]) < 1e-10, (rank, msg)


def _no_attention_graphs(rank: int, world: int) -> dict:
    """The issue-45 cases on real ranks (gloo, aot_eager, fp64): each graph without attention fed shard_batch's
    tokens; the refusal on this rank, or the token-local control's largest error against one process."""
    torch.manual_seed(0)
    batch = {"inputs_embeds": torch.randn(B, 4 * L, H, dtype=torch.float64)}
    local = cpcompile.shard_batch(batch, strategy="zigzag", position_ids=False)["inputs_embeds"]
    tokens = cpcompile.shard(batch["inputs_embeds"].float(), strategy="zigzag", seq_dim=1)  # conv_h's dtype
    found = {}
    for name, fn, dynamic in [("cumsum", running_sum, True), ("cumsum static", running_sum, False),
                              ("conv1d", conv_over_sequence, False)]:  # fmt: skip
        torch._dynamo.reset()
        try:
            torch.compile(fn, backend=cpcompile.backend(strategy="zigzag", inner="aot_eager"), dynamic=dynamic)(tokens)
            found[name] = "ran"
        except Exception as e:  # noqa: BLE001
            found[name] = str(_cp_error_of(e))
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(H, 2 * H), nn.GELU(), nn.Linear(2 * H, H), nn.RMSNorm(H)).double()
    reference = copy.deepcopy(model)
    full = reference(batch["inputs_embeds"])
    full.square().sum().backward()
    torch._dynamo.reset()
    out = torch.compile(model, backend=cpcompile.backend(strategy="zigzag", inner="aot_eager"))(local)
    out.square().sum().backward()
    errors = [(out - cpcompile.shard(full.detach(), strategy="zigzag", seq_dim=1)).abs().max().item()]
    for p, q in zip(model.parameters(), reference.parameters()):
        dist.all_reduce(p.grad)
        errors.append(((p.grad - q.grad).abs().max() / q.grad.abs().max()).item())
    found["control"] = max(errors)
    return found


@pytest.mark.multirank
def test_graphs_without_attention_on_every_rank(ranks2):
    """A cumsum (dynamic and static dims) and a conv1d over the sequence in graphs without attention are refused
    on every rank; an MLP and a norm there run like one process."""
    for rank, found in enumerate(ranks2.run(_no_attention_graphs, timeout=300)):
        for name, node in (("cumsum", "cumsum"), ("cumsum static", "cumsum"), ("conv1d", "conv1d")):
            assert f"node '{node}'" in found[name] and "mixes tokens" in found[name], (rank, name, found[name])
        assert found["control"] < 1e-12, (rank, found)


class NoPositions(nn.Module):
    """A model that takes no position ids: embeddings, causal SDPA, a head."""

    def __init__(self, vocab: int = 64, dim: int = 16) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(vocab, dim), nn.Linear(dim, vocab)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        q = x.unflatten(-1, (2, -1)).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, q, q, is_causal=True).transpose(1, 2).flatten(2)
        return self.head(y)


def _compiled(fn, inner="eager", check_batch=True):
    torch._dynamo.reset()
    be = cpcompile.backend(strategy="zigzag", inner=inner, check_batch=check_batch)
    return torch.compile(fn, backend=be, fullgraph=True)


def _outcome(compiled, *args, **kwargs) -> str:
    """ "ran", or the CPCompileError (BatchLayoutError at run time) of running `compiled`."""
    try:
        compiled(*args, **kwargs)
        return "ran"
    except Exception as e:  # noqa: BLE001
        err = _cp_error_of(e)
        return f"{type(err).__name__}: {err}" if err is not None else f"not cpcompile's: {e!r}"


def _batch_cases(rank: int, world: int) -> dict:
    """The issue-44 table's batch cases on this rank: each outcome. The model compiled for the sharded batch
    (aot_eager: the check traced) runs the run-time cases of the same shapes without recompiling."""
    torch.manual_seed(0)
    model = TinyLlama(TinyConfig(vocab=64, dim=16, layers=1, heads=2, kv_heads=1, hidden=32)).double()
    S = 16
    ids = torch.randint(0, 64, (2, S), generator=torch.Generator().manual_seed(1))  # the same on every rank
    zig = cpcompile.shard_batch({"input_ids": ids}, strategy="zigzag")
    flat = cpcompile.shard_batch({"input_ids": ids}, strategy="flat")
    whole = torch.arange(S).expand(2, S)
    local = torch.arange(S // world).expand(2, S // world)
    found = {"flat batch": _outcome(_compiled(model), flat["input_ids"], flat["position_ids"])}  # shard's marks
    compiled = _compiled(model, "aot_eager")
    found["sharded"] = _outcome(compiled, zig["input_ids"], zig["position_ids"])
    found["flat batch, marks lost"] = _outcome(compiled, flat["input_ids"].clone(), flat["position_ids"].clone())
    found["local positions"] = _outcome(compiled, zig["input_ids"], local)
    found["unsharded"] = _outcome(_compiled(model), ids, whole)
    found["unsharded, check off"] = _outcome(_compiled(model, check_batch=False), ids, whole)
    found["unsharded, no positions"] = _outcome(_compiled(NoPositions().double(), "aot_eager"), ids)
    from tests.support.hf_zoo import build

    found["hf unsharded"] = _outcome(_compiled(build("llama", "cpcompile")), input_ids=ids, position_ids=whole,
                                     use_cache=False)  # fmt: skip
    return found


@pytest.mark.multirank
def test_a_batch_that_does_not_fit_the_layout_fails_every_rank(ranks2):
    pytest.importorskip("transformers")
    for rank, found in enumerate(ranks2.run(_batch_cases, timeout=600)):
        assert found["sharded"] == found["unsharded, check off"] == "ran", (rank, found)
        assert "sharded by cpcompile.shard_batch / shard with strategy='flat'" in found["flat batch"], (rank, found)
        for case in ("flat batch, marks lost", "local positions", "unsharded", "hf unsharded"):
            said = found[case]
            assert said.startswith("BatchLayoutError: cpcompile: position_ids are not every token's GLOBAL"), (
                rank, case, said)  # fmt: skip
            assert "cpcompile.shard_batch(batch, strategy='zigzag'" in said, (rank, case, said)
        said = found["unsharded, no positions"]
        assert said.startswith("BatchLayoutError: cpcompile: every CP rank got the same tokens"), (rank, said)
        assert "shard_batch(batch, strategy='zigzag'" in said, (rank, said)
