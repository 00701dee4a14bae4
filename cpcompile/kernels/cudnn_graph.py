"""cuDNN THD attention from graphs cpcompile builds once a key and executes with metadata made in its graph.

Why: cudnn-frontend 1.32's torch ops (`torch.ops.cudnn.sdpa_fwd/_bwd`) do, in Python, on every call: validate
their arguments, hash a ~23-field graph key, bind the stream, allocate, and rebuild the ragged lengths and
offsets from cu_seqlens before `execute`. That is ~0.4-0.5 ms of host a call each way on the H200
(bench/probes/cudnn_aten_probe.py, cudnn_host_probe.py), which at 4K tokens a rank makes the host, not the GPU,
set the step, and makes kernel="auto" take FA2 although cuDNN's GPU time is 1.6-1.8x shorter.

What changes here:
- the graphs are the same (the frontend's public pygraph API: `sdpa` / `sdpa_backward`, ragged offsets, padding
  mask, the diagonal band), built the first time a key is seen and kept (`_graphs`);
- the lengths and element offsets the graphs read are plain tensor ops on cu_seqlens (`ragged_metadata`), made
  where the provider is traced, so Inductor compiles them into the region's code: no per-call Python for them;
- a call (`cpcompile::cudnn_thd_fwd` / `_bwd`) is: look up the graph, bind this thread's handle to the current
  stream, allocate outputs and workspace, execute.

Numerics are the frontend op's: the same graph on the same buffers (tests/gpu/test_cudnn_varlen.py compares).
A departure it can take, switched off (`RAGGED_STATS_ON`, `reads_ragged_stats`): the backward reading the forward's
stats as the forward wrote them, token-major and ragged, instead of scattered into a padded (B, Hq, max_q, 1) buffer
first, which costs a region ~8 kernels a call (the sequence ids, the slots, the scatter;
bench/probes/step_launches.py). The frontend keeps the padded form because SM8x and SM12x refuse ragged stats in a
THD backward; TransformerEngine reads them ragged on the others with cuDNN >= 9.6; on an H100 here they gave NaN.
`ops()` is the seam the CPU tests replace with a stand-in of these ops' contract (tests/support/cudnn_stand_in.py).
"""

from __future__ import annotations

import functools
import threading
from enum import IntEnum

import torch

FWD_META = ("len_q", "len_k", "q", "o", "stats", "k", "v")
"""The forward's metadata, in order: two int32 length columns (B, 1, 1, 1), then int64 element offsets
(B + 1, 1, 1, 1) of each ragged tensor's sequences, each its cu_seqlens times that tensor's token stride."""
BWD_META = ("len_q", "len_k", "q", "o", "dq", "k", "v", "dk", "dv")
"""The backward's metadata, as FWD_META (dO shares O's offsets: the provider hands both contiguous), with the
stats padded."""
BWD_META_RAGGED_STATS = ("len_q", "len_k", "q", "o", "dq", "stats", "k", "v", "dk", "dv")
"""The backward's metadata when it reads the stats ragged (`reads_ragged_stats`): their offsets too."""

RAGGED_STATS_CUDNN = 90600
"""The first cuDNN whose THD backward takes ragged stats (TransformerEngine's threshold for the same graph)."""
RAGGED_STATS_ON = False
"""Off: on an H100 (cuDNN 9.19) the ragged-stats backward gave NaN in 2 of 12 cases of bench/probes/cudnn_view_bwd.py
and in the THD parity test (bench/results/logs/cudnn_view_bwd_h100.txt): padded until that is understood."""


class Uid(IntEnum):
    """The graphs' tensor uids: what `execute` binds each buffer to (tests read the bindings by them)."""

    Q, K, V, O, STATS, DO, DQ, DK, DV = 1, 2, 3, 4, 5, 6, 7, 8, 9
    LEN_Q, LEN_K = 10, 11
    OFF_Q, OFF_K, OFF_V, OFF_O, OFF_STATS, OFF_DQ, OFF_DK, OFF_DV = 12, 13, 14, 15, 16, 17, 18, 19


_FWD_UIDS = (Uid.Q, Uid.K, Uid.V, Uid.O, Uid.STATS, Uid.LEN_Q, Uid.LEN_K, Uid.OFF_Q, Uid.OFF_O,
             Uid.OFF_STATS, Uid.OFF_K, Uid.OFF_V)  # fmt: skip
