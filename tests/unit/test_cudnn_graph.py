"""kernels/cudnn_graph on CPU: the ragged metadata the graphs read, and the ops' schemas and fakes.

The graphs themselves run only on a GPU (tests/gpu/test_cudnn_varlen.py compares them bit for bit with
cudnn-frontend's own ops); here, what cpcompile computes for them: lengths and element offsets from cu_seqlens and
each tensor's token stride, and output shapes a traced region allocates from.
"""

from __future__ import annotations

import sys

import pytest
import torch

from cpcompile.kernels import cudnn_graph as cg
from cpcompile.kernels import cudnn_varlen as cv
from tests.support import fake_cudnn


def test_metadata_is_lengths_then_prefixes_times_each_tensors_token_stride():
    cu_q = torch.tensor([0, 3, 3, 7], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 9, 12], dtype=torch.int32)
    columns = cg.sequence_columns(cu_q, cu_k)
    assert [c.dtype for c in columns] == [torch.int32, torch.int32, torch.int64, torch.int64]
    assert [tuple(c.shape) for c in columns] == [(3, 1, 1, 1), (3, 1, 1, 1), (4, 1, 1, 1), (4, 1, 1, 1)]
    keys = torch.zeros(12, 2, 2, 8)  # all_gather's (T, 2, Hkv, D) buffer: k and v are views of token stride 32
    k, v = keys[:, 0], keys[:, 1]
    meta = cg.ragged_metadata(columns, (4 * 8, 4 * 6, 4), (k.stride(0), v.stride(0)))
    assert len(meta) == len(cg.FWD_META)
    assert meta[0].view(-1).tolist() == [3, 0, 4] and meta[1].view(-1).tolist() == [5, 4, 3]
    want = [[0, 96, 96, 224], [0, 72, 72, 168], [0, 12, 12, 28], [0, 160, 288, 384], [0, 160, 288, 384]]
    assert [m.view(-1).tolist() for m in meta[2:]] == want
    assert all(m.dtype == torch.int64 and m.shape == (4, 1, 1, 1) for m in meta[2:])


def test_backward_totals_round_to_64_as_the_frontend_sizes_its_accumulator():
    assert [cg.round64(n) for n in (1, 63, 64, 65, 4096)] == [64, 64, 64, 128, 4096]


def test_fakes_give_the_shapes_a_traced_region_allocates():
    q = torch.empty(10, 4, 192, device="meta", dtype=torch.bfloat16)  # MLA dims: q/k 192, v 128
    k = torch.empty(12, 2, 192, device="meta", dtype=torch.bfloat16)
    v = torch.empty(12, 2, 128, device="meta", dtype=torch.bfloat16)
    lengths = [torch.empty(3, 1, 1, 1, device="meta", dtype=torch.int32)] * 2
    offsets = [torch.empty(4, 1, 1, 1, device="meta", dtype=torch.int64)]
    fwd = (lengths + offsets * 5, [32 * 192, 4 * 192, 4 * 128], 0.1, 5, 6, True, True, -1, -1)
    out, stats = torch.ops.cpcompile.cudnn_thd_fwd(q, k, v, *fwd)
    assert out.shape == (10, 4, 128) and out.dtype == torch.bfloat16
    assert stats.shape == (10, 4, 1) and stats.dtype == torch.float32
    padded = torch.empty(3, 4, 5, 1, device="meta")
    args = (
        out,
        q,
        k,
        v,
        out,
        padded,
        lengths + offsets * 7,
        [768, 512, 384, 256],
        0.1,
        5,
        6,
        True,
        True,
        -1,
        -1,
        False,
    )
    dq, dk, dv = torch.ops.cpcompile.cudnn_thd_bwd(*args)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert all(g.dtype == torch.bfloat16 and g.is_contiguous() for g in (dq, dk, dv))


@pytest.fixture
def graphs(monkeypatch):
    """cudnn_graph's graph code on the recording stand-in of the pygraph module, its ops called as functions (no
    CUDA kernel here), a fresh graph cache: the fake module (its `.graphs` in build order)."""
    fake = fake_cudnn.module()
    monkeypatch.setitem(sys.modules, "cudnn", fake)
    monkeypatch.setattr(cg, "_graphs", {})
    monkeypatch.setattr(cg, "_handle", lambda device: None)
    ops = type(
        "Ops", (), {"cudnn_thd_fwd": staticmethod(cg.cudnn_thd_fwd), "cudnn_thd_bwd": staticmethod(cg.cudnn_thd_bwd)}
    )
    monkeypatch.setattr(cv, "_ops", lambda: ops)
    return fake


RANGES = torch.tensor([[0, 5, 9], [5, 9, 12], [0, 7, 10], [7, 10, 16]])  # three sequences, tiled


