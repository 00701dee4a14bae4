"""MLA head dims (v's head dim differs from q/k's, e.g. 192/128): CP parity on the CPU kernels, and the rules.

The all-gather regions then carry K and V side by side in one buffer (executor.packed_kv) instead of stacked;
cpu_flash zero-pads the smaller head dim (aten's CPU flash kernel takes one), cpu_varlen_ref takes any. A
provider that cannot take them refuses with its name. CUDA kernels on MLA dims: tests/gpu/test_cudnn_varlen.py.
"""

from __future__ import annotations

import pytest
import torch

import cpcompile
from cpcompile import CPCompileError
from cpcompile.executor.packed_kv import pack_kv, unpack_kv
from cpcompile.kernels import resolve_kernel
from cpcompile.testing.distributed import run_ranks
from cpcompile.testing.varlen_model import GQA
from tests.support.parity import _assert_reports, bf16_rule, cp_attention, max_err, reference
from tests.support.thd_parity import cp_varlen, cu_of, doc_reference

DIMS = (16, 8)  # q/k head dim, v head dim (scaled-down 192/128)
CUDA = torch.device("cuda")


def _tensors(seed: int, lead: tuple, hq: int, hkv: int, dims=DIMS):
    """q, k, v, dout with v (and so the output) of the second head dim; heads on dim 1, `lead` the other sizes
    before the head dim ((B, S) dense, (T,) packed)."""
    g = torch.Generator().manual_seed(seed)
    d, dv = dims
    shape = lambda h, width: (lead[0], h, *lead[1:], width)  # noqa: E731
    return [
        torch.randn(shape(h, w), generator=g, dtype=torch.float64) for h, w in ((hq, d), (hkv, d), (hkv, dv), (hq, dv))
    ]


def _report(got, exact, low, shard, dtype) -> dict:
    return {
        name: (max_err(g, shard(e)), bf16_rule(max_err(g, shard(e)), max_err(shard(lo), shard(e)), dtype))
        for name, g, e, lo in zip(("out", "dq", "dk", "dv"), got, exact, low)
    }


def _dense(strategy: str, comm: str, causal: bool, dtype: torch.dtype) -> dict:
    q, k, v, dout = _tensors(0, (1, 32), 4, 2)  # (B, H, S, D)
    exact = reference(q, k, v, dout, causal, torch.float64)
    low = reference(q, k, v, dout, causal, dtype) if dtype == torch.bfloat16 else exact
    got = cp_attention(q, k, v, dout, strategy=strategy, causal=causal, dtype=dtype, comm=comm)
    return _report(got, exact, low, lambda t: cpcompile.shard(t, strategy=strategy, seq_dim=2), dtype)


def _packed(strategy: str, comm: str, causal: bool, dtype: torch.dtype, lengths: list[int]) -> dict:
    cu = cu_of(lengths)
    q, k, v, dout = _tensors(1, (int(cu[-1]),), 4, 2)  # (T, H, D)
    exact = doc_reference(q, k, v, dout, cu, causal, torch.float64)
    low = doc_reference(q, k, v, dout, cu, causal, dtype) if dtype == torch.bfloat16 else exact
    be = cpcompile.backend(strategy=strategy, comm=comm, inner="aot_eager")
    got = cp_varlen(q, k, v, dout, cu, strategy=strategy, causal=causal, dtype=dtype, backend=be)
    shard = lambda t: cpcompile.shard(t, strategy=strategy, seq_dim=0, cu_seqlens=cu)  # noqa: E731
    return _report(got, exact, low, shard, dtype)


