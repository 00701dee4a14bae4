"""The opaque executor ops (executor/dense_ops.py, for providers that cannot be traced: flex_softcap, flash_attn,
te) must return exactly the dtypes their fakes promise. Inductor allocates nothing for a fallback op's outputs, but it
reads them as the fake's dtype: a bf16 output where the fake says fp32 is read as fp32 bytes, a silent wrong result
(NaN or garbage in the ring's running merge). The case that broke it: one call wrote every row (a rank's own causal
square), where the executor body hands back the kernel's own bf16 output."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from cpcompile.executor import encode_dense
from cpcompile.layouts import get_layout

OPS = torch.ops.cpcompile


def _own_square(dtype: torch.dtype, seed: int = 0):
    """Rank 0 of flat at cp 2 over its own K/V: one causal square, one call that writes every row (GQA)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 4, 8, 16, generator=g).to(dtype)
    k, v = (torch.randn(1, 2, 8, 16, generator=g).to(dtype) for _ in range(2))
    blocks = [b for b in get_layout("flat").blocks(2, 0, 8, True, None) if b.source == 0]
    assert len(blocks) == 1 and blocks[0].causal
    return q, k, v, encode_dense(blocks)


def _meta(ts) -> list[tuple]:
    flat = [t for x in ts for t in (x if isinstance(x, list) else [x])]
    return [(t.dtype, tuple(t.shape), t.stride()) for t in flat]


def _real_and_fake(op, *args):
    real = op(*args)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = op(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
    return _meta(real), _meta(fake)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("acc", [False, True], ids=["out-dtype", "acc-dtype"])
def test_forward_returns_the_dtypes_its_fake_promises(dtype, acc):
    q, k, v, blocks = _own_square(dtype)
    real, fake = _real_and_fake(OPS.attend_blocks, q, [k], [v], blocks, 0.25, "cpu_flash", None, acc)
    assert real == fake


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("acc", [False, True], ids=["q-dtype", "acc-dtype"])
def test_backward_returns_the_dtypes_its_fake_promises(dtype, acc):
    q, k, v, blocks = _own_square(dtype)
    out, lse = OPS.attend_blocks(q, [k], [v], blocks, 0.25, "cpu_flash")
    dout = torch.randn_like(out)
    args = (dout, q, [k], [v], out, lse, blocks, 0.25, "cpu_flash", None, acc)
    real, fake = _real_and_fake(OPS.attend_blocks_backward, *args)
    assert real == fake


INDUCTOR_SCRIPT = """
import torch
from tests.unit.test_opaque_op_dtypes import _own_square
q, k, v, blocks = _own_square(torch.bfloat16, seed=1)

def fn(q, k, v):
    out, lse = torch.ops.cpcompile.attend_blocks(q, [k], [v], blocks, 0.25, "cpu_flash", None, True)
    return out * 2.0 + lse[..., None]

got = torch.compile(fn, backend="inductor", fullgraph=True)(q, k, v)
want = fn(q, k, v)
assert got.dtype == torch.float32, got.dtype
torch.testing.assert_close(got, want, rtol=0, atol=0)
print("same")
"""


def test_inductor_reads_the_accumulated_output_as_written():
    """Compiled by Inductor, a bf16 region's accumulated output (fp32) feeds a fused kernel: the values must be the
    eager ones, not bf16 bytes read as fp32. In a subprocess: reading a buffer as twice its size can abort it."""
    proc = subprocess.run([sys.executable, "-c", INDUCTOR_SCRIPT], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "same" in proc.stdout, proc.stderr[-3000:]