def _inputs(hq, hkv, d, dv, seed=0):
    g = torch.Generator().manual_seed(seed)
    fused = torch.randn(12, 3, hq, d, generator=g).to(torch.bfloat16)  # q a view of a fused QKV output
    keys = torch.randn(16, 2, hkv, max(d, dv), generator=g).to(torch.bfloat16)  # all_gather's (T, 2, H, D) buffer
    return fused[:, 1], keys[:, 0, :, :d], keys[:, 1, :, :dv]


@pytest.mark.parametrize("ragged_stats", [False, True])
@pytest.mark.parametrize("heads", [(4, 2, 16, 16), (4, 1, 24, 8)])
@pytest.mark.parametrize("causal", [False, True], ids=["one_call", "split"])
def test_each_buffer_is_bound_to_its_descriptor_with_offsets_of_its_own_stride(
    graphs, heads, ragged_stats, causal, monkeypatch
):
    """Strided q (fused QKV), strided k/v views, GQA and MLA dims: in every graph a call runs (one a way, or a
    causal block's two split calls, each range addressed by its own offsets) every ragged tensor is bound to its
    buffer, declared with that buffer's token stride, and offset by its sequences' starts times it. Where the
    backward reads the stats ragged, they are the forward's own (one call) or the merged lse (split), offset by
    the q starts x Hq, with no padded scatter."""
    monkeypatch.setattr(cg, "reads_ragged_stats", lambda device: ragged_stats)
    monkeypatch.setattr(cv, "SPLIT_MIN_ROWS", 0)  # causal: these 12 rows split
    if ragged_stats:
        monkeypatch.setattr(cv, "padded_at", None)  # the padded scatter must not run
    q, k, v = _inputs(*heads)
    impl = cv.CuDNNVarlenKernel()
    prepared = impl.prepare(RANGES, 12, 16, 7, tiled=True)
    columns = [prepared[-13:-9], prepared[-9:-5]] if causal else [prepared[:4]]
    args = (RANGES, 7, 7, causal, 0.1)
    out, lse = impl.forward(q, k, v, *args, tiled=True, prepared=prepared)
    fwds = graphs.graphs[:]
    assert [g.op[0] for g in fwds] == ["fwd"] * len(columns)
    for fwd, (len_q, len_k, starts_q, starts_k) in zip(fwds, columns):
        stats = fwd.bound[int(cg.Uid.STATS)]
        mine = dict(q=q, k=k, v=v, stats=stats) | ({} if causal else dict(o=out))  # split: o is the call's own
        fake_cudnn.check_bindings(fwd, mine, starts_q.view(-1), starts_k.view(-1), [len_q, len_k])
    dout = torch.randn_like(out)
    dq, dk, dv = impl.backward(dout, q, k, v, out, lse.float(), *args, tiled=True, prepared=prepared)
    bwds = graphs.graphs[len(fwds) :]
    assert [g.op[0] for g in bwds] == ["bwd"] * len(columns)
    packed = dict(q=q, k=k, v=v, o=out, dO=dout)  # k, v: the views themselves; q: its copy (equal values)
    if not causal:
        packed |= dict(dq=dq, dk=dk, dv=dv)  # split: each call's gradients are its own, combined after
    for bwd, (len_q, len_k, starts_q, starts_k) in zip(bwds, columns):
        if ragged_stats:  # the (Tq, Hq, 1) values: the forward's (transposed view) or the merged lse's
            want = lse.float().t().unsqueeze(-1)  # (the fake graphs write nothing: NaN where undefined)
            assert torch.allclose(bwd.bound[int(cg.Uid.STATS)], want, rtol=0, atol=0, equal_nan=True)
            packed["stats"] = bwd.bound[int(cg.Uid.STATS)]
        fake_cudnn.check_bindings(bwd, packed, starts_q.view(-1), starts_k.view(-1), [len_q, len_k])
        declared = next(t for t in bwd.tensors if t.name == "stats")
        assert (declared.ragged is not None) == ragged_stats
        assert declared.stride == ([q.shape[1] * 7, 1, q.shape[1], 1] if ragged_stats else [q.shape[1] * 7, 7, 1, 1])


