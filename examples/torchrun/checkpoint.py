"""Save and load a CP-trained model with torch.distributed.checkpoint (DCP), then go on training from it.

    torchrun --standalone --nproc-per-node=2 examples/torchrun/checkpoint.py       # CPU: gloo; GPUs: NCCL
    torchrun --nnodes=2 ... examples/torchrun/checkpoint.py --dir /shared/cp_ckpt  # several nodes: a shared folder

Under CP every rank holds the whole model (cpcompile changes the attention, not the parameters), so the state
dicts are the ordinary single-device ones: DCP writes each tensor once, and a checkpoint written on N CP ranks
loads on any number of ranks, or on one process. With FSDP2 (fsdp2.py) the same calls save sharded tensors.
"""

import argparse
import os
import shutil
import sys
import tempfile

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--dir", help="checkpoint folder, kept (every node must see it; default: a temporary one, removed)")
p.add_argument("--steps", type=int, default=10, help="steps before the checkpoint, and as many after it")
p.add_argument("--seq", type=int, default=1024, help="GLOBAL tokens per row (a multiple of 2 x ranks)")
p.add_argument("--verbose", action="store_true", help="a refusal's whole traceback (default: its one line)")
args = p.parse_args()  # before importing torch: --help answers at once
if "LOCAL_RANK" not in os.environ:
    sys.exit(f"{sys.argv[0]} is one CP rank: launch it with torchrun --standalone --nproc-per-node=2 {sys.argv[0]}")
if args.dir is None and os.environ["LOCAL_WORLD_SIZE"] != os.environ["WORLD_SIZE"]:
    sys.exit("several nodes: pass --dir, a folder every node can read and write")

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
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
mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("cp",))
folder = [args.dir or (tempfile.mkdtemp(prefix="cp_checkpoint_") if dist.get_rank() == 0 else None)]
dist.broadcast_object_list(folder)  # rank 0's temporary folder (one host: torchrun --standalone)
folder = folder[0]
cfg = TinyConfig()
backend = cpcompile.backend(strategy="zigzag", mesh=mesh, inner="inductor" if cuda else "aot_eager")


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int, name: str) -> list[float]:
    """`steps` CP training steps on GLOBAL batches made from `seed`; returns the losses."""
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    data = torch.Generator().manual_seed(seed)
    losses = []
    for step in range(steps):
        ids = (torch.randint(0, cfg.vocab, (2, 1), generator=data) + torch.arange(args.seq + 1)) % cfg.vocab
        local = cpcompile.shard_batch({"input_ids": ids[:, :-1], "labels": ids[:, 1:]}, strategy="zigzag", mesh=mesh)
        local = {k: v.to(device) for k, v in local.items()}
        logits = compiled(local["input_ids"], local["position_ids"])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), local["labels"].flatten(), reduction="sum")
        loss = loss / ids[:, 1:].numel()
        opt.zero_grad()
        loss.backward()
        for param in model.parameters():
            dist.all_reduce(param.grad, group=mesh.get_group())
        opt.step()
        loss = loss.detach()
        dist.all_reduce(loss, group=mesh.get_group())  # the whole batch's loss, for the log
        losses.append(loss.item())
        if dist.get_rank() == 0:
            print(f"{name} step {step + 1}/{steps}  loss {losses[-1]:.4f}", flush=True)
    return losses


def fresh(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)  # the same initial weights on every rank
    model = TinyLlama(cfg).to(device, dtype)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3)


model, opt = fresh(0)
before = train(model, opt, args.steps, seed=1, name="before saving:")
model_sd, optim_sd = get_state_dict(model, opt)
dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=folder)

resumed, resumed_opt = fresh(123)  # other weights: everything must come from the checkpoint
model_sd, optim_sd = get_state_dict(resumed, resumed_opt)
state = {"model": model_sd, "optim": optim_sd}
dcp.load(state, checkpoint_id=folder)
set_state_dict(resumed, resumed_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
same = all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed.parameters()))

after = train(model, opt, args.steps, seed=2, name="kept model:")
after_resumed = train(resumed, resumed_opt, args.steps, seed=2, name="loaded model:")  # its optimizer state too
ok = same and abs(after[-1] - after_resumed[-1]) <= 1e-3 * abs(after[-1])  # CPU: equal; GPU kernels use atomics
dist.barrier()  # every rank has loaded before the folder goes
if dist.get_rank() == 0:
    kept = f"saved to {args.dir}" if args.dir else "saved to a temporary folder, now removed"
    if not args.dir:
        shutil.rmtree(folder)
    print(f"{kept} at loss {before[-1]:.4f}; loaded weights equal the saved ones: {same}")
    print(f"{args.steps} more steps: loss {after[-1]:.4f} (kept model), {after_resumed[-1]:.4f} (loaded model)")
    verdict = "checkpoint round trip OK" if ok else "checkpoint MISMATCH"
    print(f"done: loss {before[0]:.4f} -> {after_resumed[-1]:.4f}, {verdict}")

# Shut down in order: destroy_process_group destroys the process group (joining gloo's worker threads) only once nothing
# holds it; a group that outlives it is torn down while Python exits, where a gloo thread freeing a tensor aborts the
# process. Drop what this script holds (the mesh and the backend, which train() reads: rebound, not deleted);
# cpcompile.destroy_process_group releases what Dynamo and DTensor keep, then destroys the group.
mesh = backend = None
cpcompile.destroy_process_group()
sys.exit(0 if ok else 1)
