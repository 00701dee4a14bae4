"""Windows and softcap in the kernels and the executor (CPU): cpu_flash's masked windows and cpu_ref's softcapped
scores against autograd through plain math, every rank's windowed blocks through attend_blocks against one
masked attention over the whole sequence, and cpcompile.attention's own (eager) semantics."""

from __future__ import annotations

import pytest
import torch

import cpcompile
from cpcompile.executor.blocks import encode_dense, encode_windows
from cpcompile.kernels import PROVIDERS, resolve_kernel
from cpcompile.kernels.cpu_flash import window_mask
from cpcompile.layouts import get_layout
from cpcompile.layouts.window import band


def _math(q, k, v, mask, scale, softcap=0.0):
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, -1) @ v


def _case(sq=6, sk=9, hq=4, hkv=2, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, hq, sq, d, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, hkv, sk, d, generator=g, dtype=torch.float64) for _ in range(2))
    return q, k, v, torch.randn(2, hq, sq, d, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("kernel", ["cpu_flash", "cpu_ref"])
@pytest.mark.parametrize("window", [(2, 0), (0, 1), (-1, 2), (3, -1), (1, 4)])
def test_windowed_block_matches_masked_math(kernel, window):
    q, k, v, dout = _case()
    impl = PROVIDERS[kernel]
    out, lse = impl.forward(q, k, v, False, 0.3, window=window)
    mask = window_mask(6, 9, window, q.device)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = _math(*leaves, mask, 0.3)
    ref.backward(dout)
    torch.testing.assert_close(out.double(), ref.detach())
    grads = impl.backward(dout, q, k, v, out.to(q.dtype), lse, False, 0.3, window=window)
    for got, leaf in zip(grads, leaves):
        torch.testing.assert_close(got.double(), leaf.grad)


@pytest.mark.parametrize("causal,window", [(True, None), (False, None), (False, (2, 1))])
def test_cpu_ref_softcap_matches_math(causal, window):
    q, k, v, dout = _case(sq=7, sk=7)
    impl = PROVIDERS["cpu_ref"]
    mask = window_mask(7, 7, window, q.device) if window else (torch.ones(7, 7).tril().bool() if causal else None)
    extra = {"window": window} if window else {}
    out, lse = impl.forward(q, k, v, causal, 0.5, softcap=2.0, **extra)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = _math(*leaves, mask, 0.5, softcap=2.0)
    ref.backward(dout)
    torch.testing.assert_close(out, ref.detach())
    for got, leaf in zip(impl.backward(dout, q, k, v, out, lse, causal, 0.5, softcap=2.0, **extra), leaves):
        torch.testing.assert_close(got, leaf.grad)


def test_features_pick_the_kernels_that_take_them():
    cpu = torch.device("cpu")
    assert resolve_kernel("auto", cpu, torch.float32, 16, features=("window",)) == "cpu_flash"
    assert resolve_kernel("auto", cpu, torch.float32, 16, features=("softcap",)) == "cpu_ref"
    with pytest.raises(cpcompile.CPCompileError, match="kernel 'cpu_flash' cannot run here: it takes no softcapped"):
        resolve_kernel("cpu_flash", cpu, torch.float32, 16, features=("softcap",))
    with pytest.raises(cpcompile.CPCompileError, match="cudnn: .*takes no sliding windows|cudnn: .*CUDA"):
        resolve_kernel("auto", torch.device("meta"), torch.bfloat16, 16, features=("window",))
    assert not PROVIDERS["cudnn"].supports_window
    assert PROVIDERS["flash"].supports_window  # FA2's window_size (tests/gpu/test_windows.py on the H200)
    assert not any(PROVIDERS[p].supports_softcap for p in ("cudnn", "flash", "flash_attn", "te"))


def _global_mask(seq, causal, window):
    lo, hi = band(causal, window)
    rel = torch.arange(seq)[None, :] - torch.arange(seq)[:, None]
    mask = torch.ones(seq, seq, dtype=torch.bool)
    if lo is not None:
        mask &= rel >= lo
    if hi is not None:
        mask &= rel <= hi
    return mask


@pytest.mark.parametrize("layout", ["flat", "zigzag"])
@pytest.mark.parametrize("causal,window", [(True, (4, 0)), (True, (0, 0)), (False, (3, 5)), (False, (-1, 2))])
@pytest.mark.parametrize("softcap", [0.0, 3.0])
def test_executor_windowed_blocks_match_masked_attention(layout, causal, window, softcap):
    """Every rank's windowed blocks through attend_blocks (fp64): its out and dq, and dk/dv summed over ranks as
    the reduce-scatter would, equal masked attention over the whole sequence."""
    cp, seq = 3, 36
    g = torch.Generator().manual_seed(2)
    q, dout = (torch.randn(1, 4, seq, 8, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(1, 2, seq, 8, generator=g, dtype=torch.float64) for _ in range(2))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = _math(*leaves, _global_mask(seq, causal, window), 8**-0.5, softcap)
    ref.backward(dout)
    lay = get_layout(layout)
    chunk = seq // lay.num_chunks(cp)
    kernel = "cpu_ref" if softcap else "cpu_flash"
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for rank in range(cp):
        idx = lay.shard_index(seq, cp, rank)
        sources = [idx] + [
            torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in lay.source_chunks(s, cp)])
            for s in range(lay.chunks_per_rank)
        ]
        blocks = lay.blocks(cp, rank, chunk, causal, window)
        extra = {"windows": encode_windows(blocks)} if encode_windows(blocks) else {}
        if softcap:
            extra["softcap"] = softcap
        ks, vs = [k[:, :, s] for s in sources], [v[:, :, s] for s in sources]
        args = (encode_dense(blocks), 8**-0.5, kernel)
        out, lse = torch.ops.cpcompile.attend_blocks(q[:, :, idx], ks, vs, *args, **extra)
        dq, dks, dvs, _ = torch.ops.cpcompile.attend_blocks_backward(
            dout[:, :, idx], q[:, :, idx], ks, vs, out, lse, *args, **extra
        )
        torch.testing.assert_close(out, ref.detach()[:, :, idx])
        torch.testing.assert_close(dq.double(), leaves[0].grad[:, :, idx])
        for s, dk_s, dv_s in zip(sources, dks, dvs):
            dk[:, :, s] += dk_s
            dv[:, :, s] += dv_s
    torch.testing.assert_close(dk, leaves[1].grad)
    torch.testing.assert_close(dv, leaves[2].grad)