_BWD_UIDS = (Uid.Q, Uid.K, Uid.V, Uid.O, Uid.DO, Uid.STATS, Uid.DQ, Uid.DK, Uid.DV,
             Uid.LEN_Q, Uid.LEN_K, Uid.OFF_Q, Uid.OFF_O, Uid.OFF_DQ, Uid.OFF_K, Uid.OFF_V, Uid.OFF_DK,
             Uid.OFF_DV)  # fmt: skip
_BWD_UIDS_RAGGED_STATS = (*_BWD_UIDS[:14], Uid.OFF_STATS, *_BWD_UIDS[14:])


def reads_ragged_stats(device: torch.device) -> bool:
    """Whether the THD backward on `device` reads the forward's stats ragged (token-major, (Tq, Hq, 1) fp32, offsets
    cu_seqlens_q x Hq): never while `RAGGED_STATS_ON` is off; on, a CUDA GPU outside SM8x and SM12x (the frontend:
    "Packed/ragged LSE is not supported" there) with cuDNN >= 9.6. Elsewhere the provider scatters them padded.
    Static per device: the region's graph is traced with one form."""
    if device.type != "cuda" or not RAGGED_STATS_ON:
        return False
    return _ragged_stats_at(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _ragged_stats_at(index: int) -> bool:
    import cudnn

    major, _ = torch.cuda.get_device_capability(index)
    return major not in (8, 12) and cudnn.backend_version() >= RAGGED_STATS_CUDNN


def sequence_columns(cu_q: torch.Tensor, cu_k: torch.Tensor) -> list[torch.Tensor]:
    """(len_q, len_k, prefix_q, prefix_k): the int32 length columns (B, 1, 1, 1) and the int64 prefix columns
    (B + 1, 1, 1, 1) of the cu_seqlens: what a block's calls share, made once per batch with its metadata."""
    lengths = [(c[1:] - c[:-1]).to(torch.int32).view(-1, 1, 1, 1) for c in (cu_q, cu_k)]
    return lengths + [c.to(torch.int64).view(-1, 1, 1, 1) for c in (cu_q, cu_k)]


def range_columns(ranges: torch.Tensor) -> list[torch.Tensor]:
    """`sequence_columns`' four columns with each range addressed directly, one sequence a range: int32 lengths
    qe - qs and ke - ks (B, 1, 1, 1), int64 starts qs and ks (B + 1, 1, 1, 1; the last entry each side's largest
    end). The graphs read each sequence from its own offset, so ranges need no gap sequences between them (FA2's
    cu_seqlens do: half the grid of the adjacent encoding)."""
    qs, qe, ks, ke = ranges.long()
    lengths = [(e - s).to(torch.int32).view(-1, 1, 1, 1) for s, e in ((qs, qe), (ks, ke))]
    return lengths + [torch.cat((s, e.max().view(1))).view(-1, 1, 1, 1) for s, e in ((qs, qe), (ks, ke))]


def ragged_metadata(columns: list[torch.Tensor], q_strides, k_strides) -> list[torch.Tensor]:
    """The lengths and element offsets a graph reads (FWD_META / BWD_META order) from `sequence_columns`: each
    ragged tensor's offsets are its side's prefix times its token stride, one multiply a tensor (traced with the
    provider, Inductor fuses them)."""
    len_q, len_k, prefix_q, prefix_k = columns
    return [len_q, len_k, *(prefix_q * s for s in q_strides), *(prefix_k * s for s in k_strides)]


def round64(n: int) -> int:
    """The packed totals a backward graph is sized for (its dq accumulator), rounded as the frontend does."""
    return (n + 63) // 64 * 64


# ---------------------------------------------------------------------------------------------------------------
# graphs: built once a key, executed from any thread with that thread's handle (built plans are immutable)

_graphs: dict[tuple, tuple] = {}
_build_lock = threading.Lock()
_local = threading.local()


def _handle(device: torch.device):
    """This thread's cuDNN handle for `device`, bound to torch's current stream there."""
    import cudnn

    handles = getattr(_local, "handles", None)
    if handles is None:
        handles = _local.handles = {}
    handle = handles.get(device.index)
    if handle is None:
        with torch.cuda.device(device):
            handle = handles[device.index] = cudnn.create_handle()
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(device).cuda_stream)
    return handle


