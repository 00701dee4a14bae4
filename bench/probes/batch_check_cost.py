"""What the run-time batch check (cpcompile/regions/batch_check.py) costs a step: one CP rank of the GPU check's layer
(bench/gpu_layer.py: Llama3-8B attention, bf16, fwd+bwd, S=32K, 4K tokens a rank) made to take what the check
reads, compiled with backend(check_batch=True) and (check_batch=False), in torch.compile's default mode and with
mode="reduce-overhead" (CUDA graphs), timed side by side (CUDA events, interleaved runs, medians):

- "positions": the layer takes position_ids and rotates q and k by them (RoPE, as Llama): the positions check;
- "tokens": the layer takes token ids (an embedding, no positions): the unsharded-batch fingerprint.

On one GPU (a fake process group of `--cp` ranks, no peers) the check's all-gather hands back this rank's own
verdicts (and the pass leaves the fingerprint out there), so `local_gather` stands in for it, the fingerprints told
apart, and the fake group's ranks count as peers. The rows then
time the check's device work and launches, not the 32-byte all-gather itself (on NVLink a few microseconds).
Under torchrun (one rank per GPU, NCCL) the real all-gather runs and every rank times its own step.

    python -m bench.probes.batch_check_cost [--cp 8] [--models positions tokens] [--modes default ...] [--out f.json]
    torchrun --standalone --nproc-per-node=2 -m bench.probes.batch_check_cost

Prints a row per (model, mode): the step with and without the check, and the difference in microseconds and in
percent of the step. The switch-off: cpcompile.backend(..., check_batch=False).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import cpcompile
from bench.common import time_many_ms
from bench.gpu_layer import LLAMA3_8B, AttentionLayer, build
from bench.gpu_speed import DTYPE, SPEED_SEQ, fake_group
from cpcompile.passes import batch_check as passes_batch_check
from cpcompile.regions import batch_check
from cpcompile.testing.model import rope

VOCAB = 32000
MODES = ("default", "reduce-overhead")


class PositionedLayer(nn.Module):
    """The GPU check's layer with RoPE on q and k at the given position ids (B, S)."""

    def __init__(self, layer: AttentionLayer) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        la, sh = self.layer, self.layer.shape
        b, s, _ = x.shape
        q, k, v = (
            w(x).view(b, s, n, sh.head_dim).transpose(1, 2)
            for w, n in ((la.wq, sh.hq), (la.wk, sh.hkv), (la.wv, sh.hkv))
        )
        q, k = rope(q, position_ids, 500000.0), rope(k, position_ids, 500000.0)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=sh.hq != sh.hkv)
        return la.wo(a.transpose(1, 2).reshape(b, s, sh.hq * sh.head_dim))


class TokenLayer(nn.Module):
    """An embedding of token ids, then the GPU check's layer (no positions: the fingerprint check)."""

    def __init__(self, layer: AttentionLayer) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, layer.shape.hidden).to(layer.wq.weight.device, layer.wq.weight.dtype)
        self.layer = layer

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.layer(self.embed(input_ids))


def local_gather(values: torch.Tensor, group_name: str) -> torch.Tensor:
    """Stand-in for the check's all-gather on a fake process group: this rank's row for every rank, with the
    fingerprint (column 2) told apart so that the unsharded-batch rule passes as it would on sharded data."""
    world = dist.get_world_size()
    rows = values.expand(world, -1).clone()
    rows[:, 2] += torch.arange(world, device=values.device)
    return rows


def _step(fn, inputs: tuple, mode: str, grad_of: torch.Tensor | None):
    def run():
        if grad_of is not None:
            grad_of.grad = None
        if mode != "default":
            torch.compiler.cudagraph_mark_step_begin()
        fn(*inputs).float().square().mean().backward()

    return run


def rows(cp: int, rank: int, real: bool, names=("positions", "tokens"), modes=MODES) -> list[dict]:
    layer = build(LLAMA3_8B, DTYPE)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (1, SPEED_SEQ), generator=g).cuda()
    x = torch.randn(1, SPEED_SEQ, LLAMA3_8B.hidden, device="cuda", dtype=DTYPE)
    batch = cpcompile.shard_batch({"input_ids": ids, "inputs_embeds": x}, strategy="zigzag")
    x_local = batch["inputs_embeds"].detach().requires_grad_()
    models = {
        "positions": (PositionedLayer(layer), (x_local, batch["position_ids"]), x_local),
        "tokens": (TokenLayer(layer), (batch["input_ids"],), None),
    }
    records = []
    for name, (model, inputs, grad_of) in models.items():
        if name not in names:
            continue
        for mode in modes:
            steps = []
            for check in (True, False):
                torch._dynamo.reset()
                be = cpcompile.backend(strategy="zigzag", comm="all_gather", inner="inductor", check_batch=check)
                fn = torch.compile(model, backend=be, fullgraph=True, dynamic=False,
                                   mode=None if mode == "default" else mode)  # fmt: skip
                steps.append(_step(fn, inputs, mode, grad_of))
                for _ in range(3):
                    steps[-1]()
            on_ms, off_ms = time_many_ms(steps, iters=20, warmup=3)
            record = dict(model=name, mode=mode, cp=cp, rank=rank, S=SPEED_SEQ, real_all_gather=real,
                          check_ms=round(on_ms, 4), no_check_ms=round(off_ms, 4),
                          cost_us=round((on_ms - off_ms) * 1000, 1),
                          cost_pct=round(100 * (on_ms / off_ms - 1), 3))  # fmt: skip
            records.append(record)
            if rank == 0:
                print(f"{name} {mode}: {on_ms:.3f} ms with the check, {off_ms:.3f} without: "
                      f"{record['cost_us']:+.1f} us ({record['cost_pct']:+.2f}%)", flush=True)  # fmt: skip
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cp", type=int, default=8, help="CP ranks of the fake group (one GPU)")
    parser.add_argument("--models", nargs="*", default=["positions", "tokens"], choices=["positions", "tokens"])
    parser.add_argument("--modes", nargs="*", default=list(MODES), choices=list(MODES))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch._dynamo.config.cache_size_limit = 64
    if "WORLD_SIZE" in os.environ:  # torchrun: one rank per GPU, NCCL, the real all-gather
        dist.init_process_group("nccl")
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        try:
            records = rows(dist.get_world_size(), dist.get_rank(), True, args.models, args.modes)
        finally:
            dist.destroy_process_group()
    else:
        batch_check.all_gather_dim0 = local_gather  # traced into the compiled graph: set before compiling
        passes_batch_check.has_peers = lambda group: True  # the fake group's ranks count as peers here
        with fake_group(0, args.cp):
            records = rows(args.cp, 0, False, args.models, args.modes)
    if args.out and records and records[0]["rank"] == 0:
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