def _sweep(rank, world):
    results = {}
    for strategy, comm in (("flat", "all_gather"), ("zigzag", "all_gather"), ("flat", "a2a"), ("zigzag", "a2a")):
        for causal in (True, False):
            results[(strategy, comm, causal, "fp64")] = _dense(strategy, comm, causal, torch.float64)
        results[(strategy, comm, True, "bf16")] = _dense(strategy, comm, True, torch.bfloat16)
    unit = 2 * world
    docs = {"thd": [1, 3 * world + 1, 4 * world - 2], "thd_zigzag": [unit, 3 * unit, unit]}  # 1-token, spanning docs
    for strategy, comm in (("thd", "all_gather"), ("thd_zigzag", "all_gather"), ("thd", "a2a")):
        for causal in (True, False):
            results[(strategy, comm, causal, "fp64")] = _packed(strategy, comm, causal, torch.float64, docs[strategy])
        results[(strategy, comm, True, "bf16")] = _packed(strategy, comm, True, torch.bfloat16, docs[strategy])
    return results


@pytest.mark.parametrize("world", [2])
def test_mla_parity_on_cpu_kernels(world):
    """Dense flat/zigzag and packed thd/thd_zigzag, all_gather and a2a, fp64 and bf16, q/k 16 with v 8."""
    _assert_reports(run_ranks(_sweep, world, timeout=600))


def test_varlen_attn_traces_with_v_head_dim():
    """torch's varlen_attn fake gives the output q's head dim; cpcompile's wrapper gives it v's, so a model's
    ops after the call (flatten to H * Dv, the output projection) trace with MLA head dims."""
    from torch.nn.attention.varlen import varlen_attn

    import cpcompile.backend  # noqa: F401  (wraps the fake at import)

    w, shapes = torch.randn(4 * 8, 16), []
    q, k, v = torch.randn(16, 4, 16), torch.randn(16, 2, 16), torch.randn(16, 2, 8)
    cu = torch.tensor([0, 5, 16], dtype=torch.int32)

    def model(q, k, v, cu):
        return varlen_attn(q, k, v, cu, cu, 16, 16, window_size=(-1, 0), **GQA).flatten(1) @ w

    def record(gm, example_inputs):  # the attention output's traced shape; never runs the (CUDA-only) op
        for n in gm.graph.nodes:
            value = n.meta.get("example_value")
            if n.op == "call_function" and "varlen" in str(n.target) and isinstance(value, tuple):
                shapes.append(tuple(value[0].shape))
        return lambda *args: (torch.zeros(16, 16),)

    torch._dynamo.reset()
    torch.compile(model, backend=record, fullgraph=True)(q, k, v, cu)
    assert shapes == [(16, 4, 8)], shapes


@pytest.mark.parametrize("dim", [1, 2])
def test_pack_kv_stacks_equal_head_dims_and_lays_mla_side_by_side(dim):
    k, v = torch.randn(5, 3, 2, 4), torch.randn(5, 3, 2, 4)
    packed = pack_kv(k, v, dim)
    assert packed.shape[dim] == 2 and all(torch.equal(a, b) for a, b in zip(unpack_kv(packed, dim, 4), (k, v)))
    v = torch.randn(5, 3, 2, 6)
    packed = pack_kv(k, v, dim)
    assert packed.shape == (5, 3, 2, 10)
    views = unpack_kv(packed, dim, 4)
    assert all(torch.equal(a, b) and a.stride(-1) == 1 for a, b in zip(views, (k, v)))
    assert views[0].data_ptr() == packed.data_ptr()


def test_providers_that_take_one_head_dim_refuse_mla_by_name(monkeypatch):
    """FA2 (dense and varlen) takes one head dim: named, it refuses MLA with its name; auto picks cuDNN."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91900)
    for name, varlen in (("flash", False), ("flash_varlen", True)):
        with pytest.raises(
            CPCompileError, match=r"kernel '\w+' cannot run here: FlashAttention-2.* not q/k 192 with v 128"
        ):
            resolve_kernel(name, CUDA, torch.bfloat16, 192, varlen=varlen, v_head_dim=128)
    assert resolve_kernel("auto", CUDA, torch.bfloat16, 192, v_head_dim=128) == "cudnn"
    assert resolve_kernel("cudnn", CUDA, torch.bfloat16, 192, v_head_dim=128) == "cudnn"
    for name in ("cpu_flash", "cpu_varlen_ref"):
        assert resolve_kernel(name, torch.device("cpu"), torch.float32, 16, varlen=name.endswith("ref"), v_head_dim=8)
