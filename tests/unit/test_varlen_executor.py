"""The varlen executor's multi-block path (LSE merge, masks, fp32 gradient sums) against its one-block path.

The THD regions run one block a rank; the op still takes several (a layout may split its work). Splitting a
rank's block, by sequences (each row in one block) or by keys (each row's keys over two blocks, merged by
LSE), must not change out, lse or any gradient.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cpcompile.executor import encode_varlen, prepare_blocks
from cpcompile.layouts.thd import THD_LAYOUTS
from tests.support.thd_parity import cu_of

OPS = torch.ops.cpcompile
SCALE = 0.3


def _run(q, keys, dout, blocks, kernel="cpu_varlen_ref"):
    ranges, spec = [b.ranges for b in blocks], encode_varlen(blocks)
    k, v = keys[:, 0], keys[:, 1]
    meta = prepare_blocks(ranges, spec, q.shape[0], [k.shape[0]], kernel)
    out, lse = OPS.attend_varlen_blocks(q, [k], [v], ranges, spec, SCALE, kernel, meta)
    dq, (dk,), (dv,) = OPS.attend_varlen_blocks_backward(dout, q, [k], [v], out, lse, ranges, spec, SCALE, kernel, meta)
    return out, lse, dq, dk, dv


def _case(strategy: str, causal: bool):
    lengths, cp, rank = [8, 4, 12, 0, 8], 2, 1
    layout, cu = THD_LAYOUTS[strategy], cu_of(lengths)
    total, local = sum(lengths), sum(lengths) // cp
    g = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(local, 4, 8, generator=g, dtype=torch.float64) for _ in range(2))
    gathered = torch.randn(total, 2, 2, 8, generator=g, dtype=torch.float64)
    index, _ = layout.key_buffer(cu, local, cp, rank, causal) or (None, None)
    keys = gathered if index is None else gathered[index]
    (block,) = layout.blocks(cu, local, cp, rank, causal)
    return q, keys, dout, block


@pytest.mark.parametrize("strategy", ["thd", "thd_zigzag"])
@pytest.mark.parametrize("causal", [True, False])
def test_split_by_sequences_matches_one_block(strategy, causal):
    q, keys, dout, block = _case(strategy, causal)
    half = block.ranges.shape[1] // 2
    parts = [
        dataclasses.replace(block, ranges=r, covers_rows=False, covers_keys=False)
        for r in (block.ranges[:, :half], block.ranges[:, half:])
    ]
    for got, want in zip(_run(q, keys, dout, parts), _run(q, keys, dout, [block])):
        torch.testing.assert_close(got.to(want.dtype), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("strategy", ["thd", "thd_zigzag"])
def test_split_by_keys_merges_by_lse(strategy):
    """Full attention: every sequence's keys cut in two blocks; the LSE merge and the fp32 sums recover it."""
    q, keys, dout, block = _case(strategy, causal=False)
    qs, qe, ks, ke = block.ranges
    mid = (ks + ke) // 2
    parts = [
        dataclasses.replace(block, ranges=torch.stack(r), covers_rows=False, covers_keys=False)
        for r in ((qs, qe, ks, mid), (qs, qe, mid, ke))
    ]
    got, want = _run(q, keys, dout, parts), _run(q, keys, dout, [block])
    assert got[2].dtype == torch.float64  # two blocks write dq: an fp64 (fp32 for bf16) sum
    for g, w in zip(got, want):
        torch.testing.assert_close(g.to(w.dtype), w, rtol=1e-10, atol=1e-10)


