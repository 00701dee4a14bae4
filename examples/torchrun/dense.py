"""Train a Llama-style model with context parallelism: every rank holds the whole model and its share of the tokens.

    torchrun --standalone --nproc-per-node=2 examples/torchrun/dense.py     # CPU: gloo; GPUs: one rank each, NCCL
    torchrun --nnodes=2 --nproc-per-node=8 --rdzv-endpoint=HOST:29500 examples/torchrun/dense.py --seq 65536
    ... dense.py --comm hierarchical  # a 2-D CP mesh: a2a inside each node, a ring across the nodes
    torchrun --standalone --nproc-per-node=4 examples/torchrun/dense.py --comm hierarchical --nodes 2  # 2x2 on one host

Replace TinyLlama by your model (any model whose attention is F.scaled_dot_product_attention) and the random
batches by your data: every rank must build the same GLOBAL batch; shard_batch keeps this rank's tokens.
"""

import argparse
import os
import sys

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--strategy", default="zigzag", choices=["flat", "zigzag"], help="the token layout (zigzag: balanced)")
p.add_argument("--comm", default="all_gather", choices=["all_gather", "a2a", "ring", "auto", "hierarchical"],
               help="how the ranks exchange K/V (README, 'Use it in your training loop')")  # fmt: skip
p.add_argument("--nodes", type=int, default=None, help="hierarchical: the cp_inter size (default: torchrun's nodes)")
p.add_argument("--steps", type=int, default=10, help="training steps")
p.add_argument("--batch", type=int, default=2, help="rows a batch")
p.add_argument("--seq", type=int, default=1024, help="GLOBAL tokens per row (a multiple of 2 x ranks for zigzag)")
p.add_argument("--verbose", action="store_true", help="a refusal's whole traceback (default: its one line)")
args = p.parse_args()  # before importing torch: --help answers at once
if "LOCAL_RANK" not in os.environ:
    sys.exit(f"{sys.argv[0]} is one CP rank: launch it with torchrun --standalone --nproc-per-node=2 {sys.argv[0]}")

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import cpcompile
from cpcompile.testing.model import TinyConfig, TinyLlama

if not args.verbose:
    cpcompile.one_line_refusals()  # a refusal (CPCompileError) prints its one line with the fix, not a traceback

cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if cuda else "gloo")
device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
if cuda:
    torch.cuda.set_device(device)
dtype = torch.bfloat16 if cuda else torch.float32  # the GPU attention kernels take bf16/fp16
if args.comm == "hierarchical":  # a 2-D CP mesh: CP rank = node x ranks a node + local rank
    nodes = args.nodes or dist.get_world_size() // int(os.environ["LOCAL_WORLD_SIZE"])
    shape, names = (nodes, dist.get_world_size() // nodes), ("cp_inter", "cp_intra")
else:
    shape, names = (dist.get_world_size(),), ("cp",)
mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
cp_group = dist.group.WORLD  # every rank is CP here (FSDP2 x CP: examples/torchrun/fsdp2.py)

torch.manual_seed(0)  # the same initial weights on every rank
cfg = TinyConfig()
model = TinyLlama(cfg).to(device, dtype)
inner = "inductor" if cuda else "aot_eager"  # aot_eager: quicker to compile on CPU
backend = cpcompile.backend(strategy=args.strategy, comm=args.comm, mesh=mesh, inner=inner)
compiled = torch.compile(model, backend=backend, fullgraph=True)
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

data = torch.Generator().manual_seed(1)  # the same GLOBAL batches on every rank
losses = []
for step in range(args.steps):
    start = torch.randint(0, cfg.vocab, (args.batch, 1), generator=data)
    ids = (start + torch.arange(args.seq + 1)) % cfg.vocab  # rows that count up: something to learn
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
    global_token_count = int((batch["labels"] != -100).sum())
    local = cpcompile.shard_batch(batch, strategy=args.strategy, mesh=mesh)  # adds the GLOBAL position_ids
    local = {k: v.to(device) for k, v in local.items()}

    logits = compiled(local["input_ids"], local["position_ids"])
    loss = F.cross_entropy(logits.flatten(0, 1).float(), local["labels"].flatten(), reduction="sum")
    loss = loss / global_token_count  # this rank's share of the global mean
    opt.zero_grad()
    loss.backward()
    for param in model.parameters():  # each rank's gradients come from its own tokens: sum them
        dist.all_reduce(param.grad, group=cp_group)
    opt.step()
    loss = loss.detach()
    dist.all_reduce(loss, group=cp_group)  # the whole batch's loss, for the log
    losses.append(loss.item())
    if dist.get_rank() == 0:
        print(f"step {step + 1}/{args.steps}  loss {losses[-1]:.4f}", flush=True)

if dist.get_rank() == 0:  # a recompile is one more graph, whose attention calls are rewritten again
    rewritten = f"{len(backend.plans)} attention calls rewritten in {backend.graphs} compiled graph(s)"
    print(f"done: loss {losses[0]:.4f} -> {losses[-1]:.4f}, {rewritten}")

# Shut down in order: destroy_process_group destroys the process group (joining gloo's worker threads) only once nothing
# holds it; a group that outlives it is torn down while Python exits, where a gloo thread freeing a tensor aborts the
# process. Drop what this script holds (the mesh, cp_group, the backend and the compiled model);
# cpcompile.destroy_process_group releases what Dynamo and DTensor keep, then destroys the group.
del mesh, cp_group, backend, compiled
cpcompile.destroy_process_group()
