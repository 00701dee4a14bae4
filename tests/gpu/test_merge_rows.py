"""On CUDA, the ring's running merge and dq sum fold a partial over some q rows (comms/ring/dense.step_rows) with
merge_triton's kernel reading it where it lies: the result equals merging the partial padded to every row (zeros,
lse -inf) with the executor's pointwise merge, and rows outside the partial keep the running values exactly."""

from __future__ import annotations

import pytest
import torch

from cpcompile.executor import accumulate  # noqa: F401  (registers the ops)
from cpcompile.executor.dense_run import merged

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize(("start", "rows"), [(0, 96), (48, 48), (17, 30), (0, 40)])
def test_merge_partial_over_some_rows(start, rows):
    g = torch.Generator(device="cuda").manual_seed(start + rows)
    acc = torch.randn(2, 4, 96, 64, device="cuda", generator=g)
    lse = torch.randn(2, 4, 96, device="cuda", generator=g)
    lse[0, 0, :5] = float("-inf")  # rows no key has reached yet
    acc[0, 0, :5] = 0.0
    o = torch.randn(2, 4, rows, 64, device="cuda", generator=g).bfloat16()
    lo = torch.randn(2, 4, rows, device="cuda", generator=g)
    got, got_lse = torch.ops.cpcompile.merge_partial(acc, lse, o, lo, True, start)
    pad_o = torch.zeros_like(acc)
    pad_l = torch.full_like(lse, float("-inf"))
    pad_o[..., start : start + rows, :] = o.float()
    pad_l[..., start : start + rows] = lo
    want, want_lse = merged([acc, pad_o], [lse, pad_l], torch.float32)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_lse, want_lse, atol=1e-5, rtol=1e-5)
    outside = torch.ones(96, dtype=torch.bool, device="cuda")
    outside[start : start + rows] = False
    assert torch.equal(got[..., outside, :], acc[..., outside, :]) and torch.equal(
        got_lse[..., outside], lse[..., outside]
    )


@pytest.mark.parametrize(("start", "rows"), [(48, 48), (5, 20)])
def test_add_partial_over_some_rows(start, rows):
    g = torch.Generator(device="cuda").manual_seed(rows)
    total = torch.randn(1, 8, 96, 128, device="cuda", generator=g)
    part = torch.randn(1, 8, rows, 128, device="cuda", generator=g).bfloat16()
    got = torch.ops.cpcompile.add_partial(total, part, start)
    want = total.clone()
    want[..., start : start + rows, :] += part.float()
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert torch.equal(got[..., :start, :], total[..., :start, :])
