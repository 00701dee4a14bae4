"""Train a Hugging Face causal LM with context parallelism, with the model's own loss (needs transformers).

    torchrun --standalone --nproc-per-node=2 examples/torchrun/hf.py                      # CPU: gloo; GPUs: NCCL
    torchrun --standalone --nproc-per-node=8 examples/torchrun/hf.py --model meta-llama/Llama-3.2-1B --seq 32768
    torchrun --standalone --nproc-per-node=2 examples/torchrun/hf.py --packing     # documents packed as HF packs them

Without --model a small LlamaForCausalLM is built from a config (random weights, nothing downloaded); with it
the named model's config and weights are loaded. attn_implementation="cpcompile" is registered by
`import cpcompile`. --packing: each row is several documents concatenated with position_ids restarting at every
document (HF's "padding-free" packing, DataCollatorWithFlattening's output); shard_batch(hf_packing=True) reads
the documents from them and the model attends within documents only (strategy thd_balanced: any lengths).
The HF Trainer: cpcompile/integrations/hf_trainer.py.
"""

import argparse
import os
import sys

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--model", help="a Hub name or path (default: a small random LlamaForCausalLM)")
p.add_argument("--strategy", default=None, choices=["flat", "zigzag", "thd_balanced"],
               help="the token layout (default: zigzag; thd_balanced with --packing)")  # fmt: skip
p.add_argument("--packing", action="store_true", help="rows of packed documents (position_ids restart per document)")
p.add_argument("--comm", default="all_gather", choices=["all_gather", "a2a", "ring", "auto"],
               help="how the ranks exchange K/V (README, 'Use it in your training loop')")  # fmt: skip
p.add_argument("--steps", type=int, default=10, help="training steps")
p.add_argument("--batch", type=int, default=1, help="rows a batch")
p.add_argument("--seq", type=int, default=1024, help="GLOBAL tokens per row (a multiple of 2 x ranks for zigzag)")
p.add_argument("--verbose", action="store_true", help="a refusal's whole traceback (default: its one line)")
args = p.parse_args()  # before importing torch: --help answers at once
args.strategy = args.strategy or ("thd_balanced" if args.packing else "zigzag")
if args.packing != (args.strategy == "thd_balanced"):
    p.error("--packing goes with --strategy thd_balanced (packed documents), and only with it")
if "LOCAL_RANK" not in os.environ:
    sys.exit(f"{sys.argv[0]} is one CP rank: launch it with torchrun --standalone --nproc-per-node=2 {sys.argv[0]}")

import torch
import torch.distributed as dist
import transformers
from torch.distributed.device_mesh import init_device_mesh

import cpcompile

if not args.verbose:
    cpcompile.one_line_refusals()  # a refusal (CPCompileError) prints its one line with the fix, not a traceback

cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if cuda else "gloo")
device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
if cuda:
    torch.cuda.set_device(device)
dtype = torch.bfloat16 if cuda else torch.float32  # the GPU attention kernels take bf16/fp16
mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("cp",))

torch.manual_seed(0)  # the same initial weights on every rank
if args.model:
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="cpcompile", dtype=dtype)
else:
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="cpcompile")
model = model.to(device, dtype).train()
vocab = model.config.vocab_size
inner = "inductor" if cuda else "aot_eager"  # aot_eager: quicker to compile on CPU
backend = cpcompile.backend(strategy=args.strategy, comm=args.comm, mesh=mesh, inner=inner)
compiled = torch.compile(model, backend=backend, fullgraph=True)
opt = torch.optim.AdamW(model.parameters(), lr=3e-3 if not args.model else 1e-5)

data = torch.Generator().manual_seed(1)  # the same GLOBAL batches on every rank
losses = []
for step in range(args.steps):
    start = torch.randint(0, vocab, (args.batch, 1), generator=data)
    ids = (start + torch.arange(args.seq)) % vocab  # rows that count up: something to learn
    batch = {"input_ids": ids, "labels": ids}
    if args.packing:  # documents of random lengths back to back, positions restarting at each (HF's packing)
        cuts = torch.randint(1, args.seq, (max(1, args.seq // 64),), generator=data).unique().tolist()
        bounds = [0, *cuts, args.seq]
        pos = torch.cat([torch.arange(b - a) for a, b in zip(bounds, bounds[1:]) if b > a])
        batch["position_ids"] = pos.expand(args.batch, -1)
    # hf_loss: the GLOBAL labels shifted into shift_labels before sharding (per document with --packing), and
    # num_items_in_batch, the global count of targets, so each rank's .loss is its share of the global mean loss
    local = cpcompile.shard_batch(batch, strategy=args.strategy, mesh=mesh, hf_loss="causal_lm",
                                  hf_packing=args.packing)  # fmt: skip
    local = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in local.items()}

    loss = compiled(**local, use_cache=False).loss
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

# --packing: HF gives the batch's longest document (max_length_q) as a Python int, so the first batch with another
# longest document compiles the model again (Dynamo then makes that length dynamic): 2 graphs of 2 attention calls
if dist.get_rank() == 0:  # a recompile is one more graph, whose attention calls are rewritten again
    rewritten = f"{len(backend.plans)} attention calls rewritten in {backend.graphs} compiled graph(s)"
    print(f"done: loss {losses[0]:.4f} -> {losses[-1]:.4f}, {rewritten}")

# Shut down in order: destroy_process_group destroys the process group (joining gloo's worker threads) only once nothing
# holds it; a group that outlives it is torn down while Python exits, where a gloo thread freeing a tensor aborts the
# process. Drop what this script holds (the mesh, the backend and the compiled model); cpcompile.destroy_process_group
# releases what Dynamo and DTensor keep, then destroys the group.
del mesh, backend, compiled
cpcompile.destroy_process_group()