def test_the_backward_refuses_ragged_stats_where_the_gpu_reads_them_padded(graphs, monkeypatch):
    """SM8x / SM12x (or cuDNN < 9.6) take no ragged stats in a THD backward: one clear error, not a wrong read."""
    monkeypatch.setattr(cg, "reads_ragged_stats", lambda device: False)
    q, k, v = (t.contiguous() for t in _inputs(4, 2, 16, 16))
    prepared = cv.CuDNNVarlenKernel().prepare(RANGES, 12, 16, 7, tiled=True)
    hq = q.shape[1]
    meta = cg.ragged_metadata(prepared[:4], (hq * 16, hq * 16, hq * 16, hq), (2 * 16, 2 * 16, 2 * 16, 2 * 16))
    stats = torch.zeros(12, hq, 1)
    mask = cv.band_args(True, (-1, -1), False)
    args = (meta, [hq * 16, hq * 16, 32, 32], 0.1, 7, 7, *mask, False)
    with pytest.raises(ValueError, match="ragged .Tq, Hq, 1. stats on a GPU whose THD backward takes them padded"):
        cg.cudnn_thd_bwd(q, q, k, v, q, stats, *args)


def test_new_documents_reuse_the_graphs_and_a_restrided_input_is_refused(graphs):
    q, k, v = _inputs(4, 2, 16, 16)
    impl = cv.CuDNNVarlenKernel()
    other = torch.tensor([[0, 2, 9], [2, 9, 12], [0, 4, 10], [4, 10, 16]])  # other documents, same count
    for ranges in (RANGES, other):
        impl.forward(q, k, v, ranges, 7, 7, True, 0.1, tiled=True)  # 12 rows: below the split's threshold
    assert len(graphs.graphs) == 1 and len(cg.graph_keys()) == 1
    prepared = impl.prepare(RANGES, 12, 16, 7, tiled=True)
    meta = cg.ragged_metadata(prepared[:4], (q.stride(0), 64, 4), (k.stride(0), v.stride(0)))
    mask = cv.band_args(True, (-1, -1), False)
    tokens = [q.stride(0), k.stride(0), v.stride(0)]
    with pytest.raises(
        RuntimeError, match="q's token stride is 64 at run time but its ragged offsets were made for 192"
    ):
        cg.cudnn_thd_fwd(q.contiguous(), k, v, meta, tokens, 0.1, 7, 7, *mask)
    with pytest.raises(ValueError, match="6 metadata columns, the graph reads 7"):
        cg.cudnn_thd_fwd(q, k, v, meta[:6], tokens, 0.1, 7, 7, *mask)
    with pytest.raises(RuntimeError, match="cudnn_thd_fwd has no derivative"):  # torch alone would only warn
        cg.cudnn_thd_fwd(q.detach().requires_grad_(), k, v, meta, tokens, 0.1, 7, 7, *mask)
    with torch.no_grad():  # as under the region's autograd.Function
        cg.cudnn_thd_fwd(q.detach().requires_grad_(), k, v, meta, tokens, 0.1, 7, 7, *mask)


@pytest.mark.parametrize(
    "major,version,ragged",
    [(8, 91900, False), (9, 90599, False), (9, 90600, True), (10, 91900, True), (12, 91900, False)],
)
def test_ragged_stats_follow_the_architecture_and_the_cudnn_version(monkeypatch, major, version, ragged):
    """The rule the backward's stats form follows (TransformerEngine's for the same graph): ragged from cuDNN 9.6
    on, except on SM8x and SM12x, whose THD backward refuses them; never off CUDA. Asked per device index, the
    current device's when the index is unset. Switched off (RAGGED_STATS_ON, NaN on an H100): padded everywhere."""
    cg._ragged_stats_at.cache_clear()
    assert cg.RAGGED_STATS_ON is False and cg.reads_ragged_stats(torch.device("cuda")) is False
    monkeypatch.setattr(cg, "RAGGED_STATS_ON", True)
    fake = fake_cudnn.module()
    fake.backend_version = lambda: version
    monkeypatch.setitem(sys.modules, "cudnn", fake)
    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: asked.append(index) or (major, 0))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    cg._ragged_stats_at.cache_clear()
    try:
        assert cg.reads_ragged_stats(torch.device("cuda", 1)) is ragged
        assert cg.reads_ragged_stats(torch.device("cuda")) is ragged
        assert asked == [1, 3]
        assert cg.reads_ragged_stats(torch.device("cpu")) is False
    finally:
        cg._ragged_stats_at.cache_clear()


def test_token_major_views_are_read_in_place_and_the_rest_copied():
    fused = torch.empty(6, 3, 4, 8)  # a fused projection: (T, 3, H, D)
    keys = torch.empty(6, 2, 2, 8)  # all_gather's (T, 2, Hkv, D)
    assert cv.token_major(fused[:, 1]) and cv.token_major(keys[:, 0]) and cv.token_major(torch.empty(6, 4, 8))
    assert not cv.token_major(torch.empty(4, 6, 8).transpose(0, 1))  # head-major
    assert not cv.token_major(torch.empty(6, 8, 4).transpose(1, 2))  # dims not dense
    assert not cv.token_major(torch.empty(1, 4, 8))  # one token: its stride is arbitrary
