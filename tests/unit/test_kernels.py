"""Kernel registry, block batching/segmenting and the LSE merge (CPU; the CUDA side is tests/gpu/test_gpu.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cpcompile import CPCompileError
from cpcompile.executor import merged, summed
from cpcompile.executor.blocks import decode_dense, encode_dense
from cpcompile.executor.calls import batched_rows, plan_calls, segments
from cpcompile.kernels import PROVIDERS, resolve_kernel
from cpcompile.layouts import get_layout
from cpcompile.testing.rank_inputs import rank_inputs

CUDA = torch.device("cuda")


def test_auto_picks_cpu_flash_on_cpu_and_names_every_reason_when_nothing_fits():
    assert resolve_kernel("auto", torch.device("cpu"), torch.bfloat16, 64) == "cpu_flash"
    with pytest.raises(CPCompileError, match="cudnn: .*flash: .*cpu_flash: "):
        resolve_kernel("auto", torch.device("meta"), torch.float32)


@pytest.mark.parametrize("name", ["cudnn", "flash"])
def test_cuda_providers_refuse_cpu_and_fp32(name):
    with pytest.raises(CPCompileError, match=f"kernel '{name}' cannot run here: .*CUDA tensors only"):
        resolve_kernel(name, torch.device("cpu"), torch.bfloat16)
    if torch.cuda.is_available():
        with pytest.raises(CPCompileError, match="float16/bfloat16"):
            resolve_kernel(name, CUDA, torch.float32)
        with pytest.raises(CPCompileError, match="head dim"):
            resolve_kernel(name, CUDA, torch.bfloat16, head_dim=12)


@pytest.mark.parametrize("name,module", [("flash_attn", "flash_attn"), ("te", "transformer_engine")])
def test_optional_package_providers_fail_cleanly_when_absent(name, module):
    """Registering the provider never imports the package; asking for it without the package is one error."""
    pytest.importorskip("importlib")
    try:
        __import__(module)
        pytest.skip(f"{module} is installed")
    except ImportError:
        pass
    assert PROVIDERS[name].supports(CUDA, torch.bfloat16) is not None
    with pytest.raises(CPCompileError, match="not installed \\(pip install"):
        resolve_kernel(name, CUDA, torch.bfloat16)


def test_zigzag_causal_squares_run_as_one_batched_call():
    for rank in range(4):
        blocks = decode_dense(encode_dense(get_layout("zigzag").blocks(4, rank, 16, True)))
        calls = plan_calls(blocks, batch=1)
        squares = [c for c in calls if c.causal]
        causal_blocks = tuple(i for i, b in enumerate(blocks) if b[5])
        assert len(squares) == 1 and squares[0].members == causal_blocks and squares[0].q_step == 16
        assert sorted(i for c in calls for i in c.members) == list(range(len(blocks)))
        assert all(len(c.members) == 1 for c in plan_calls(blocks, batch=2))


def test_batched_rows_is_a_view_of_the_right_rows():
    t = torch.arange(2 * 12 * 3, dtype=torch.float32).view(1, 2, 12, 3)
    view = batched_rows(t, 2, 6, 4, 2, dim=-2)
    assert view.data_ptr() == t[:, :, 2:].data_ptr()
    torch.testing.assert_close(view[0], t[0, :, 2:6])
    torch.testing.assert_close(view[1], t[0, :, 8:12])


def test_segments_cut_at_every_boundary():
    assert segments(10, [(0, 4), (0, 10), (6, 4)]) == [(0, 4, [0, 1]), (4, 6, [1]), (6, 10, [1, 2])]
    assert segments(6, [(2, 2)]) == [(0, 2, []), (2, 4, [0]), (4, 6, [])]


def test_merge_matches_attention_over_the_union_of_keys():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 8, generator=g, dtype=torch.float64) for _ in range(3))
    full = F.scaled_dot_product_attention(q, k, v)
    parts = [torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k[:, :, s], v[:, :, s], 0.0, False)
             for s in (slice(0, 2), slice(2, 3), slice(3, 5))]  # fmt: skip
    out, lse = merged([p[0] for p in parts], [p[1] for p in parts], torch.float64)
    torch.testing.assert_close(out, full)
    torch.testing.assert_close(lse, torch.logsumexp((q @ k.transpose(-1, -2)) / 8**0.5, dim=-1))


def test_merge_of_rows_no_partial_saw():
    """A row every partial missed (-inf lse) merges to out 0, lse -inf: no NaN from 0/0 or -inf - -inf."""
    outs = [torch.randn(1, 1, 3, 4, dtype=torch.float64) for _ in range(2)]
    lses = [torch.tensor([[[0.5, float("-inf"), 1.0]]], dtype=torch.float64), torch.full((1, 1, 3), float("-inf"))]
    out, lse = merged(outs, lses, torch.float64)
    assert out[0, 0, 1].eq(0).all() and lse[0, 0, 1] == float("-inf")
    torch.testing.assert_close(out[0, 0, 0], outs[0][0, 0, 0])
    torch.testing.assert_close(lse[0, 0, 2], lses[0][0, 0, 2])


def test_summed_rounds_once():
    a = torch.full((4,), 1.0, dtype=torch.bfloat16)
    tiny = torch.full((4,), 3 * 2.0**-10, dtype=torch.bfloat16)  # under half an ulp of 1.0; two are over
    for parts, expect in (([a, tiny], 1.0), ([a, tiny, tiny], 1.0 + 2.0**-7), ([a], 1.0)):
        assert summed(parts, torch.bfloat16).float().tolist() == [expect] * 4


def test_add_partial_sums_in_the_wider_dtype():
    """The ring's running fp32 gradient plus a bf16 part: no rounding to bf16 on the way (CPU; and CUDA's Triton
    kernel where there is a GPU)."""
    tiny = torch.full((1, 1, 2, 4), 2.0**-9, dtype=torch.bfloat16)  # lost when 1 + tiny rounds to bf16
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        total = torch.ones(1, 1, 2, 4, device=device)
        got = torch.ops.cpcompile.add_partial(total, tiny.to(device))
        assert got.dtype == torch.float32 and got.cpu().flatten().tolist() == [1.0 + 2.0**-9] * 8


@pytest.mark.parametrize("batch", [1, 2])
def test_executor_matches_sdpa_with_batched_calls(batch):
    """Direct op calls, fp64: every rank's out and dq, and dk/dv summed over ranks as the reduce-scatter would."""
    g = torch.Generator().manual_seed(1)
    q, dout = (torch.randn(batch, 4, 48, 8, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(batch, 2, 48, 8, generator=g, dtype=torch.float64) for _ in range(2))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
    ref.backward(dout)
    for layout in ("flat", "zigzag"):
        cp = 3
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)
        lay = get_layout(layout)
        chunk = 48 // lay.num_chunks(cp)
        for rank in range(cp):
            idx, ql, ks, vs, dl, blocks = rank_inputs(layout, cp, rank, q, k, v, dout)
            out, lse = torch.ops.cpcompile.attend_blocks(ql, ks, vs, blocks, 8**-0.5, "cpu_flash")
            dq, dks, dvs, _ = torch.ops.cpcompile.attend_blocks_backward(
                dl, ql, ks, vs, out, lse, blocks, 8**-0.5, "cpu_flash"
            )
            torch.testing.assert_close(out, ref.detach()[:, :, idx])
            torch.testing.assert_close(dq, leaves[0].grad[:, :, idx])
            dk[:, :, idx] += dks[0]
            dv[:, :, idx] += dvs[0]
            for slot in range(lay.chunks_per_rank):
                src = torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in lay.source_chunks(slot, cp)])
                dk[:, :, src] += dks[1 + slot]
                dv[:, :, src] += dvs[1 + slot]
        torch.testing.assert_close(dk, leaves[1].grad)
        torch.testing.assert_close(dv, leaves[2].grad)
