"""Multi-GPU benchmark (issue 8): cpcompile vs the ideal and vs PyTorch's own context_parallel, on NCCL.

    torchrun --nproc-per-node=N -m bench.multi_gpu --out bench/results/multi_gpu.json [--tokens 8192,32768]

Per layout x comm x tokens-per-GPU: fwd+bwd latency of one attention layer at the Llama3-8B attention shape
(compiled with cpcompile, Inductor), the slowest rank's median over CUDA-event-timed iterations after a
warm-up; the ideal (single-GPU cuDNN SDPA over the full sequence / cp, measured on rank 0 alone); PyTorch's
context_parallel (eager; all-gather rotate method; head-tail load balancing; K/V heads expanded to the q heads
for it, as its SDPA path needs equal heads); plus one training step of a small full model with and without
cpcompile. `--dry-run` shrinks everything so one GPU (nproc 1) checks the script end to end.
`--hierarchical PxQ` (P * Q = the world) also times every comm on a 2-D CP mesh (cp_inter=P nodes, cp_intra=Q
ranks a node): comm="hierarchical" and the 1-D comms over the flattened group, e.g. on 2 nodes of 8 GPUs

    torchrun --nnodes=2 --nproc-per-node=8 ... -m bench.multi_gpu --hierarchical 2x8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F

import cpcompile
from bench.common import HKV, HQ, sdpa_full_fwd_bwd, time_ms
from cpcompile.comms.registry import COMMS
from cpcompile.layouts import LAYOUTS

DEVICE = "cuda"  # --device cpu runs a gloo smoke test of the script on a CPU machine (cpu_flash kernel)


def slowest(ms: float) -> float:
    t = torch.tensor([ms], device=DEVICE)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def timed(fn, iters: int, warmup: int) -> float:
    """Median of per-iteration times, every rank in step (barrier before each run)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        if DEVICE == "cpu":
            t0 = time.perf_counter()
            fn()
            times.append(1000 * (time.perf_counter() - t0))
            continue
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def full_inputs(seq: int, hkv: int, seed: int = 0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)  # same full tensors on every rank
    mk = lambda h: torch.randn(1, seq, h, 128, device=DEVICE, dtype=torch.bfloat16, generator=g).transpose(1, 2)  # noqa: E731
    return mk(HQ), mk(hkv), mk(hkv), mk(HQ)


def cpcompile_layer_ms(layout: str, comm: str, seq: int, mesh, iters: int, warmup: int) -> float:
    q, k, v, dout = full_inputs(seq, HKV)
    shard = lambda t: cpcompile.shard(t, strategy=layout, seq_dim=2, mesh=mesh)  # noqa: E731
    leaves = [shard(t).detach().requires_grad_() for t in (q, k, v)]
    dl = shard(dout)
    be = cpcompile.backend(strategy=layout, comm=comm, mesh=mesh)
    attn = torch.compile(
        lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True, enable_gqa=True),
        backend=be,
        fullgraph=True,
        dynamic=False,  # one process compiles several lengths: without it Dynamo's 2nd compile goes dynamic
    )

    def step():
        attn(*leaves).backward(dl)

    return slowest(timed(step, iters, warmup))


def pytorch_cp_ms(seq: int, mesh, iters: int, warmup: int) -> float:
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import _cp_options, set_rotate_method

    set_rotate_method("allgather")
    _cp_options.enable_load_balance = True  # head-tail
    q, k, v, dout = full_inputs(seq, HQ)  # K/V heads expanded: its SDPA path wants equal heads
    q, k, v, dout = (t.contiguous() for t in (q, k, v, dout))
    with context_parallel(mesh, buffers=[q, k, v, dout], buffer_seq_dims=[2, 2, 2, 2]):
        # it resizes the buffers in place (and back on exit), so the autograd leaves are detached aliases
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]

        def step():
            F.scaled_dot_product_attention(*leaves, is_causal=True).backward(dout)
            for t in leaves:
                t.grad = None

        return slowest(timed(step, iters, warmup))


def train_step_ms(use_cp: bool, tokens_per_gpu: int, mesh, iters: int, warmup: int) -> float:
    from cpcompile.testing.model import TinyConfig, TinyLlama, token_loss_sum

    torch.manual_seed(0)
    cfg = TinyConfig(vocab=32000, dim=1024, layers=4, heads=8, kv_heads=2, hidden=2816)
    if DEVICE == "cpu":  # smoke test only
        cfg = TinyConfig(vocab=256, dim=128, layers=1, heads=8, kv_heads=2, hidden=256)
    model = TinyLlama(cfg).to(DEVICE, torch.bfloat16)
    world = dist.get_world_size()
    seq = tokens_per_gpu * world
    ids = torch.randint(0, cfg.vocab, (1, seq), device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(0))
    pos = torch.arange(seq, device=DEVICE).unsqueeze(0)
    if use_cp:
        batch = cpcompile.shard_batch({"ids": ids, "pos": pos}, strategy="zigzag", mesh=mesh, seq_keys=("ids", "pos"))
        ids, pos = batch["ids"], batch["pos"]
        be = cpcompile.backend(strategy="zigzag", mesh=mesh)
        compiled = torch.compile(model, backend=be, fullgraph=True, dynamic=False)
    else:  # every GPU runs its own full-sequence copy: the no-CP baseline
        compiled = torch.compile(model, fullgraph=True, dynamic=False)

    def step():
        token_loss_sum(compiled(ids, pos), ids).backward()
        model.zero_grad(set_to_none=True)

    return slowest(timed(step, iters, warmup))