class _TransposedLse:
    """cpu_varlen_ref returning its lse as a (Hq, Tq) view of token-major memory, as cuDNN THD does."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def forward(self, *args, **kwargs):
        out, lse = self.inner.forward(*args, **kwargs)
        return out, lse.t().contiguous().t()


@pytest.mark.parametrize("split", [False, True])
def test_outputs_are_contiguous_whatever_the_kernel_returns(monkeypatch, split):
    """The op's fake gives contiguous out and lse, and Inductor asserts the real strides against it ("expected
    stride 4096, got 1": ring over cuDNN THD on the H200, one block covering only some rows)."""
    from cpcompile.kernels import VARLEN_PROVIDERS

    monkeypatch.setitem(VARLEN_PROVIDERS, "transposed", _TransposedLse(VARLEN_PROVIDERS["cpu_varlen_ref"]))
    q, keys, _, block = _case("thd", causal=True)
    blocks = [dataclasses.replace(block, covers_rows=False)]
    if split:
        half = block.ranges.shape[1] // 2
        blocks = [dataclasses.replace(blocks[0], ranges=r) for r in (block.ranges[:, :half], block.ranges[:, half:])]
    ranges, spec = [b.ranges for b in blocks], encode_varlen(blocks)
    k, v = keys[:, 0], keys[:, 1]
    meta = prepare_blocks(ranges, spec, q.shape[0], [k.shape[0]], "cpu_varlen_ref")
    got = OPS.attend_varlen_blocks(q, [k], [v], ranges, spec, SCALE, "transposed", meta)
    want = OPS.attend_varlen_blocks(q, [k], [v], ranges, spec, SCALE, "cpu_varlen_ref", meta)
    for g, w in zip(got, want):
        assert g.is_contiguous(), g.stride()
        torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.mark.parametrize("covers", [(False, True), (True, False), (False, False), (True, True)])
def test_a_side_the_block_vouches_for_costs_nothing(monkeypatch, covers):
    """Each mask side is a scatter and a scan over its buffer (the H200 profile: ring over thd_zigzag is
    host-bound): `prepare_blocks` builds only the sides a block does not vouch for, once, and the ops build none
    (they read the prepared list at every call); the result is the same as with every mask built."""
    import cpcompile.executor.varlen_meta as varlen_meta

    calls = []
    real = varlen_meta.range_ids
    monkeypatch.setattr(varlen_meta, "range_ids", lambda *a: calls.append(a[-1]) or real(*a))
    q, keys, dout, block = _case("thd", causal=True)
    vouched = dataclasses.replace(block, covers_rows=covers[0], covers_keys=covers[1])
    ranges, spec = [vouched.ranges], encode_varlen([vouched])
    k, v = keys[:, 0], keys[:, 1]
    meta = prepare_blocks(ranges, spec, q.shape[0], [k.shape[0]], "cpu_varlen_ref")
    assert calls == [q.shape[0]] * (not covers[0]) + [keys.shape[0]] * (not covers[1])
    assert len(meta) == (not covers[0]) + (not covers[1])  # cpu_varlen_ref prepares nothing of its own
    calls.clear()
    out, lse = OPS.attend_varlen_blocks(q, [k], [v], ranges, spec, SCALE, "cpu_varlen_ref", meta)
    dq, (dk,), (dv,) = OPS.attend_varlen_blocks_backward(
        dout, q, [k], [v], out, lse, ranges, spec, SCALE, "cpu_varlen_ref", meta
    )
    assert calls == [], "the ops build no mask: the caller prepared them"
    masked = dataclasses.replace(block, covers_rows=False, covers_keys=False)
    for g, w in zip((out, lse, dq, dk, dv), _run(q, keys, dout, [masked])):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_metadata_of_other_blocks_is_refused():
    """The ops cut the flat list by the blocks' static encoding: a list made for other blocks is an error."""
    q, keys, dout, block = _case("thd", causal=True)
    ranges, spec = [block.ranges], encode_varlen([block])
    k, v = keys[:, 0], keys[:, 1]
    with pytest.raises(AssertionError, match="metadata tensors for blocks that take"):
        OPS.attend_varlen_blocks(q, [k], [v], ranges, spec, SCALE, "cpu_varlen_ref", [])