GRAPHS_KEPT = 128
"""Graphs kept at most (the oldest goes first, as the frontend op's cache): a model's call sites need a handful;
recompiles with new packed totals (dynamic shapes) would otherwise add backward graphs without end."""


def _cached(key: tuple, build) -> tuple:
    hit = _graphs.get(key)
    if hit is None:
        with _build_lock:
            hit = _graphs.get(key)
            if hit is None:
                hit = _graphs[key] = build()
                while len(_graphs) > GRAPHS_KEPT:
                    _graphs.pop(next(iter(_graphs)))
    return hit


def graph_keys() -> frozenset:
    """The keys of the graphs this process has built (tests: new documents must build none)."""
    with _build_lock:
        return frozenset(_graphs)


def _desc(t: torch.Tensor, s_max: int) -> list[int]:
    """A packed (T, H, D) tensor's (B, H, S, D) descriptor strides: its real token stride (views of a (T, 2, H, D)
    buffer have 2HD); the batch stride is a placeholder, each sequence's base comes from its ragged offset."""
    s_t, s_h, s_d = t.stride()
    return [s_max * s_t, s_h, s_t, s_d]


def _packed(h: int, s: int, d: int) -> list[int]:
    return [s * h * d, d, h * d, 1]


def _new_graph(handle, dtype: torch.dtype):
    import cudnn

    io = {torch.float16: cudnn.data_type.HALF, torch.bfloat16: cudnn.data_type.BFLOAT16}[dtype]
    g = cudnn.pygraph(handle=handle, io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT,
                      compute_data_type=cudnn.data_type.FLOAT)  # fmt: skip
    return g, io


