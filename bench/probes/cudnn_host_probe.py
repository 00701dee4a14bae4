"""Where does a cudnn_varlen call's host time go? The provider costs ~0.5 ms of CPU a call each way on the H200
(cudnn_aten_probe: 0.75-1.10 ms a fwd+bwd against FA2's 0.20-0.35 ms), which is why kernel="auto" takes FA2 at 4K
tokens a rank although cuDNN's GPU time is 1.6-1.8x shorter. Before building a leaner call (issue 40: "graphs
executed from prebuilt variant packs and workspace"), this splits the forward's host time into the frontend's
stages, each timed alone: CPU microseconds a call, `--calls` calls queued behind a long GPU sleep (so no call
waits for the GPU), median of `--reps`.

  provider        cpcompile's cudnn_varlen.forward / .backward, prepared metadata given (what the executor calls;
                  eager, so its per-call offset multiplies run as ops, which a compiled region fuses)
  graph op        cpcompile's cudnn_thd_fwd alone (kernels/cudnn_graph), its metadata made once: the compiled call
  op              torch.ops.cudnn.sdpa_fwd / sdpa_bwd (the dispatcher and the frontend's Python)
  impl            the frontend's _sdpa_fwd_impl called directly (no dispatcher)
  handle          its _get_handle (a dict lookup and cudnn.set_stream, every call)
  metadata        its prepare_varlen_metadata (ragged lengths and offsets, recomputed every call)
  execute         its cached graph's execute() with every buffer prebuilt (the floor of this design)
  alloc           the three torch.empty a call makes (out, stats, workspace)

Then a cProfile of `--calls` provider forward+backward pairs, the top entries by own time. The case is a thd
rank's block at the GPU check's site (S 32K, cp 8, docs-median-1K, rank 7). It reads the frontend's private
names on purpose: it is a probe of their cost, and fails loudly if they moved. Prints; nothing is written.

    python -m bench.probes.cudnn_host_probe [--calls 50] [--reps 5]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats

import torch

from bench import thd_cases
from bench.common import HOST_SLEEP_CYCLES, queued_host_ms
from cpcompile.comms.all_gather.varlen import attend_gathered
from cpcompile.executor import decode_varlen
from cpcompile.kernels import get_varlen_kernel
from cpcompile.kernels.cudnn_graph import ragged_metadata
from cpcompile.kernels.cudnn_varlen import band, band_args
from cpcompile.kernels.varlen_ranges import cu_seqlens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    from cudnn.sdpa import varlen_metadata
    from cudnn.sdpa.fwd import torch_op

    impl, scale = get_varlen_kernel("cudnn_varlen"), thd_cases.SCALE
    lengths = thd_cases.doc_lengths(32768, "docs-median-1K")
    q, gathered, key_maps, dout, ranges, enc = thd_cases.rank_case("thd", lengths, 8, 7)
    (b,), (r,) = decode_varlen(enc), ranges
    tensors = thd_cases.block_tensors(q, gathered, key_maps[0], ranges, enc, "cudnn_varlen")
    keys = attend_gathered(q, gathered, key_maps[0], tensors, enc, scale, "cudnn_varlen")[2]
    k, v = keys[:, 0], keys[:, 1]
    kw = b.kernel_kwargs()
    prepared = impl.prepare(r, q.shape[0], k.shape[0], b.max_q, b.window, square=b.square)
    call = (r, b.max_q, b.max_k, b.causal, scale)
    out, lse = impl.forward(q, k, v, *call, **kw, prepared=prepared)
    cu_q, cu_k = cu_seqlens(r, kw.get("tiled", False))  # the frontend op's own inputs
    op_args = dict(cu_seqlens_q=cu_q, cu_seqlens_kv=cu_k, max_seqlen_q=max(b.max_q, 1),
                   max_seqlen_kv=max(b.max_k, 1), **band(b.causal, b.window, b.square))  # fmt: skip
    dev = q.device

    # the forward's own buffers, as _sdpa_fwd_impl builds them, for execute() alone
    torch_op._graph_cache.clear()  # then the forward's graph is the one entry
    torch.ops.cudnn.sdpa_fwd(q, k, v, scale, return_lse=True, **op_args)
    ((g, ws, uids),) = torch_op._graph_cache.values()
    handle = torch_op._get_handle(dev)
    t_q, h_q, d_v = q.shape[0], q.shape[1], v.shape[2]
    o = torch.empty(t_q, h_q, d_v, dtype=q.dtype, device=dev)
    stats = torch.empty(t_q, h_q, 1, dtype=torch.float32, device=dev)
    workspace = torch.empty(max(ws, 1), dtype=torch.uint8, device=dev)
    q_strides = (q.stride(0), h_q * d_v, h_q)
    meta = varlen_metadata.prepare_varlen_metadata(cu_q, cu_k, q_strides, (k.stride(0), v.stride(0)))
    buffers = [q, k, v, o, stats, *meta]
    # cpcompile's graph op alone, its metadata made once (as the region's graph makes it, once per call site)
    ours = ragged_metadata(prepared[:4], q_strides, (k.stride(0), v.stride(0)))
    tokens = [q.stride(0), k.stride(0), v.stride(0)]
    graph_args = (ours, tokens, scale, max(b.max_q, 1), max(b.max_k, 1), *band_args(b.causal, b.window, b.square))

    stages = {
        "provider fwd": lambda: impl.forward(q, k, v, *call, **kw, prepared=prepared),
        "provider bwd": lambda: impl.backward(dout, q, k, v, out, lse, *call, **kw, prepared=prepared),
        "graph op fwd": lambda: torch.ops.cpcompile.cudnn_thd_fwd(q, k, v, *graph_args),
        "op fwd": lambda: torch.ops.cudnn.sdpa_fwd(q, k, v, scale, return_lse=True, **op_args),
        "impl fwd": lambda: torch_op._sdpa_fwd_impl(q, k, v, scale, return_lse=True, **op_args),
        "handle": lambda: torch_op._get_handle(dev),
        "metadata": lambda: varlen_metadata.prepare_varlen_metadata(cu_q, cu_k, q_strides, (k.stride(0), v.stride(0))),
        "execute": lambda: g.execute(buffers, workspace, handle=handle, tensor_uids=uids),
        "alloc": lambda: (
            torch.empty(t_q, h_q, d_v, dtype=q.dtype, device=dev),
            torch.empty(t_q, h_q, 1, dtype=torch.float32, device=dev),
            torch.empty(max(ws, 1), dtype=torch.uint8, device=dev),
        ),
    }
    for fn in stages.values():  # warm every path (graph builds, DSL compiles) before timing
        fn()
    torch.cuda.synchronize()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; thd rank 7 block: {r.shape[1]} sequences, "
          f"max_q {b.max_q}, max_k {b.max_k}, square {b.square}; host us a call ({args.calls} calls, median of "
          f"{args.reps}):", flush=True)  # fmt: skip
    for name, fn in stages.items():
        print(f"  {name:14s} {queued_host_ms(fn, args.calls, args.reps) * 1e3:8.1f}", flush=True)

    profile = cProfile.Profile()
    torch.cuda.synchronize()
    torch.cuda._sleep(HOST_SLEEP_CYCLES)
    profile.enable()
    for _ in range(args.calls):
        stages["provider fwd"]()
        stages["provider bwd"]()
    profile.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(25)
    print(f"cProfile of {args.calls} provider fwd+bwd pairs, top 25 by own time:")
    print(text.getvalue())


if __name__ == "__main__":
    main()
