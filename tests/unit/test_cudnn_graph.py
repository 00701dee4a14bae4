"""kernels/cudnn_graph on CPU: the ragged metadata the graphs read, and the ops' schemas and fakes.

The graphs themselves run only on a GPU (tests/gpu/test_cudnn_varlen.py compares them bit for bit with
cudnn-frontend's own ops); here, what cpcompile computes for them: lengths and element offsets from cu_seqlens and
each tensor's token stride, and output shapes a traced region allocates from.
"""

from __future__ import annotations

import torch

from cpcompile.kernels import cudnn_graph as cg


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
    out, stats = torch.ops.cpcompile.cudnn_thd_fwd(q, k, v, lengths + offsets * 5, 0.1, 5, 6, True, True, -1, -1)
    assert out.shape == (10, 4, 128) and out.dtype == torch.bfloat16
    assert stats.shape == (10, 4, 1) and stats.dtype == torch.float32
    padded = torch.empty(3, 4, 5, 1, device="meta")
    args = (out, q, k, v, out, padded, lengths + offsets * 7, 0.1, 5, 6, True, True, -1, -1, False)
    dq, dk, dv = torch.ops.cpcompile.cudnn_thd_bwd(*args)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert all(g.dtype == torch.bfloat16 and g.is_contiguous() for g in (dq, dk, dv))
