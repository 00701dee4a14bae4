"""Packed documents under state passing, without collectives (cpcompile/mixers/documents.py, state_region.py): each
chunk's transition and outputs (state_region.chunk_transition with the chunk's own offsets), composed in sequence
order (state_region.initial_states), against a brute-force sequential scan with resets over the whole buffer,
forward and every input gradient; the conv's halo with moved offsets against the whole-buffer conv; the index math
at its edges. fp64, the test's own per-token references (tests/support/gdn.py), themselves checked against running
the plain functions document by document."""

from __future__ import annotations

import pytest
import torch

from cpcompile.mixers.declare import MixerSpec, StateArgs
from cpcompile.mixers.documents import carried, chunk_offsets, containing
from cpcompile.mixers.state_region import chunk_transition, initial_states
from tests.support.gdn import PackedCausalConv, gated_delta_rule

H, DK, DV, KERNEL = 2, 3, 2, 4

CASES = [
    # (document lengths, chunks): a start exactly at a chunk edge, one-token documents, documents shorter than the
    # conv kernel, a document over 3+ chunks, empty documents (padding), a chunk with several starts inside
    ([3, 5, 1, 2, 5], 2),
    ([5, 6, 2, 3], 2),
    ([1, 10, 2, 3], 4),
    ([4, 3, 1, 8], 4),
    ([2, 1, 1, 7, 1], 3),
    ([12, 0, 0], 3),
    ([0, *[1] * 16, 0], 4),
]


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _scan_inputs(n: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(1, n, H, DK, generator=gen, dtype=torch.float64), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(1, n, H, DK, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(1, n, H, DV, generator=gen, dtype=torch.float64)
    g = -torch.rand(1, n, H, generator=gen, dtype=torch.float64)
    beta = torch.rand(1, n, H, generator=gen, dtype=torch.float64)
    return [t.requires_grad_() for t in (q, k, v, g, beta)]


def test_the_packed_references_run_each_document_alone():
    """tests/support/gdn.py's packed scan and conv equal the plain ones run document by document."""
    cu = _cu([3, 1, 0, 5, 2])
    n = int(cu[-1])
    q, k, v, g, beta = _scan_inputs(n, 0)
    init = torch.randn(cu.numel() - 1, H, DK, DV, dtype=torch.float64)
    out, finals = gated_delta_rule(q, k, v, g, beta, init, True, cu_seqlens=cu)
    conv = PackedCausalConv(2 * H, KERNEL).double()
    x = torch.randn(1, n, 2 * H, dtype=torch.float64)
    y = conv(x, cu_seqlens=cu)
    for d, (a, b) in enumerate(zip(cu.tolist(), cu[1:].tolist())):
        if b == a:  # an empty document: its final state is its initial one
            torch.testing.assert_close(finals[d], init[d], rtol=0, atol=0)
            continue
        ref, ref_final = gated_delta_rule(*(t[:, a:b] for t in (q, k, v, g, beta)), init[d : d + 1], True)
        torch.testing.assert_close(finals[d : d + 1], ref_final, rtol=0, atol=1e-13)
        torch.testing.assert_close(out[:, a:b], ref, rtol=0, atol=1e-13)
        torch.testing.assert_close(y[:, a:b], conv(x[:, a:b]), rtol=0, atol=1e-13)


def _spec() -> MixerSpec:
    return MixerSpec(-1, "gated_delta_rule", 2, 1, fn=gated_delta_rule, comm="state", state=StateArgs(),
                     documents="cu_seqlens")  # fmt: skip


@pytest.mark.parametrize("lengths,chunks", CASES)
def test_chunk_transitions_compose_to_a_scan_with_resets(lengths, chunks):
    """Every chunk run alone from [0 | I] with its own offsets, the transitions composed in order: the outputs and
    every input gradient equal one sequential scan over the buffer restarting at each document, and the state after
    the last chunk is the last document's final state."""
    cu = _cu(lengths)
    n = int(cu[-1])
    c = n // chunks
    inputs = _scan_inputs(n, len(lengths) + chunks)
    ref, finals = gated_delta_rule(*inputs, output_final_state=True, cu_seqlens=cu)
    runs = []
    for i in range(chunks):
        q, k, v, g, beta = (t[:, i * c : (i + 1) * c] for t in inputs)
        kwargs = dict(query=q, key=k, value=v, g=g, beta=beta)
        runs.append(chunk_transition(_spec(), [], (), kwargs, DK, torch.float64, ("cu_seqlens", cu, i * c)))
    states = initial_states(lambda i: runs[i][1], tuple(range(chunks)), DV, torch.float64)
    outs = []
    for (out, _), state in zip(runs, states):
        o, p = out.split([DV, DK], dim=-1)
        outs.append(o if state is None else o + torch.einsum("blhk,bhkv->blhv", p, state))
    got = torch.cat(outs, dim=1)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)
    b, m = runs[-1][1].split([DV, DK], dim=-1)
    last = m @ states[-1] + b if states[-1] is not None else b
    torch.testing.assert_close(last[0], finals[containing(cu, n - 1)][0], rtol=0, atol=1e-12)
    weight = torch.randn(ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    grads = torch.autograd.grad((got * weight).sum(), inputs)
    ref_grads = torch.autograd.grad((ref * weight).sum(), inputs)
    for name, a, r in zip(("q", "k", "v", "g", "beta"), grads, ref_grads):
        torch.testing.assert_close(a, r, rtol=0, atol=1e-11, msg=name)


@pytest.mark.parametrize("lengths,chunks", CASES)
def test_the_halo_does_not_cross_a_document_start(lengths, chunks):
    """Each chunk with the previous chunk's last kernel-1 tokens put first (zeros before chunk 0) and the offsets
    moved with them, its first kernel-1 outputs dropped: the whole buffer's conv, values and input gradient (the
    halo's gradient reaching the previous chunk only from its own document)."""
    cu = _cu(lengths)
    n = int(cu[-1])
    c, lead = n // chunks, KERNEL - 1
    conv = PackedCausalConv(3, KERNEL).double()
    x = torch.randn(1, n, 3, dtype=torch.float64, requires_grad=True)
    ref = conv(x, cu_seqlens=cu)
    outs = []
    for i in range(chunks):
        before = x[:, i * c - lead : i * c] if i else x.new_zeros(1, lead, 3)
        offsets = chunk_offsets(cu, i * c, c, lead=lead)
        outs.append(conv(torch.cat([before, x[:, i * c : (i + 1) * c]], dim=1), cu_seqlens=offsets)[:, lead:])
    got = torch.cat(outs, dim=1)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-13)
    weight = torch.randn(ref.shape, dtype=torch.float64)
    torch.testing.assert_close(
        torch.autograd.grad((got * weight).sum(), x)[0], torch.autograd.grad((ref * weight).sum(), x)[0]
    )


def test_the_index_math_at_its_edges():
    cu = torch.tensor([0, 3, 8, 8, 9, 16, 16])
    assert chunk_offsets(cu, 8, 8).tolist() == [0, 0, 0, 0, 1, 8, 8]
    assert chunk_offsets(cu, 8, 8, lead=3).tolist() == [0, 0, 3, 3, 4, 11, 11]
    assert chunk_offsets(cu, 0, 8, lead=3).tolist() == [0, 6, 11, 11, 11, 11, 11]  # the halo's zeros join doc 0
    assert carried(cu, 8).tolist() == [False] * 6  # a chunk that begins at a document start carries nothing in
    assert carried(cu, 0).tolist() == [False] * 6
    assert carried(cu, 10).tolist() == [False, False, False, False, True, False]
    assert containing(cu, 7).tolist() == [1] and containing(cu, 8).tolist() == [3]  # empty document 2 skipped
    assert containing(cu, 15).tolist() == [4]