def attempt(what: str, fn, *args):
    """fn(*args), or None with the traceback printed: one failing measurement does not lose the others."""
    try:
        return fn(*args)
    except Exception:
        print(f"[rank {dist.get_rank()}] {what} FAILED:\n{traceback.format_exc()}", flush=True)
        return None


def ratio(a, b):
    return None if a is None or b is None else a / b


def hierarchical_rows(args, seq: int, tpg: int, ideal, device: str) -> list[dict]:
    """Every comm on the 2-D CP mesh `args.hierarchical` ("PxQ"), zigzag: hierarchical a level each, the 1-D comms
    over the flattened group."""
    inter, intra = (int(n) for n in args.hierarchical.lower().split("x"))
    if inter * intra != dist.get_world_size():
        raise SystemExit(f"--hierarchical {args.hierarchical}: {inter} x {intra} is not the world size")
    mesh = torch.distributed.device_mesh.init_device_mesh(
        DEVICE, (inter, intra), mesh_dim_names=("cp_inter", "cp_intra")
    )
    rows = []
    for comm in (n for n, c in COMMS.items() if c.serves("sdpa")):
        ms = attempt(f"cpcompile zigzag/{comm} on {args.hierarchical}", cpcompile_layer_ms, "zigzag", comm, seq, mesh,
                     args.iters, args.warmup)  # fmt: skip
        rows.append(dict(layout="zigzag", comm=comm, mesh=args.hierarchical, cp=inter * intra, tokens_per_gpu=tpg,
                         latency_ms=ms, ideal_ms=ideal, efficiency=ratio(ideal, ms), device=device,
                         torch=torch.__version__, dry_run=args.dry_run))  # fmt: skip
        if dist.get_rank() == 0:
            eff = rows[-1]["efficiency"]
            print(f"zigzag  {comm:12s} mesh {args.hierarchical} tokens/GPU={tpg}: {ms} ms, eff {eff}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="8192,32768", help="tokens per GPU")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--out", default="bench/results/multi_gpu.json")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--hierarchical", default=None, help="PxQ: also time the comms on a (cp_inter, cp_intra) mesh")
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    if args.dry_run:
        args.tokens, args.iters, args.warmup = "1024", 2, 1
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if DEVICE == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    mesh = torch.distributed.device_mesh.init_device_mesh(DEVICE, (world,), mesh_dim_names=("cp",))
    device = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    records: list[dict] = []
    for tpg in [int(t) for t in args.tokens.split(",")]:
        seq = tpg * world
        ideal = None
        if rank == 0 and DEVICE == "cuda":
            from torch.nn.attention import SDPBackend

            ideal = time_ms(sdpa_full_fwd_bwd(seq, SDPBackend.CUDNN_ATTENTION), max(3, args.iters // 4), 1) / world
        box = [ideal]
        dist.broadcast_object_list(box, src=0)
        ideal = box[0]
        torch_cp = attempt("PyTorch context_parallel", pytorch_cp_ms, seq, mesh, args.iters, args.warmup)
        for layout in sorted(LAYOUTS):
            for comm in (n for n, c in COMMS.items() if c.serves("sdpa") and not c.capabilities.levels):  # 1-D
                ms = attempt(f"cpcompile {layout}/{comm}", cpcompile_layer_ms, layout, comm, seq, mesh,
                             args.iters, args.warmup)  # fmt: skip
                rec = dict(
                    layout=layout, comm=comm, cp=world, tokens_per_gpu=tpg, latency_ms=ms, ideal_ms=ideal,
                    efficiency=ratio(ideal, ms), pytorch_cp_ms=torch_cp, speedup_vs_pytorch_cp=ratio(torch_cp, ms),
                    device=device, torch=torch.__version__, dry_run=args.dry_run,
                )  # fmt: skip
                records.append(rec)
                if rank == 0:
                    print(f"{layout:7s} {comm:10s} cp={world} tokens/GPU={tpg}: {ms} ms, ideal {ideal}, "
                          f"eff {rec['efficiency']}, PyTorch CP {torch_cp} ms ({rec['speedup_vs_pytorch_cp']}x)",
                          flush=True)  # fmt: skip
        if args.hierarchical:
            records += hierarchical_rows(args, seq, tpg, ideal, device)
        with_cp = attempt("train step with cpcompile", train_step_ms, True, tpg, mesh, max(3, args.iters // 4), 2)
        without = attempt("train step without CP", train_step_ms, False, tpg, mesh, max(3, args.iters // 4), 2)
        records.append(dict(kind="train_step", model="TinyLlama 4x1024 (GQA 8/2)", cp=world, tokens_per_gpu=tpg,
                            cpcompile_zigzag_ms=with_cp, no_cp_full_sequence_per_gpu_ms=without, device=device,
                            torch=torch.__version__, dry_run=args.dry_run))  # fmt: skip
        if rank == 0:
            print(f"train step tokens/GPU={tpg}: cpcompile zigzag {with_cp} ms, no CP (full seq per GPU) "
                  f"{without} ms", flush=True)  # fmt: skip
    if rank == 0:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
