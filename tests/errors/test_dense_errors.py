"""Every unsupported input raises one CPCompileError naming the node, the rule and the fix, before any comm."""

from __future__ import annotations

import pytest
import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

import cpcompile
from cpcompile import CPCompileError
from cpcompile.kernels import resolve_kernel
from tests.support.errors import cp_error as _cp_error
from tests.support.fake_pg import fake_group


def _compile_error(fn, *args, strategy="flat", rank=0, world=2, dynamic=False, **kwargs) -> str:
    with fake_group(rank, world):
        be = cpcompile.backend(strategy=strategy, inner="eager", **kwargs)
        with pytest.raises(Exception) as excinfo:
            torch.compile(fn, backend=be, fullgraph=True, dynamic=dynamic)(*args)
    return str(_cp_error(excinfo))


def qkv(b=1, hq=4, hkv=4, s=8, d=16, sk=None):
    sk = s if sk is None else sk
    return torch.randn(b, hq, s, d), torch.randn(b, hkv, sk, d), torch.randn(b, hkv, sk, d)


def with_mask(q, k, v):
    mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def with_dropout(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True)


def causal(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def three_d(q, k, v):
    return F.scaled_dot_product_attention(q[0], k[0], v[0], is_causal=True)


@pytest.mark.parametrize(
    "fn,args,kwargs,rule,fix",
    [
        (with_mask, qkv(), {}, "explicit attn_mask", "is_causal=True"),
        (with_dropout, qkv(), {}, "dropout_p=0.1", "set attention dropout to 0"),
        (three_d, qkv(), {}, "4-D", "4-D tensors"),
        (causal, qkv(sk=4), {}, "q has 8 local tokens but k/v have 4/4", "self-attention"),
        (causal, qkv(s=7), {"strategy": "zigzag"}, "2 equal chunks", "multiple of 4 tokens"),
        (causal, qkv(), {"dynamic": True}, "dynamic shape", "dynamic=False"),
    ],
)
def test_site_errors(no_comm, fn, args, kwargs, rule, fix):
    msg = _compile_error(fn, *args, **kwargs)
    assert f"attention node 'scaled_dot_product_attention' at {__file__}" in msg, msg
    assert rule in msg.split("Fix:")[0] and fix in msg.split("Fix:")[1], msg


def test_kernel_that_cannot_run_here():
    with pytest.raises(CPCompileError, match="runs on CPU tensors only.*Fix: use kernel='auto'"):
        resolve_kernel("cpu_flash", torch.device("cuda"), torch.bfloat16)
    with pytest.raises(CPCompileError, match="unknown kernel 'nope'"):
        resolve_kernel("nope", torch.device("cpu"), torch.float32)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"strategy": "ring"}, "unknown strategy 'ring'"),
        ({"comm": "p2p"}, "unknown comm 'p2p'"),
        ({"kernel": "magic"}, "unknown kernel 'magic'"),
        ({"inner": "tvm"}, "unknown inner 'tvm'"),
    ],
)
def test_backend_arguments(kwargs, match):
    with pytest.raises(CPCompileError, match=match):
        cpcompile.backend(**kwargs)


def test_mesh_and_group_together():
    with fake_group(0, 2) as pg:
        mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (2,))
        with pytest.raises(CPCompileError, match="only one"):
            cpcompile.backend(mesh=mesh, group=pg)


def test_mesh_without_cp_dim():
    with fake_group(0, 4):
        mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        with pytest.raises(CPCompileError, match="none named 'cp'"):
            cpcompile.shard(torch.zeros(1, 8), strategy="flat", seq_dim=1, mesh=mesh)


def test_not_initialized():
    with pytest.raises(CPCompileError, match="init_process_group"):
        cpcompile.shard(torch.zeros(1, 8), strategy="flat", seq_dim=1)


def test_shard_states_the_padding():
    with fake_group(0, 4):
        with pytest.raises(CPCompileError, match="needs a multiple of 8. Fix: pad 3 more tokens"):
            cpcompile.shard(torch.zeros(1, 13), strategy="zigzag", seq_dim=1)


def test_shard_batch_refuses_unknown_tensors():
    batch = {"input_ids": torch.zeros(1, 8, dtype=torch.long), "doc_weights": torch.ones(1, 8)}
    with fake_group(0, 2):
        with pytest.raises(CPCompileError, match=r"batch\['doc_weights'\].*seq_keys=\['doc_weights'\]"):
            cpcompile.shard_batch(batch, strategy="flat")
        out = cpcompile.shard_batch(batch, strategy="flat", seq_keys=["doc_weights"])
        assert out["doc_weights"].shape == (1, 4)


# ---- comm="a2a": the head rules, as rank 1 of 4 ----

WORLD, RANK = 4, 1


def _attention(causal):
    def attn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)

    return attn


@pytest.fixture
def no_a2a(monkeypatch):
    """Fail the test if an all-to-all is issued: errors must come before communication."""

    def boom(*args, **kwargs):
        raise AssertionError("a collective ran before the error was raised")

    monkeypatch.setattr(funcol, "all_to_all_single", boom)


@pytest.mark.parametrize(
    "hq,hkv,rule",
    [
        (6, 2, "each of the 4 ranks q_heads/cp heads, but there are 6 q heads"),
        (12, 6, "each of the 4 ranks kv_heads/cp k/v heads, but there are 6 kv heads"),
        (12, 3, "with 3 kv heads < cp=4, comm='a2a' replicates each kv head to cp/kv_heads ranks"),
    ],
)
def test_head_errors(no_a2a, hq, hkv, rule):
    q, k, v = (torch.randn(1, h, 8, 8) for h in (hq, hkv, hkv))
    msg = _compile_error(_attention(True), q, k, v, comm="a2a", rank=RANK, world=WORLD)
    assert f"attention node 'scaled_dot_product_attention' at {__file__}" in msg, msg
    rule_part, fix_part = msg.split("Fix:")
    assert rule in rule_part and "comm='all_gather'" in fix_part, msg