def _columns(g, b: int, uids) -> list:
    """The length columns (int32, b) then the offset columns (int64, b + 1) of `uids`' order."""
    import cudnn

    lens = [g.tensor(name=f"len{int(u)}", dim=[b, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT32,
                     uid=u) for u in uids[:2]]  # fmt: skip
    offs = [g.tensor(name=f"off{int(u)}", dim=[b + 1, 1, 1, 1], stride=[1, 1, 1, 1],
                     data_type=cudnn.data_type.INT64, uid=u) for u in uids[2:]]  # fmt: skip
    return lens + offs


def _band(is_causal: bool, bottom_right: bool, left: int, right: int) -> dict:
    import cudnn

    align = cudnn.diagonal_alignment.BOTTOM_RIGHT if bottom_right else cudnn.diagonal_alignment.TOP_LEFT
    rb = right if right >= 0 else (0 if is_causal else None)
    return dict(diagonal_alignment=align, diagonal_band_left_bound=left if left >= 0 else None,
                diagonal_band_right_bound=rb)  # fmt: skip


def _finish(g, uids) -> tuple:
    import cudnn

    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans()
    return g, g.get_workspace_size(), tuple(int(u) for u in uids)


def _build_fwd(handle, q, k, v, b: int, s_q: int, s_k: int, scale: float, band: dict) -> tuple:
    import cudnn

    g, io = _new_graph(handle, q.dtype)
    hq, hk, hv, d, dv = q.shape[1], k.shape[1], v.shape[1], q.shape[2], v.shape[2]
    qt = g.tensor(name="q", dim=[b, hq, s_q, d], stride=_desc(q, s_q), data_type=io, uid=Uid.Q)
    kt = g.tensor(name="k", dim=[b, hk, s_k, d], stride=_desc(k, s_k), data_type=io, uid=Uid.K)
    vt = g.tensor(name="v", dim=[b, hv, s_k, dv], stride=_desc(v, s_k), data_type=io, uid=Uid.V)
    len_q, len_k, off_q, off_o, off_stats, off_k, off_v = _columns(g, b, _FWD_UIDS[5:])
    for t, off in ((qt, off_q), (kt, off_k), (vt, off_v)):
        t.set_ragged_offset(off)
    o, stats = g.sdpa(name="sdpa_fwd", q=qt, k=kt, v=vt, generate_stats=True, attn_scale=scale,
                      use_padding_mask=True, seq_len_q=len_q, seq_len_kv=len_k, **band)  # fmt: skip
    o.set_uid(Uid.O).set_output(True).set_dim([b, hq, s_q, dv]).set_stride(_packed(hq, s_q, dv)).set_data_type(io)
    o.set_ragged_offset(off_o)
    stats.set_uid(Uid.STATS).set_output(True).set_dim([b, hq, s_q, 1]).set_stride([s_q * hq, 1, hq, 1])
    stats.set_data_type(cudnn.data_type.FLOAT).set_ragged_offset(off_stats)
    return _finish(g, _FWD_UIDS)


def _build_bwd(handle, q, k, v, o, tq, tk, b, s_q, s_k, scale, band, deterministic, ragged_stats) -> tuple:
    import cudnn

    g, io = _new_graph(handle, q.dtype)
    hq, hk, hv, d, dv = q.shape[1], k.shape[1], v.shape[1], q.shape[2], v.shape[2]
    qt = g.tensor(name="q", dim=[b, hq, s_q, d], stride=_desc(q, s_q), data_type=io, uid=Uid.Q)
    kt = g.tensor(name="k", dim=[b, hk, s_k, d], stride=_desc(k, s_k), data_type=io, uid=Uid.K)
    vt = g.tensor(name="v", dim=[b, hv, s_k, dv], stride=_desc(v, s_k), data_type=io, uid=Uid.V)
    ot = g.tensor(name="o", dim=[b, hq, s_q, dv], stride=_desc(o, s_q), data_type=io, uid=Uid.O)
    dot = g.tensor(name="dO", dim=[b, hq, s_q, dv], stride=_desc(o, s_q), data_type=io, uid=Uid.DO)
    # the stats: ragged and token-major as the forward wrote them, or PADDED (B, Hq, S_q, 1) where the backend
    # takes no ragged LSE in a THD backward (reads_ragged_stats)
    stride = [hq * s_q, 1, hq, 1] if ragged_stats else [hq * s_q, s_q, 1, 1]
    st = g.tensor(name="stats", dim=[b, hq, s_q, 1], stride=stride, data_type=cudnn.data_type.FLOAT, uid=Uid.STATS)
    uids = _BWD_UIDS_RAGGED_STATS if ragged_stats else _BWD_UIDS
    columns = _columns(g, b, uids[9:])
    if ragged_stats:
        st.set_ragged_offset(columns.pop(5))
    len_q, len_k, off_q, off_o, off_dq, off_k, off_v, off_dk, off_dv = columns
    for t, off in ((qt, off_q), (kt, off_k), (vt, off_v), (ot, off_o), (dot, off_o)):
        t.set_ragged_offset(off)
    dq, dk, dv_ = g.sdpa_backward(
        name="sdpa_bwd", q=qt, k=kt, v=vt, o=ot, dO=dot, stats=st, attn_scale=scale, use_padding_mask=True,
        seq_len_q=len_q, seq_len_kv=len_k, max_total_seq_len_q=round64(tq), max_total_seq_len_kv=round64(tk),
        use_deterministic_algorithm=deterministic, **band,
    )  # fmt: skip
    for t, uid, h, s, dd, off in ((dq, Uid.DQ, hq, s_q, d, off_dq), (dk, Uid.DK, hk, s_k, d, off_dk),
                                   (dv_, Uid.DV, hv, s_k, dv, off_dv)):  # fmt: skip
        t.set_uid(uid).set_output(True).set_dim([b, h, s, dd]).set_stride(_packed(h, s, dd)).set_data_type(io)
        t.set_ragged_offset(off)
    return _finish(g, uids)


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """An input as the kernels can read it: a base pointer off 16 bytes faults them, so such a tensor is copied
    into a fresh buffer with the SAME strides (the offsets in the metadata were computed from them). Rare: the
    regions' views start at token boundaries of 16-byte rows."""
    if t.data_ptr() % 16 == 0:
        return t
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).copy_(t)


def _column(t: torch.Tensor) -> torch.Tensor:
    """A metadata column as the graph declares it: contiguous (stride 1 along the sequences), 16-byte aligned."""
    return t if t.is_contiguous() and t.data_ptr() % 16 == 0 else t.clone(memory_format=torch.contiguous_format)


