"""A recording stand-in for cudnn-frontend's pygraph module, so kernels/cudnn_graph's graph code runs on a CPU.

It builds nothing and computes nothing: it records every tensor a graph declares (dims, strides, uid, ragged
offset tensor) and, at execute, which buffer each uid is bound to. `check_bindings` then asserts what the GPU would
otherwise be the first to see: each ragged tensor bound to the right buffer, its descriptor's token stride equal
to that buffer's, its offsets equal to cu_seqlens times that stride, the length columns the prefix differences.
"""

from __future__ import annotations

import types

import torch


class _Tensor:
    def __init__(self, name=None, dim=None, stride=None, data_type=None, uid=None):
        self.name, self.dim, self.stride, self.data_type, self.uid = name, dim, stride, data_type, uid
        self.ragged, self.output = None, False

    def set_ragged_offset(self, offset):
        self.ragged = offset
        return self

    def set_uid(self, uid):
        self.uid = uid
        return self

    def set_output(self, output):
        self.output = output
        return self

    def set_dim(self, dim):
        self.dim = dim
        return self

    def set_stride(self, stride):
        self.stride = stride
        return self

    def set_data_type(self, data_type):
        self.data_type = data_type
        return self


class Graph:
    def __init__(self, **_):
        self.tensors: list[_Tensor] = []
        self.op: tuple[str, dict] | None = None
        self.bound: dict[int, torch.Tensor] = {}

    def tensor(self, **kw):
        self.tensors.append(_Tensor(**kw))
        return self.tensors[-1]

    def _outputs(self, *names):
        made = [_Tensor(name=n) for n in names]
        self.tensors += made
        return made

    def sdpa(self, **kw):
        self.op = ("fwd", kw)
        return self._outputs("o", "stats")

    def sdpa_backward(self, **kw):
        self.op = ("bwd", kw)
        return self._outputs("dq", "dk", "dv")

    def validate(self):
        pass

    build_operation_graph = check_support = build_plans = validate

    def create_execution_plans(self, modes):
        pass

    def get_workspace_size(self):
        return 0

    def execute(self, buffers, workspace, handle=None, tensor_uids=None):
        assert len(buffers) == len(tensor_uids) == len(set(tensor_uids))
        self.bound = dict(zip(tensor_uids, buffers))


def module() -> types.ModuleType:
    """A `cudnn` module with what cudnn_graph reads; every graph it makes is kept in `.graphs`."""
    m = types.ModuleType("cudnn")
    m.graphs = []

    def pygraph(**kw):
        m.graphs.append(Graph(**kw))
        return m.graphs[-1]

    m.pygraph = pygraph
    m.data_type = types.SimpleNamespace(HALF="half", BFLOAT16="bf16", FLOAT="float", INT32="int32", INT64="int64")
    m.diagonal_alignment = types.SimpleNamespace(BOTTOM_RIGHT="bottom_right", TOP_LEFT="top_left")
    m.heur_mode = types.SimpleNamespace(A="A", FALLBACK="FALLBACK")
    return m


Q_SIDE = ("q", "o", "dO", "dq", "stats")


def check_bindings(
    g: Graph, buffers: dict[str, torch.Tensor], cu_q: torch.Tensor, cu_k: torch.Tensor, lengths=None
) -> None:
    """Every declared tensor named in `buffers` is bound to that buffer, and every ragged one reads it right:
    offsets `cu_q` / `cu_k` (each sequence's token start, B + 1 entries) times its token stride, and sequence
    lengths `lengths` (len_q, len_k), by default the prefix differences of adjacent sequences."""
    for t in g.tensors:
        if t.name not in buffers:
            continue
        buf = g.bound[int(t.uid)]
        ref = buffers[t.name]  # outputs by identity (still unwritten here), inputs by identity or value (copies)
        same = buf.data_ptr() == ref.data_ptr() and buf.shape == ref.shape and buf.stride() == ref.stride()
        assert same or torch.equal(buf, ref), f"{t.name}: bound to another buffer"
        if t.ragged is None:
            continue
        assert buf.shape[0] < 2 or t.stride[2] == buf.stride(0), f"{t.name}: descriptor {t.stride}, {buf.stride()}"
        cu = cu_q if t.name in Q_SIDE else cu_k
        offsets = g.bound[int(t.ragged.uid)]
        assert offsets.is_contiguous() and offsets.dtype == torch.int64, f"{t.name}: offsets column"
        assert torch.equal(offsets.view(-1), cu.long() * buf.stride(0)), f"{t.name}: offsets not cu x token stride"
    kw = g.op[1]
    want = lengths or [(cu[1:] - cu[:-1]).int() for cu in (cu_q, cu_k)]
    for side, n in zip(("seq_len_q", "seq_len_kv"), want):
        got = g.bound[int(kw[side].uid)]
        assert got.dtype == torch.int32 and torch.equal(got.view(-1), n.view(-1).int()), side
