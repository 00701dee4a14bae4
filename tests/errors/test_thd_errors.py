"""Every refusal for packed documents: one CPCompileError naming the node (or the helper), rule and fix."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention.varlen import varlen_attn
from torch.testing._internal.distributed.fake_pg import FakeStore

import cpcompile
from cpcompile import CPCompileError
from cpcompile.testing.varlen_model import GQA

CU = torch.tensor([0, 3, 16], dtype=torch.int32)


@pytest.fixture(scope="module", autouse=True)
def fake_group():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


class _Captured(Exception):
    pass


def _graph(fn, *args) -> torch.fx.GraphModule:
    """The Dynamo graph of fn(*args), without running it."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        raise _Captured

    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed):
        torch.compile(fn, backend=capture, fullgraph=True)(*args)
    return graphs[0]


def _refused(fn, *args, strategy="thd", match: str, **backend_kw) -> None:
    gm = _graph(fn, *args)
    be = cpcompile.backend(strategy=strategy, inner="eager", **backend_kw)
    with pytest.raises(CPCompileError, match=match) as info:
        be.transform(gm)
    assert "attention node '_varlen_attn'" in str(info.value) or "attention node 'scaled" in str(info.value)
    assert "test_thd_errors.py" in str(info.value), "the error names the user's source line"
    assert "Fix:" in str(info.value)


def _qkv(t=8, h=2, d=4):
    return torch.randn(t, h, d), torch.randn(t, h, d), torch.randn(t, h, d)


def test_varlen_needs_a_thd_strategy():
    fn = lambda q, k, v, cu: varlen_attn(q, k, v, cu, cu, 16, 16, window_size=(-1, 0))  # noqa: E731
    _refused(fn, *_qkv(), CU, strategy="zigzag", match="strategy='thd'")


def test_sdpa_refuses_thd_strategies():
    q = torch.randn(1, 2, 8, 4)
    fn = lambda q: F.scaled_dot_product_attention(q, q, q, is_causal=True)  # noqa: E731
    _refused(fn, q, strategy="thd_zigzag", match="packed documents for varlen_attn")


def test_key_head_dim_must_match_the_query_s():
    """v's head dim may differ (MLA: tests/parity/test_mla.py); q's and k's cannot."""
    q, _, v = _qkv()
    k = torch.randn(8, 2, 8)
    fn = lambda q, k, v, cu: varlen_attn(q, k, v, cu, cu, 16, 16, window_size=(-1, 0))  # noqa: E731
    _refused(fn, q, k, v, CU, match=r"q head dim 4 and k head dim 8 differ.*Fix: give q and k the same head dim")


def test_two_sided_window_under_all_gather_points_to_a2a():
    fn = lambda q, k, v, cu: varlen_attn(q, k, v, cu, cu, 16, 16, window_size=(2, 2))  # noqa: E731
    _refused(fn, *_qkv(), CU, match=r"window_size=\(2, 2\): a sliding window that reaches right.*Fix: use comm='a2a'")


def test_negative_window_is_refused_under_a2a():
    fn = lambda q, k, v, cu: varlen_attn(q, k, v, cu, cu, 16, 16, window_size=(-2, 0))  # noqa: E731
    _refused(fn, *_qkv(), CU, comm="a2a", match=r"window_size=\(-2, 0\): each side must be a token count")


@pytest.mark.parametrize("comm", ["a2a", "ring"])
def test_window_needs_a_windowed_kernel(monkeypatch, comm):
    from cpcompile.kernels import VARLEN_PROVIDERS

    monkeypatch.setattr(VARLEN_PROVIDERS["cpu_varlen_ref"], "supports_window", False)
    fn = lambda q, k, v, cu: varlen_attn(q, k, v, cu, cu, 16, 16, window_size=(4, 0))  # noqa: E731
    _refused(fn, *_qkv(), CU, comm=comm, match="needs a varlen kernel with sliding windows")


def test_a2a_refuses_thd_zigzag():
    fn = lambda q, k, v, cu: varlen_attn(q, k, v, cu, cu, 16, 16, window_size=(-1, 0))  # noqa: E731
    cu = torch.tensor([0, 4, 16], dtype=torch.int32)
    _refused(fn, *_qkv(), cu, strategy="thd_zigzag", comm="a2a", match="strategy='thd' with comm='a2a'")


def test_a2a_head_rules():
    fn = lambda q, k, v, cu: varlen_attn(q, k, v, cu, cu, 16, 16, **GQA)  # noqa: E731
    q, k, v = torch.randn(8, 3, 4), torch.randn(8, 3, 4), torch.randn(8, 3, 4)
    _refused(fn, q, k, v, CU, comm="a2a", match="each of the 2 ranks q_heads/cp heads, but there are 3 q heads")


def test_different_cu_seqlens_for_q_and_k():
    fn = lambda q, k, v, cu, cu_k: varlen_attn(q, k, v, cu, cu_k, 16, 16)  # noqa: E731
    _refused(fn, *_qkv(), CU, CU.clone(), match="cu_seq_q and cu_seq_k are different tensors")


@pytest.mark.skipif(
    "seqused_k" not in inspect.signature(varlen_attn).parameters,
    reason="varlen_attn takes seqused_k from torch 2.13 on (2.11's KV-cache arguments are k_cache/v_cache)",
)
def test_kv_cache_inputs_are_refused():
    fn = lambda q, k, v, cu, used: varlen_attn(q, k, v, cu, cu, 16, 16, seqused_k=used)  # noqa: E731
    _refused(fn, *_qkv(), CU, torch.tensor([3, 13], dtype=torch.int32), match="seqused_k: KV-cache")