def _execute(g, ws: int, uids, inputs: list[torch.Tensor], outputs: list[torch.Tensor], meta, device, handle) -> None:
    """Run a built graph: buffers in its uids' order (inputs, outputs, then the metadata columns)."""
    workspace = torch.empty(max(ws, 1), dtype=torch.uint8, device=device)
    buffers = [_aligned(t) for t in inputs] + outputs + [_column(t) for t in meta]
    g.execute(buffers, workspace, handle=handle, tensor_uids=uids)


def _check(op: str, q: torch.Tensor, named: dict[str, torch.Tensor], tokens: list[int], meta, n_meta: int) -> None:
    """The checks of the frontend op that matter here, on the host, cheaply: no input that wants a gradient (the ops
    have no autograd kernel, and torch would only warn), one io dtype and device, dense last dims, the metadata's
    count, and each ragged input's token stride equal to the one its offsets were made with
    (`tokens`, named's order): a layout pass that restrided an input between the trace and the call would
    otherwise shift every sequence's base."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in named.values()):
        raise RuntimeError(f"{op} has no derivative: it runs under the region's autograd.Function (cudnn_varlen's "
                           "forward and backward), with grad off")  # fmt: skip
    if len(meta) != n_meta:
        raise ValueError(f"{op}: {len(meta)} metadata columns, the graph reads {n_meta} (cudnn_graph.ragged_metadata)")
    for (name, t), token in zip(named.items(), tokens):
        if t.dtype != q.dtype or t.device != q.device or t.stride(-1) != 1:
            raise ValueError(f"{op}: {name} is {t.dtype} on {t.device} with strides {t.stride()}; the graph reads "
                             f"{q.dtype} on {q.device} with a dense last dim")  # fmt: skip
        if t.shape[0] > 1 and t.stride(0) != token:
            raise RuntimeError(f"{op}: {name}'s token stride is {t.stride(0)} at run time but its ragged offsets "
                               f"were made for {token}: a pass changed the layout the trace saw")  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# the ops the provider records into the region's graph. Defined on a Library fragment with a CUDA kernel and a fake,
# not with torch.library.custom_op: its autograd and aliasing wrappers cost a call ~25-100 us more of host in Python
# (the provider runs under the region's own autograd.Function, so these ops need no autograd of their own). Tagged
# needs_exact_strides: Inductor hands them the strides the trace saw, which `tokens` records and the kernels check.

_lib = torch.library.Library("cpcompile", "FRAGMENT")
_TAGS = (torch.Tag.needs_exact_strides,) if hasattr(torch.Tag, "needs_exact_strides") else ()
_lib.define(
    "cudnn_thd_fwd(Tensor q, Tensor k, Tensor v, Tensor[] meta, int[] tokens, float scale, int max_q, int max_k, "
    "bool is_causal, bool bottom_right, int left, int right) -> (Tensor, Tensor)",
    tags=_TAGS,
)
_lib.define(
    "cudnn_thd_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor stats, Tensor[] meta, int[] tokens, "
    "float scale, int max_q, int max_k, bool is_causal, bool bottom_right, int left, int right, bool deterministic) "
    "-> (Tensor, Tensor, Tensor)",
    tags=_TAGS,
)


def cudnn_thd_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: list[torch.Tensor], tokens: list[int], scale: float,
    max_q: int, max_k: int, is_causal: bool, bottom_right: bool, left: int, right: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(out (Tq, Hq, Dv), stats (Tq, Hq, 1) fp32 token-major) of packed q/k/v; `meta`: ragged_metadata's FWD_META,
    its q/k/v offsets made with the token strides `tokens` (O and stats are ours, packed)."""
    _check("cudnn_thd_fwd", q, {"q": q, "k": k, "v": v}, tokens, meta, len(FWD_META))
    b, device = meta[0].shape[0], q.device
    band = (is_causal, bottom_right, left, right)
    key = ("fwd", q.dtype, device.index, b, q.shape[1:], k.shape[1:], v.shape[1:], q.stride(), k.stride(),
           v.stride(), max_q, max_k, scale, band)  # fmt: skip
    handle = _handle(device)
    g, ws, uids = _cached(key, lambda: _build_fwd(handle, q, k, v, b, max_q, max_k, scale, _band(*band)))
    out = q.new_empty((q.shape[0], q.shape[1], v.shape[2]))
    stats = q.new_empty((q.shape[0], q.shape[1], 1), dtype=torch.float32)
    _execute(g, ws, uids, [q, k, v], [out, stats], meta, device, handle)
    return out, stats


