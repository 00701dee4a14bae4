"""FSDP2 x context parallelism on a 2-D (dp, cp) mesh: parameters sharded over all dp x cp ranks, each dp group
trains on its own rows, the cp ranks of a group share those rows' tokens.

    torchrun --standalone --nproc-per-node=4 examples/torchrun/fsdp2.py --cp 2     # dp=2 x cp=2; CPU: gloo
    torchrun --standalone --nproc-per-node=8 examples/torchrun/fsdp2.py --cp 4     # GPUs: NCCL

The cp ranks' gradients must be summed too, so fully_shard runs over the flattened dp x cp mesh, with FSDP's
averaging turned off (set_gradient_divide_factor(1.0), and set_force_sum_reduction_for_comms(True) so that gloo
gets a plain SUM): each rank's loss is already over the GLOBAL token count.
"""

import argparse
import os
import sys

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--cp", type=int, default=2, help="CP ranks a group; dp = ranks / cp")
p.add_argument("--strategy", default="zigzag", choices=["flat", "zigzag"], help="the token layout (zigzag: balanced)")
p.add_argument("--comm", default="all_gather", choices=["all_gather", "a2a", "ring", "auto"],
               help="how the ranks exchange K/V (README, 'Use it in your training loop')")  # fmt: skip
p.add_argument("--steps", type=int, default=10, help="training steps")
p.add_argument("--batch", type=int, default=2, help="rows a dp group")
p.add_argument("--seq", type=int, default=1024, help="GLOBAL tokens per row (a multiple of 2 x cp for zigzag)")
p.add_argument("--verbose", action="store_true", help="a refusal's whole traceback (default: its one line)")
args = p.parse_args()  # before importing torch: --help answers at once
if "LOCAL_RANK" not in os.environ:
    sys.exit(f"{sys.argv[0]} is one rank: launch it with torchrun --standalone --nproc-per-node=4 {sys.argv[0]}")

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

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
dp = dist.get_world_size() // args.cp
mesh = init_device_mesh(device.type, (dp, args.cp), mesh_dim_names=("dp", "cp"))

torch.manual_seed(0)
cfg = TinyConfig()
model = TinyLlama(cfg).to(device, dtype)
inner = "inductor" if cuda else "aot_eager"  # aot_eager: quicker to compile on CPU
backend = cpcompile.backend(strategy=args.strategy, comm=args.comm, mesh=mesh, inner=inner)
for block in model.blocks:
    block.compile(backend=backend, fullgraph=True)  # compile each block, then shard it (torchtitan's order)
    fully_shard(block, mesh=mesh["dp", "cp"]._flatten("dp_cp"))
fully_shard(model, mesh=mesh["dp", "cp"]._flatten("dp_cp"))
for module in model.modules():
    if hasattr(module, "set_gradient_divide_factor"):
        module.set_gradient_divide_factor(1.0)  # sum over ranks: each rank's loss is already / global count
        module.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM for fp32 grads)
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

data = torch.Generator().manual_seed(1)  # the same GLOBAL batches (all dp groups' rows) on every rank
mine = slice(mesh.get_local_rank("dp") * args.batch, (mesh.get_local_rank("dp") + 1) * args.batch)
losses = []
for step in range(args.steps):
    start = torch.randint(0, cfg.vocab, (dp * args.batch, 1), generator=data)
    ids = (start + torch.arange(args.seq + 1)) % cfg.vocab  # rows that count up: something to learn
    labels = ids[:, 1:]
    global_token_count = int((labels != -100).sum())  # over every dp group's rows
    batch = {"input_ids": ids[mine, :-1], "labels": labels[mine]}  # this dp group's rows
    local = cpcompile.shard_batch(batch, strategy=args.strategy, mesh=mesh)  # the "cp" dim of the mesh
    local = {k: v.to(device) for k, v in local.items()}

    logits = model(local["input_ids"], local["position_ids"])
    loss = F.cross_entropy(logits.flatten(0, 1).float(), local["labels"].flatten(), reduction="sum")
    loss = loss / global_token_count
    opt.zero_grad()
    loss.backward()  # FSDP reduce-scatters (sums) the gradients over all dp x cp ranks
    opt.step()
    loss = loss.detach()
    dist.all_reduce(loss)  # the whole global batch's loss, for the log
    losses.append(loss.item())
    if dist.get_rank() == 0:
        print(f"step {step + 1}/{args.steps}  loss {losses[-1]:.4f}", flush=True)

if dist.get_rank() == 0:
    print(f"done: dp={dp} x cp={args.cp}, loss {losses[0]:.4f} -> {losses[-1]:.4f}")

# Shut down in order: destroy_process_group destroys the process group (joining gloo's worker threads) only once nothing
# holds it; a group that outlives it is torn down while Python exits, where a gloo thread freeing a tensor aborts the
# process. Drop what this script holds (the mesh, the backend, the FSDP model, its optimizer and outputs);
# cpcompile.destroy_process_group releases what Dynamo and DTensor keep, then destroys the group.
del mesh, backend, model, opt, logits, block, module
cpcompile.destroy_process_group()
