"""Train a Hugging Face causal LM with transformers' Trainer and cpcompile CP (needs transformers, accelerate).

    torchrun --standalone --nproc-per-node=2 examples/torchrun/hf_trainer.py            # CPU: gloo; GPUs: NCCL

CPTrainer is the Trainer with the same GLOBAL batches on every rank, each rank keeping its tokens (CPCollator:
cpcompile.shard_batch with hf_loss="causal_lm") and the model compiled with the cpcompile backend. Every process
is one CP rank. Rows must have one length (no padding); HF packed batches: hf.py --packing (docs/guide.md).
"""

import argparse
import os
import shutil
import sys
import tempfile

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--steps", type=int, default=10, help="training steps")
p.add_argument("--seq", type=int, default=1024, help="tokens per row (a multiple of 2 x ranks for zigzag)")
p.add_argument("--rows", type=int, default=2, help="rows a batch")
p.add_argument("--output-dir", help="the Trainer's output folder, kept (default: a temporary one, removed)")
p.add_argument("--verbose", action="store_true", help="a refusal's whole traceback (default: its one line)")
args = p.parse_args()  # before importing torch: --help answers at once
if "LOCAL_RANK" not in os.environ:
    sys.exit(f"{sys.argv[0]} is one CP rank: launch it with torchrun --standalone --nproc-per-node=2 {sys.argv[0]}")

import torch
import transformers

import cpcompile
from cpcompile.integrations.hf_trainer import CPTrainer

if not args.verbose:
    cpcompile.one_line_refusals()  # a refusal (CPCompileError) prints its one line with the fix, not a traceback

config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
torch.manual_seed(0)
model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="cpcompile")

data = torch.Generator().manual_seed(1)  # rows that count up from a random token: something to learn
starts = torch.randint(0, 256, (args.steps * args.rows, 1), generator=data)
rows = (starts + torch.arange(args.seq)) % 256
dataset = [{"input_ids": row, "labels": row.clone()} for row in rows]

cuda = torch.cuda.is_available()
output_dir = args.output_dir or tempfile.mkdtemp(prefix="cp_trainer_")  # this example saves nothing in it
training = transformers.TrainingArguments(
    output_dir=output_dir, max_steps=args.steps, per_device_train_batch_size=args.rows, learning_rate=3e-3,
    logging_steps=1, save_strategy="no", report_to=[], use_cpu=not cuda, bf16=cuda, disable_tqdm=True,
    ddp_find_unused_parameters=False,  # every parameter gets a gradient (the Trainer's default makes DDP search)
)  # fmt: skip
trainer = CPTrainer(
    model=model, args=training, train_dataset=dataset, data_collator=transformers.default_data_collator,
    cp_strategy="zigzag", cp_comm="all_gather", cp_inner="inductor" if cuda else "aot_eager",
)  # fmt: skip
trainer.train()
losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
if not args.output_dir:
    shutil.rmtree(output_dir, ignore_errors=True)
if trainer.is_world_process_zero():
    print(f"done: loss {losses[0]:.4f} -> {losses[-1]:.4f}")

# Shut down in order: destroy_process_group destroys the process group (joining gloo's worker threads) only once nothing
# holds it; a group that outlives it is torn down while Python exits, where a gloo thread freeing a tensor aborts the
# process. Drop what this script holds (the Trainer and the model compiled in place; the Trainer started the group and
# leaves it running); cpcompile.destroy_process_group releases what Dynamo and DTensor keep, then destroys the group.
del trainer, model
cpcompile.destroy_process_group()