def test_float_cu_seqlens():
    fn = lambda q, k, v, cu: varlen_attn(q, k, v, cu, cu, 16, 16)  # noqa: E731
    _refused(fn, *_qkv(), CU.float(), match="not a 1-D integer tensor")


def test_cross_attention_lengths():
    q, k, v = _qkv()
    fn = lambda q, k, v, cu: varlen_attn(q, k, v, cu, cu, 16, 16)  # noqa: E731
    _refused(fn, q, k[:6], v[:6], CU, match="q has 8 local tokens but k/v have 6/6")


def test_zigzag_needs_even_local_tokens():
    fn = lambda q, k, v, cu: varlen_attn(q, k, v, cu, cu, 16, 16, window_size=(-1, 0))  # noqa: E731
    _refused(fn, *_qkv(t=7), CU, strategy="thd_zigzag", match="even number of tokens, but this rank has 7")


def test_dense_kernel_for_a_varlen_site():
    fn = lambda q, k, v, cu: varlen_attn(q, k, v, cu, cu, 16, 16)  # noqa: E731
    _refused(fn, *_qkv(), CU, kernel="cpu_flash", match="unknown varlen kernel 'cpu_flash'")


def test_dynamic_shapes():
    fn = lambda q, k, v, cu: varlen_attn(q, k, v, cu, cu, 16, 16)  # noqa: E731
    q, k, v = _qkv()
    for t in (q, k, v):
        torch._dynamo.mark_dynamic(t, 0)
    _refused(fn, q, k, v, CU, match="dynamic shape")


# --- sharding helpers (host-side document rules) ---------------------------------------------------------


def test_shard_thd_total_not_divisible():
    with pytest.raises(CPCompileError, match="multiple of 2, got 15.*pad_cu_seqlens"):
        cpcompile.shard(torch.zeros(15), strategy="thd", seq_dim=0, cu_seqlens=torch.tensor([0, 15]))


def test_shard_zigzag_document_not_divisible():
    with pytest.raises(CPCompileError, match="document 0 has 3 tokens.*pad_documents"):
        cpcompile.shard(torch.zeros(16), strategy="thd_zigzag", seq_dim=0, cu_seqlens=CU)


def test_shard_cu_seqlens_must_cover_the_buffer():
    with pytest.raises(CPCompileError, match="end at the packed length 16"):
        cpcompile.shard(torch.zeros(16), strategy="thd", seq_dim=0, cu_seqlens=torch.tensor([0, 3, 12]))


def test_shard_needs_cu_seqlens():
    with pytest.raises(CPCompileError, match="needs cu_seqlens="):
        cpcompile.shard(torch.zeros(16), strategy="thd", seq_dim=0)
    with pytest.raises(CPCompileError, match="needs cu_seqlens="):
        cpcompile.shard_batch({"input_ids": torch.zeros(1, 16)}, strategy="thd_zigzag")


def test_cu_seqlens_with_an_unpacked_strategy():
    with pytest.raises(CPCompileError, match="only the packed-document strategies"):
        cpcompile.shard(torch.zeros(16), strategy="flat", seq_dim=0, cu_seqlens=CU)


def test_pad_cu_seqlens():
    assert cpcompile.pad_cu_seqlens(CU, 20, 6).tolist() == [0, 3, 16, 20, 20, 20]
    with pytest.raises(CPCompileError, match="more than length=3"):
        cpcompile.pad_cu_seqlens(CU, 20, 3)
    with pytest.raises(CPCompileError, match="shorter than the documents"):
        cpcompile.pad_cu_seqlens(CU, 10)


def test_pad_documents():
    x, cu = cpcompile.pad_documents(torch.arange(1.0, 6.0), torch.tensor([0, 1, 5]), 4, dim=0)
    assert cu.tolist() == [0, 4, 8] and x.tolist() == [1, 0, 0, 0, 2, 3, 4, 5]


def test_zigzag_region_asserts_document_lengths_on_device():
    """A batch that bypassed shard() with a bad document length fails loudly at run time, without host sync."""
    be = cpcompile.backend(strategy="thd_zigzag", inner="aot_eager")
    fn = lambda q, k, v, cu: varlen_attn(q, k, v, cu, cu, 16, 16, window_size=(-1, 0))  # noqa: E731
    torch._dynamo.reset()
    with pytest.raises(RuntimeError, match="multiple of 2\\*cp=4"):
        torch.compile(fn, backend=be, fullgraph=True)(*_qkv(), CU)


@pytest.mark.parametrize("window", [(-1, 3), (2, 2)])
def test_two_sided_window_under_the_ring_is_refused(window):
    """The ring takes causal sliding windows (w, 0) of packed documents (layouts/packed_band.py), not windows that
    reach right of the diagonal."""
    fn = lambda q, k, v, cu: varlen_attn(q, k, v, cu, cu, 16, 16, window_size=window)  # noqa: E731
    match = rf"window_size=\({window[0]}, {window[1]}\): a sliding window that reaches right.*ring THD region.*Fix: use comm='a2a'"
    _refused(fn, *_qkv(), CU, comm="ring", match=match)


def test_regather_only_with_all_gather():
    with pytest.raises(CPCompileError, match=r"regather=True with comm='ring'.*Fix: drop regather"):
        cpcompile.backend(strategy="thd", comm="ring", regather=True)
