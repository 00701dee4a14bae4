"""The FlexAttention softcap provider (kernels/flex_softcap.py) on CPU: its forward and its backward from the FINAL
out/lse against the CPU reference (flex's eager math; CUDA runs the same code on Inductor's flex kernels:
tests/gpu/test_softcap.py), and which provider kernel="auto" picks for softcapped sites on CUDA (CUDA's
availability stubbed: selection only, nothing runs)."""

from __future__ import annotations

import pytest
import torch

from cpcompile.kernels import PROVIDERS, resolve_kernel, supported_kernels, unsupported_reason
from cpcompile.precision import acc_dtype
from tests.support.flex import cpu_flex_backward


def _case(sq, sk, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, sq, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, sk, 16, generator=g, dtype=torch.float64) for _ in range(2))
    return q, k, v, torch.randn(2, 4, sq, 16, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("causal,window", [(True, None), (False, None), (False, (3, 0)), (False, (2, 5))])
def test_block_forward_matches_the_reference(causal, window):
    q, k, v, _ = _case(8, 8 if causal else 12)
    extra = {} if window is None else {"window": window}
    with cpu_flex_backward():
        out, lse = PROVIDERS["flex_softcap"].forward(q, k, v, causal, 0.3, softcap=2.0, **extra)
    ref_out, ref_lse = PROVIDERS["cpu_ref"].forward(q, k, v, causal, 0.3, softcap=2.0, **extra)
    torch.testing.assert_close(out, ref_out.to(out.dtype))
    torch.testing.assert_close(lse.to(ref_lse.dtype), ref_lse)


def test_backward_from_the_final_out_and_lse_is_the_blocks_share():
    """Two blocks over disjoint keys merged by LSE: each block's backward, given the MERGED out/lse, is its share of
    the whole attention's gradient; their sum matches the CPU reference's gradient of one block over all keys."""
    q, k, v, dout = _case(6, 10)
    ref, flex = PROVIDERS["cpu_ref"], PROVIDERS["flex_softcap"]
    out, lse = ref.forward(q, k, v, False, 0.4, softcap=3.0)
    want = ref.backward(dout, q, k, v, out, lse, False, 0.4, softcap=3.0)
    halves = [(k[..., :4, :], v[..., :4, :]), (k[..., 4:, :], v[..., 4:, :])]
    with cpu_flex_backward():
        parts = [flex.backward(dout, q, kk, vv, out, lse, False, 0.4, softcap=3.0) for kk, vv in halves]
    dq = parts[0][0] + parts[1][0]
    dk, dv = (torch.cat([parts[0][i], parts[1][i]], dim=-2) for i in (1, 2))
    for got, exp in zip((dq, dk, dv), want):
        torch.testing.assert_close(got.to(acc_dtype(got.dtype)), exp.to(acc_dtype(got.dtype)))


@pytest.fixture
def cuda_present(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def test_flex_softcap_takes_softcapped_cuda_sites(cuda_present):
    """flex_softcap runs softcapped CUDA sites (its GPU check, tests/gpu/test_softcap.py, passes on the H200),
    fp16/bf16/fp32, head dims powers of two in [16, 256]; CPU sites stay on cpu_ref. (Only this provider is asked:
    the others probe a real device.)"""
    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    for dtype in (bf16, torch.float16, torch.float32):
        assert unsupported_reason("flex_softcap", cuda, dtype, 64, features=("softcap",)) is None
    assert "powers of two" in unsupported_reason("flex_softcap", cuda, bf16, 96, features=("softcap",))
    assert supported_kernels(torch.device("cpu"), torch.float32, 64, features=("softcap",)) == ["cpu_ref"]
    assert resolve_kernel("flex_softcap", cuda, bf16, 64, features=("softcap",)) == "flex_softcap"


@torch.library.custom_op("cpcompile_test::flex_block", mutates_args=())
def _flex_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> list[torch.Tensor]:
    return list(PROVIDERS["flex_softcap"].forward(q, k, v, False, 0.125, window=(40, 0), softcap=5.0))


@_flex_block.register_fake
def _flex_block_fake(q, k, v):
    return [torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=torch.float32)]


def test_flex_softcap_runs_inside_a_compiled_graphs_custom_op():
    """Our regions are custom ops; on a compiled graph's first call torch 2.11 runs them under aot_autograd's
    custom-op aliasing check (a dispatch mode), under which flex's vmapped mask and score mods failed ("NYI:
    querying is_contiguous inside of vmap", Gemma 2 on the H200). The forward there equals a direct call (flex
    has no CPU backward; tests/gpu/test_softcap.py runs both on CUDA)."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 2, 128, 64, generator=g)
    k, v = (torch.randn(1, 2, 192, 64, generator=g) for _ in range(2))
    compiled = torch.compile(lambda *a: _flex_block(a[0] * 1, *a[1:]), backend="aot_eager", fullgraph=True)
    for got, want in zip(compiled(q, k, v), _flex_block(q, k, v)):
        torch.testing.assert_close(got, want)


@torch.library.custom_op("cpcompile_test::flex_block_grads", mutates_args=())
def _flex_block_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor) -> list[torch.Tensor]:
    flex = PROVIDERS["flex_softcap"]
    out, lse = flex.forward(q, k, v, True, 0.125, softcap=5.0)
    return list(flex.backward(dout, q, k, v, out, lse, True, 0.125, softcap=5.0))


@_flex_block_grads.register_fake
def _flex_block_grads_fake(q, k, v, dout):
    return [torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)]


def test_flex_softcap_backward_runs_inside_a_compiled_graphs_custom_op():
    """A region's backward is a custom op too: its impl runs with autograd's keys excluded, where the block's
    recomputed forward would record no graph. The grads inside a compiled graph equal a direct call's."""
    g = torch.Generator().manual_seed(3)
    q, k, v, dout = (torch.randn(1, 2, 32, 16, generator=g) for _ in range(4))
    with cpu_flex_backward():
        compiled = torch.compile(lambda *a: _flex_block_grads(a[0] * 1, *a[1:]), backend="aot_eager", fullgraph=True)
        for got, want in zip(compiled(q, k, v, dout), _flex_block_grads(q, k, v, dout)):
            torch.testing.assert_close(got, want)


def test_flex_softcap_runs_on_the_calling_thread(monkeypatch):
    """On CUDA the caller of a region's backward is the autograd engine's device thread; an autograd.grad from any
    other thread queues onto that thread and waits forever (Gemma 2 hung on the H200 when flex ran on a worker)."""
    import threading

    import cpcompile.kernels.flex_softcap as flex_softcap

    seen = []
    real_run = flex_softcap._run

    def recording_run(*args):
        seen.append(threading.get_ident())
        return real_run(*args)

    monkeypatch.setattr(flex_softcap, "_run", recording_run)
    q, k, v, dout = _case(8, 8)
    flex = PROVIDERS["flex_softcap"]
    with cpu_flex_backward():
        out, lse = flex.forward(q, k, v, True, 0.3, softcap=2.0)
        flex.backward(dout, q, k, v, out, lse, True, 0.3, softcap=2.0)
    assert seen == [threading.get_ident()] * 2
