"""No false positives: the suite's models and Hugging Face models that use SDPA compile unchanged with the token
guard on (one process, fake CP group); HF eager attention is refused; attention rewritten inside a checkpointed
body (what find/rewrite will produce for higher-order ops) passes the guard, token mixing beside it does not."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import cpcompile
from cpcompile.guard import check_graph
from cpcompile.passes import find_attention_sites
from cpcompile.passes.plan import plan_site
from cpcompile.passes.rewrite import rewrite_graph
from cpcompile.testing.model import TinyConfig, TinyLlama, token_loss_sum
from cpcompile.testing.varlen_model import VarlenTinyLlama, document_position_ids
from tests.support.errors import cp_error as _cp_error
from tests.support.fake_pg import fake_group

OLD_TORCH = torch.torch_version.TorchVersion(torch.__version__) < "2.13"

CFG = TinyConfig(vocab=64, dim=32, layers=2, heads=4, kv_heads=2, hidden=64)


def compile_cp(fn, *args, strategy="zigzag", comm="all_gather", world=2, rank=0):
    with fake_group(rank, world):
        be = cpcompile.backend(strategy=strategy, comm=comm, inner="eager")
        torch._dynamo.reset()
        torch.compile(fn, backend=be, fullgraph=True)(*args)
    return be


@pytest.mark.parametrize(
    "strategy,comm,world", [("flat", "all_gather", 2), ("zigzag", "all_gather", 4), ("zigzag", "a2a", 2)]
)
def test_tiny_llama_with_its_loss(strategy, comm, world):
    torch.manual_seed(0)
    model = TinyLlama(CFG)
    ids, labels = torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))
    pos = torch.arange(8).expand(2, 8)

    def step(ids, pos, labels):
        return token_loss_sum(model(ids, pos), labels) / 100  # the README recipe: a share over the global count

    be = compile_cp(step, ids, pos, labels, strategy=strategy, comm=comm, world=world)
    assert len(be.plans) == CFG.layers


def test_tiny_llama_where_batch_equals_sequence():
    model = TinyLlama(CFG)
    ids = torch.randint(0, 64, (8, 8))
    pos = torch.tensor([0, 1, 2, 3, 12, 13, 14, 15]).expand(8, 8)  # rank 0's under zigzag (the batch check reads them)
    assert len(compile_cp(model, ids, pos).plans) == CFG.layers


@pytest.mark.parametrize(
    "strategy,comm,cu",
    [
        ("thd", "all_gather", [0, 3, 9, 16]),
        ("thd_zigzag", "all_gather", [0, 8, 16]),
        ("thd", "a2a", [0, 5, 16]),
        ("thd", "all_gather", [0, 1, 2, 3, 4, 5, 6, 9, 16]),  # cu has as many entries as this rank has tokens
    ],
)
def test_varlen_tiny_llama(strategy, comm, cu):
    torch.manual_seed(0)
    model = VarlenTinyLlama(CFG, causal=True, max_len=16)
    cu = torch.tensor(cu, dtype=torch.int32)
    ids, pos = torch.randint(0, 64, (8,)), document_position_ids(cu)[:8]

    def step(ids, pos, cu):
        return token_loss_sum(model(ids, pos, cu)[None], ids[None])

    be = compile_cp(step, ids, pos, cu, strategy=strategy, comm=comm)
    assert len(be.plans) == CFG.layers


def _hf_model(name: str, impl: str):
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=128, attn_implementation=impl)
    if name == "gpt2":
        cfg = transformers.GPT2Config(
            n_embd=64, n_layer=2, n_head=4, n_positions=64, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, **common
        )
        return transformers.GPT2LMHeadModel(cfg)
    sizes = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    if name == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(num_key_value_heads=2, **sizes, **common))
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(num_key_value_heads=2, **sizes, **common))


def _hf_step(model):
    def step(ids, pos, labels):  # labels already shifted and sharded: the loss is a per-rank share
        logits = model(input_ids=ids, position_ids=pos, use_cache=True).logits
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")

    return step


def _hf_inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 128, (1, 16), generator=g), torch.arange(16, 32)[None], torch.randint(0, 128, (1, 16))


@pytest.mark.skipif(OLD_TORCH, reason="HF's sdpa builds a 4-D mask on torch 2.11 (the planner refuses it)")
@pytest.mark.parametrize("name", ["llama", "qwen2", "gpt2"])
def test_hugging_face_sdpa_models_compile(name):
    torch.manual_seed(0)
    be = compile_cp(_hf_step(_hf_model(name, "sdpa")), *_hf_inputs())
    assert len(be.plans) == 2


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_hugging_face_eager_attention_is_refused(name):
    torch.manual_seed(0)
    with pytest.raises(Exception) as excinfo:
        compile_cp(_hf_step(_hf_model(name, "eager")), *_hf_inputs())
    msg = str(_cp_error(excinfo))
    assert "node 'matmul'" in msg and "in eager_attention_forward" in msg and "aten.bmm" in msg, msg
    assert 'attn_implementation="cpcompile"' in msg, msg


class _Checked(Exception):
    """Raised by the nested-rewrite backend after it checked the graph (nothing needs to run)."""


def _guard_with_nested_rewrite(fn, *args):
    """Rewrite the attention sites of every higher-order op body as well (what find/rewrite will do), then run
    the guard on the whole graph; returns the first flag (or None)."""
    found = []

    def backend(gm, example_inputs):
        config = cpcompile.backend(strategy="zigzag", inner="eager").config
        plans = []
        for sub in [gm, *(m for m in gm.modules() if isinstance(m, torch.fx.GraphModule) and m is not gm)]:
            sub_plans = [plan_site(site, config) for site in find_attention_sites(sub)]
            if sub_plans:
                rewrite_graph(sub, sub_plans)
            plans += sub_plans
        assert plans, "no attention site found"
        found.append(check_graph(gm, plans))
        raise _Checked

    with fake_group(0, 2):
        torch._dynamo.reset()
        with pytest.raises(Exception) as excinfo:
            torch.compile(fn, backend=backend, fullgraph=True)(*args)
    assert found and "_Checked" in str(excinfo.value), excinfo.value
    return found[0]


def _attend(x):
    q = x.view(x.shape[0], x.shape[1], 2, -1).transpose(1, 2)
    return F.scaled_dot_product_attention(q, q, q, is_causal=True).transpose(1, 2).reshape(x.shape)


def _attend_then_cumsum(x):
    return _attend(x).cumsum(dim=1)


def test_regions_inside_checkpoint_bodies():
    x = torch.randn(2, 8, 8, requires_grad=True)
    assert _guard_with_nested_rewrite(lambda x: checkpoint(_attend, x, use_reentrant=False) * 2, x) is None
    flag = _guard_with_nested_rewrite(lambda x: checkpoint(_attend_then_cumsum, x, use_reentrant=False), x)
    assert flag is not None and flag.node.name == "cumsum" and "cumsum" in flag.op, flag


def test_checkpointed_tiny_llama_blocks():
    torch.manual_seed(0)
    model = TinyLlama(CFG)
    ids, pos = torch.randint(0, 64, (2, 8)), torch.arange(8).expand(2, 8)

    def forward(ids, pos):
        x = model.embed(ids)
        for block in model.blocks:
            x = checkpoint(block, x, pos, use_reentrant=False)
        return model.head(model.norm(x))

    assert _guard_with_nested_rewrite(forward, ids, pos) is None


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_hugging_face_moe_models_compile_unmarked(name):
    """MoE routing (softmax and topk over the experts of a (B*L, E) tensor, HF's grouped experts) and DeepSeek-V3's
    MLA (new_empty + copies into slices) pass the guard without any user mark."""
    pytest.importorskip("transformers")
    from tests.support.hf_zoo import batch, build

    if OLD_TORCH:
        pytest.skip("torch 2.11's Dynamo cannot trace transformers 5.24's models here (lazy module import)")
    model = build(name, "cpcompile", dtype=torch.float32)
    with fake_group(0, 2):
        local = cpcompile.shard_batch(batch(name, 2, 32), strategy="zigzag", hf_loss="causal_lm")
    be = compile_cp(lambda kw: model(**kw, use_cache=False).loss, local)
    assert len({p.site.node.name for p in be.plans}) == 2