def test_attention_op_eager_semantics():
    """cpcompile.attention outside CP: SDPA with the equivalent mask (window, padding, HF-style packed positions),
    bottom-right aligned when there are fewer queries than keys, math for softcap."""
    q, k, v, _ = _case(sq=8, sk=8)
    pad = torch.ones(2, 8, dtype=torch.bool)
    pad[1, -2:] = False  # right padding: every query row still sees a key
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4], list(range(8))])
    causal = torch.ones(8, 8, dtype=torch.bool).tril()
    window = causal & ~torch.ones(8, 8, dtype=torch.bool).tril(-3)
    docs = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [0] * 8])
    cases = [
        (dict(is_causal=True), causal),
        (dict(is_causal=True, window=(2, 0)), window),
        (dict(is_causal=True, padding_mask=pad), causal & pad[:, None, None, :]),
        (dict(is_causal=True, position_ids=pos), causal & (docs[:, :, None] == docs[:, None, :])[:, None]),
        (dict(is_causal=False, window=(1, 1)), (torch.arange(8)[None] - torch.arange(8)[:, None]).abs() <= 1),
    ]
    for kwargs, mask in cases:
        got = cpcompile.attention(q, k, v, scale=0.4, **kwargs)
        torch.testing.assert_close(got, _math(q, k, v, mask, 0.4), msg=str(kwargs))
    got = cpcompile.attention(q, k, v, is_causal=True, scale=0.4, softcap=1.5)
    torch.testing.assert_close(got, _math(q, k, v, causal, 0.4, softcap=1.5))
    tail = cpcompile.attention(q[:, :, 5:], k, v, is_causal=True, scale=0.4)  # the last 3 queries (a KV cache)
    torch.testing.assert_close(tail, _math(q, k, v, causal, 0.4)[:, :, 5:])
