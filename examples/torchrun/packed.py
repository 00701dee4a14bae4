"""Train on packed documents with context parallelism: documents of any length packed into one buffer of T
tokens, attention causal within each document (varlen_attn with the GLOBAL cu_seqlens).

    torchrun --standalone --nproc-per-node=2 examples/torchrun/packed.py                  # CPU: gloo; GPUs: NCCL
    torchrun --standalone --nproc-per-node=2 examples/torchrun/packed.py --strategy thd_balanced

VarlenTinyLlama calls torch.nn.attention.varlen.varlen_attn(q, k, v, cu, cu, max_len, max_len,
window_size=(-1, 0)); a model of yours that does the same trains the same way.
"""

import argparse
import os
import sys

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--strategy", default="thd", choices=["thd", "thd_zigzag", "thd_balanced"],
               help="the packed layout (docs/guide.md, 'Packed documents')")  # fmt: skip
p.add_argument("--comm", default="all_gather", choices=["all_gather", "a2a", "ring"],
               help="how the ranks exchange K/V (README, 'Use it in your training loop')")  # fmt: skip
p.add_argument("--steps", type=int, default=10, help="training steps")
p.add_argument("--tokens", type=int, default=2048, help="GLOBAL packed tokens a batch (a multiple of the ranks)")
p.add_argument("--max-documents", type=int, default=32, help="the most documents a batch holds")
p.add_argument("--verbose", action="store_true", help="a refusal's whole traceback (default: its one line)")
args = p.parse_args()  # before importing torch: --help answers at once
if "LOCAL_RANK" not in os.environ:
    sys.exit(f"{sys.argv[0]} is one CP rank: launch it with torchrun --standalone --nproc-per-node=2 {sys.argv[0]}")

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import cpcompile
from cpcompile.testing.model import TinyConfig
from cpcompile.testing.varlen_model import VarlenTinyLlama

if not args.verbose:
    cpcompile.one_line_refusals()  # a refusal (CPCompileError) prints its one line with the fix, not a traceback

cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if cuda else "gloo")
device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
if cuda:
    torch.cuda.set_device(device)
dtype = torch.bfloat16 if cuda else torch.float32  # the GPU attention kernels take bf16/fp16
world = dist.get_world_size()
mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("cp",))

torch.manual_seed(0)  # the same initial weights on every rank
cfg = TinyConfig()
model = VarlenTinyLlama(cfg, causal=True, max_len=args.tokens).to(device, dtype)  # max_len: constant
inner = "inductor" if cuda else "aot_eager"  # aot_eager: quicker to compile on CPU
backend = cpcompile.backend(strategy=args.strategy, comm=args.comm, mesh=mesh, inner=inner)
compiled = torch.compile(model, backend=backend, fullgraph=True)
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)


def packed_batch(gen: torch.Generator) -> dict:
    """One GLOBAL batch: random documents that count up from a random token, packed into args.tokens tokens."""
    unit = 2 * world if args.strategy == "thd_zigzag" else 1  # thd_zigzag: documents a multiple of 2 x ranks
    cuts = torch.randperm(args.tokens // unit - 1, generator=gen)[: args.max_documents - 1] + 1
    cu = torch.cat([torch.tensor([0]), cuts.sort().values * unit, torch.tensor([args.tokens])]).int()
    ids, labels = [], []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        doc = (torch.randint(0, cfg.vocab, (1,), generator=gen) + torch.arange(b - a + 1)) % cfg.vocab
        ids.append(doc[:-1])
        labels.append(torch.cat([doc[1:-1], torch.tensor([-100])]))  # a document's last token predicts nothing
    cu = cpcompile.pad_cu_seqlens(cu, args.tokens, length=args.max_documents + 2)  # one shape: no recompiles
    return {"input_ids": torch.cat(ids), "labels": torch.cat(labels), "cu_seqlens": cu}


data = torch.Generator().manual_seed(1)  # the same GLOBAL batches on every rank
losses = []
for step in range(args.steps):
    batch = packed_batch(data)
    global_token_count = int((batch["labels"] != -100).sum())
    # position_ids restart at every document; thd_balanced: batch["cu_seqlens"] becomes the offsets + this plan
    local = cpcompile.shard_batch(batch, strategy=args.strategy, mesh=mesh, seq_dim=0)
    local = {k: v.to(device) for k, v in local.items()}

    logits = compiled(local["input_ids"], local["position_ids"], local["cu_seqlens"])
    loss = F.cross_entropy(logits.float(), local["labels"], reduction="sum") / global_token_count
    opt.zero_grad()
    loss.backward()
    for param in model.parameters():  # each rank's gradients come from its own tokens: sum them
        dist.all_reduce(param.grad, group=mesh.get_group())
    opt.step()
    loss = loss.detach()
    dist.all_reduce(loss, group=mesh.get_group())  # the whole batch's loss, for the log
    losses.append(loss.item())
    if dist.get_rank() == 0:
        print(f"step {step + 1}/{args.steps}  loss {losses[-1]:.4f}", flush=True)

if dist.get_rank() == 0:  # a recompile is one more graph, whose attention calls are rewritten again
    rewritten = f"{len(backend.plans)} attention calls rewritten in {backend.graphs} compiled graph(s)"
    print(f"done: loss {losses[0]:.4f} -> {losses[-1]:.4f}, {rewritten}")

# Shut down in order: destroy_process_group destroys the process group (joining gloo's worker threads) only once nothing
# holds it; a group that outlives it is torn down while Python exits, where a gloo thread freeing a tensor aborts the
# process. Drop what this script holds (the mesh, the backend and the compiled model); cpcompile.destroy_process_group
# releases what Dynamo and DTensor keep, then destroys the group.
del mesh, backend, compiled
cpcompile.destroy_process_group()
