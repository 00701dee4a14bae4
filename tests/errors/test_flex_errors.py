"""flex_attention sites cpcompile cannot rewrite raise ONE CPCompileError at compile time (fake process group)."""

from __future__ import annotations

import re

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import cpcompile
from tests.support.fake_pg import fake_group
from tests.support.flex import attention, block_mask


def _qkv(local=16, hq=4, hkv=2):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, h, local, 8, generator=g) for h in (hq, hkv, hkv)]


def _compile(fn, *args, **backend_kwargs):
    torch._dynamo.reset()
    be = cpcompile.backend(inner="eager", **backend_kwargs)
    return torch.compile(fn, backend=be, fullgraph=True)(*args)


def _cp_error(exc: BaseException) -> cpcompile.CPCompileError:
    """The CPCompileError itself (Dynamo wraps backend errors in BackendCompilerFailed)."""
    while not isinstance(exc, cpcompile.CPCompileError):
        assert exc.__cause__ is not None or getattr(exc, "inner_exception", None) is not None, repr(exc)
        exc = getattr(exc, "inner_exception", None) or exc.__cause__
    return exc


def _raises(match, fn, *args, **backend_kwargs):
    with pytest.raises(Exception) as info:
        _compile(fn, *args, **backend_kwargs)
    msg = str(_cp_error(info.value))
    assert re.search(match, msg) and "flex_attention" in msg, msg
    return msg


def test_local_block_mask_is_refused():
    """A mask built for the local length describes this rank's tokens alone: refused, with the fix."""
    with fake_group(0, 2):
        local = create_block_mask(lambda b, h, q, k: q >= k, 1, 1, 16, 16, device="cpu", BLOCK_SIZE=8)
        msg = _raises("did not come from cpcompile.shard_block_mask", attention(None), *_qkv(), local, strategy="flat")
        assert "Fix: build the BlockMask once for the GLOBAL sequence" in msg


def test_local_block_mask_given_to_shard_block_mask_is_refused_by_the_planner():
    """A mask built for the local length and sharded had Dynamo fail on flex's own length check (an Unsupported
    wrapping its ValueError); the planner refuses it by name."""
    with fake_group(0, 2):
        local = cpcompile.shard_block_mask(block_mask("window", 1, 4, seq=16), strategy="flat")
        msg = _raises("BlockMask was built for 16 tokens, this rank's LOCAL length", attention(None), *_qkv(), local,
                      strategy="flat")  # fmt: skip
        assert "Fix: build the BlockMask once for the GLOBAL sequence" in msg


def test_mask_sharded_for_another_layout_is_refused():
    with fake_group(0, 2):
        mask = cpcompile.shard_block_mask(block_mask("window", 1, 4, seq=32), strategy="flat")
        _raises("sharded for strategy='flat'.*planned for strategy='zigzag'", attention(None), *_qkv(), mask,
                strategy="zigzag")  # fmt: skip


def test_chunks_that_are_not_whole_blocks_are_refused():
    with fake_group(0, 2):
        g = create_block_mask(lambda b, h, q, k: q >= k, 1, 1, 32, 32, device="cpu", BLOCK_SIZE=16)
        mask = cpcompile.shard_block_mask(g, strategy="zigzag")  # chunks of 8 tokens, blocks of 16
        _raises("chunks of 8 tokens, which are not whole q blocks", attention(None), *_qkv(), mask, strategy="zigzag")


def test_a2a_refuses_reading_the_logsumexp():
    def with_lse(q, k, v, mask):
        out, lse = flex_attention(q, k, v, block_mask=mask, enable_gqa=True, return_lse=True)
        return out, lse

    with fake_group(0, 2):
        mask = cpcompile.shard_block_mask(block_mask("window", 1, 4, seq=32), strategy="flat")
        _raises("reads flex_attention's logsumexp", with_lse, *_qkv(), mask, strategy="flat", comm="a2a")


def test_a2a_head_counts_must_split():
    with fake_group(0, 4):
        mask = cpcompile.shard_block_mask(block_mask("window", 1, 6, seq=64), strategy="flat")
        _raises("6 q heads", attention(None), *_qkv(hq=6, hkv=6), mask, strategy="flat", comm="a2a")