def cudnn_thd_bwd(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, stats: torch.Tensor,
    meta: list[torch.Tensor], tokens: list[int], scale: float, max_q: int, max_k: int, is_causal: bool,
    bottom_right: bool, left: int, right: int, deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(dq, dk, dv), packed, in the io dtype, for dout/q/k/v/out and the fp32 stats, either the forward's own
    (Tq, Hq, 1) token-major (where `reads_ragged_stats`) or PADDED (B, Hq, max_q, 1); `meta`: ragged_metadata's
    BWD_META_RAGGED_STATS or BWD_META to match, its q/o/k/v offsets made with the token strides `tokens` (dO shares
    O's offsets, so it must be laid out as O; dq/dk/dv are ours, packed)."""
    ragged_stats = stats.dim() == 3
    n_meta = len(BWD_META_RAGGED_STATS if ragged_stats else BWD_META)
    _check("cudnn_thd_bwd", q, {"q": q, "out": out, "k": k, "v": v, "dout": dout}, [*tokens, tokens[1]], meta,
           n_meta)  # fmt: skip
    b, device = meta[0].shape[0], q.device
    if dout.stride() != out.stride():
        raise ValueError(f"cudnn_thd_bwd: dout's strides {dout.stride()} differ from out's {out.stride()}")
    want = (q.shape[0], q.shape[1], 1) if ragged_stats else (b, q.shape[1], max_q, 1)
    if stats.dtype != torch.float32 or not stats.is_contiguous() or stats.shape != want:
        raise ValueError(f"cudnn_thd_bwd: stats must be contiguous fp32 {want} (ragged (Tq, Hq, 1) or padded "
                         f"(B, Hq, max_q, 1)), not {stats.dtype} {tuple(stats.shape)}")  # fmt: skip
    if ragged_stats and not reads_ragged_stats(device):
        raise ValueError("cudnn_thd_bwd: ragged (Tq, Hq, 1) stats on a GPU whose THD backward takes them padded "
                         "(SM8x, SM12x or cuDNN < 9.6: cudnn_graph.reads_ragged_stats)")  # fmt: skip
    band = (is_causal, bottom_right, left, right)
    tq, tk = q.shape[0], k.shape[0]
    key = ("bwd", q.dtype, device.index, b, q.shape[1:], k.shape[1:], v.shape[1:], q.stride(), k.stride(),
           v.stride(), out.stride(), round64(tq), round64(tk), max_q, max_k, scale, band, deterministic,
           ragged_stats)  # fmt: skip
    handle = _handle(device)
    build = (handle, q, k, v, out, tq, tk, b, max_q, max_k, scale)
    g, ws, uids = _cached(key, lambda: _build_bwd(*build, _band(*band), deterministic, ragged_stats))
    dq = q.new_empty(q.shape)
    dk = k.new_empty(k.shape)
    dv = v.new_empty(v.shape)
    _execute(g, ws, uids, [q, k, v, out, dout, stats], [dq, dk, dv], meta, device, handle)
    return dq, dk, dv


_lib.impl("cudnn_thd_fwd", cudnn_thd_fwd, "CUDA")
_lib.impl("cudnn_thd_bwd", cudnn_thd_bwd, "CUDA")


@torch.library.register_fake("cpcompile::cudnn_thd_fwd")
def _fwd_fake(q, k, v, meta, tokens, scale, max_q, max_k, is_causal, bottom_right, left, right):
    tq, hq = q.shape[:2]
    return q.new_empty((tq, hq, v.shape[2])), q.new_empty((tq, hq, 1), dtype=torch.float32)


@torch.library.register_fake("cpcompile::cudnn_thd_bwd")
def _bwd_fake(dout, q, k, v, out, stats, meta, tokens, scale, max_q, max_k, is_causal, bottom_right, left, right, det):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def ops():
    """The op namespace the provider calls (tests substitute a CPU stand-in of the same contract)."""
    return torch.ops.cpcompile
