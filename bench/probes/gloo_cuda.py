"""Does gloo crash on CUDA tensors by itself? Each collective, in its own pair of gloo ranks sharing cuda:0, with
no cpcompile code: plain c10d and the functional ops cpcompile traces (issued, then waited at once; or with the
input dropped before the wait). A rank that dies prints its signal; the table says which collectives crash.

    python -m bench.probes.gloo_cuda
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys

CASES = (
    "c10d_all_gather_into_tensor",
    "func_all_gather_into_tensor",
    "func_all_gather_input_dropped",
    "func_reduce_scatter_tensor",
    "func_all_to_all_single_equal",
    "func_all_to_all_single_shift",
    "func_all_gather_cpu_hop",
)


def _case(name: str, rank: int, world: int) -> float:
    import torch
    import torch.distributed as dist

    c10d = torch.ops._c10d_functional
    group = dist.group.WORLD.group_name
    x = torch.full((1024, 64), float(rank + 1), device="cuda")
    want_gather = torch.cat([torch.full((1024, 64), float(r + 1)) for r in range(world)])
    if name == "c10d_all_gather_into_tensor":
        out = torch.empty(world * 1024, 64, device="cuda")
        dist.all_gather_into_tensor(out, x)
        return float((out.cpu() - want_gather).abs().max())
    if name == "func_all_gather_into_tensor":
        out = c10d.wait_tensor(c10d.all_gather_into_tensor(x, world, group))
        return float((out.cpu() - want_gather).abs().max())
    if name == "func_all_gather_input_dropped":
        out = c10d.all_gather_into_tensor(x.clone(), world, group)  # the input's only reference is the op's
        torch.cuda.synchronize()
        out = c10d.wait_tensor(out)
        return float((out.cpu() - want_gather).abs().max())
    if name == "func_reduce_scatter_tensor":
        y = torch.ones(world * 1024, 64, device="cuda")
        out = c10d.wait_tensor(c10d.reduce_scatter_tensor(y, "sum", world, group))
        return float((out.cpu() - world).abs().max())
    if name == "func_all_to_all_single_equal":
        out = c10d.wait_tensor(c10d.all_to_all_single(x, [1024 // world] * world, [1024 // world] * world, group))
        return float(out.float().abs().sum() > 0) - 1.0
    if name == "func_all_to_all_single_shift":
        flat = x.reshape(-1)
        send, recv = [0] * world, [0] * world
        send[(rank + 1) % world], recv[(rank - 1) % world] = flat.numel(), flat.numel()
        out = c10d.wait_tensor(c10d.all_to_all_single(flat, recv, send, group))
        return float((out.cpu() - float((rank - 1) % world + 1)).abs().max())
    if name == "func_all_gather_cpu_hop":
        out = c10d.wait_tensor(c10d.all_gather_into_tensor(x.cpu(), world, group)).to("cuda")
        return float((out.cpu() - want_gather).abs().max())
    raise ValueError(name)


def _rank(name: str, rank: int, world: int, port: int, q) -> None:
    import faulthandler

    import torch
    import torch.distributed as dist

    faulthandler.enable()
    torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    err = _case(name, rank, world)
    torch.cuda.synchronize()
    q.put((rank, err))
    dist.destroy_process_group()


def main() -> int:
    from cpcompile.testing.distributed import free_port

    ctx = mp.get_context("spawn")
    world, rows = 2, []
    for name in CASES:
        q = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=_rank, args=(name, r, world, port, q)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
            if p.is_alive():
                p.kill()
        codes = [p.exitcode for p in procs]
        errs = []
        while not q.empty():
            errs.append(q.get()[1])
        verdict = (
            "ok"
            if codes == [0] * world and errs and max(errs) == 0
            else "CRASH"
            if any(c and c < 0 for c in codes)
            else "wrong/failed"
        )
        rows.append((name, codes, max(errs) if errs else None, verdict))
        print(f"{name:34s} exit codes {codes}  max error {rows[-1][2]}  -> {verdict}", flush=True)
    import torch

    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}, pid {os.getpid()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