def test_packed_layouts_are_refused():
    with fake_group(0, 2):
        with pytest.raises(cpcompile.CPCompileError, match="dense layouts"):
            cpcompile.shard_block_mask(block_mask("window", 1, 4, seq=32), strategy="thd")
        _raises("packed documents", attention(None), *_qkv(), None, strategy="thd")


def test_shard_block_mask_refusals():
    with fake_group(0, 2):
        mask = block_mask("window", 1, 4, seq=32)
        with pytest.raises(cpcompile.CPCompileError, match="takes a torch.nn.attention.flex_attention.BlockMask"):
            cpcompile.shard_block_mask(torch.ones(3), strategy="flat")
        with pytest.raises(cpcompile.CPCompileError, match="made already"):
            cpcompile.shard_block_mask(cpcompile.shard_block_mask(mask, strategy="flat"), strategy="flat")
        with pytest.raises(cpcompile.CPCompileError, match="needs a multiple of 4"):
            odd = create_block_mask(lambda b, h, q, k: q >= k, 1, 1, 30, 30, device="cpu", BLOCK_SIZE=2)
            cpcompile.shard_block_mask(odd, strategy="zigzag")


def test_a_sharded_mask_never_runs_outside_a_region():
    """Eager flex_attention on a rank's tokens with the sharded mask raises instead of attending locally."""
    with fake_group(0, 2):
        mask = cpcompile.shard_block_mask(block_mask("window", 1, 4, seq=32), strategy="flat")
        with pytest.raises(Exception, match="evaluated outside a cpcompile region"):
            flex_attention(*_qkv(), block_mask=mask, enable_gqa=True)


def test_a_sequence_sharded_mod_buffer_is_refused():
    """The mods index their buffers by GLOBAL position: a buffer cut into this rank's tokens is refused."""

    def attn(q, k, v, docs_local, mask):
        return flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + docs_local[0, qi], block_mask=mask,
                              enable_gqa=True)  # fmt: skip

    with fake_group(0, 2):
        mask = cpcompile.shard_block_mask(block_mask("window", 1, 4, seq=32), strategy="flat")
        docs_local = torch.zeros(1, 16)
        _raises("score_mod/mask_mod buffer", attn, *_qkv(), docs_local, mask, strategy="flat")


def test_sharded_document_ids_in_a_module_buffer_are_refused():
    """Module buffers are model state, which the token guard does not place: the planner refuses one that holds
    this rank's tokens and is indexed by position (it was an IndexError at run time)."""

    class DocumentBias(torch.nn.Module):
        def __init__(self, docs_local):
            super().__init__()
            self.register_buffer("docs", docs_local)

        def forward(self, q, k, v, mask):
            return flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + (self.docs[qi] == self.docs[ki]),
                                  block_mask=mask, enable_gqa=True)  # fmt: skip

    with fake_group(0, 2):
        mask = cpcompile.shard_block_mask(block_mask("window", 1, 4, seq=32), strategy="flat")
        docs = torch.arange(32) // 10
        msg = _raises(r"buffer 'l_self_buffers_docs_' \(shape \(16,\)\) by position", DocumentBias(docs[:16]),
                      *_qkv(), mask, strategy="flat")  # fmt: skip
        assert "Fix: keep the GLOBAL tensor" in msg
        out = _compile(DocumentBias(docs), *_qkv(), mask, strategy="flat")  # the global ids: compiles and runs
        assert out.shape == (1, 4, 16, 8)


def test_regather_is_refused_for_flex():
    """The flex region keeps its gathered K/V; regather=True there would be silently ignored, so it is refused."""
    with fake_group(0, 2):
        mask = cpcompile.shard_block_mask(block_mask("window", 1, 4, seq=32), strategy="flat")
        msg = _raises("regather=True", attention(None), *_qkv(), mask, strategy="flat", regather=True)
        assert "Fix: drop regather" in msg


def test_ring_is_refused_for_flex():
    with fake_group(0, 2):
        mask = cpcompile.shard_block_mask(block_mask("window", 1, 4, seq=32), strategy="flat")
        msg = _raises("comm='ring'", attention(None), *_qkv(), mask, strategy="flat", comm="ring")
        assert "Fix:" in msg and "all_gather" in msg
