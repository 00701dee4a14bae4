"""Hugging Face `Trainer` with cpcompile context parallelism: `CPTrainer` (a Trainer subclass) and `CPCollator`.

Every process of the run is one CP rank of one CP group (no data parallelism across groups here). The Trainer
stays in charge of everything else (optimizer, schedule, logging, saving); what CP changes:
- data: every rank must see the same GLOBAL batches, so the training DataLoader is not split over the ranks
  (accelerate would give each rank other samples); `CPCollator` collates the global batch, then keeps this
  rank's tokens with `cpcompile.shard_batch(..., hf_loss="causal_lm")`: GLOBAL position_ids, the globally
  shifted `shift_labels`, and `num_items_in_batch`, the global count of targets;
- the model is compiled in place with the cpcompile backend (attn_implementation="cpcompile");
- the loss and gradients: each rank's `.loss` is its share of the global mean. The Trainer gathers
  `num_items_in_batch` over the ranks (the shards' targets add up to the global count), multiplies the loss by
  the number of processes (`average_tokens_across_devices`, its default) and DDP averages the gradients over
  them: the gradient of the global mean loss, as on one process.
Refused with one CPCompileError before training: HF "padding-free" batches (position_ids restarting at every
document, e.g. DataCollatorWithFlattening), padded batches (an attention_mask with zeros), a CP group that is
not every process. HF's packed and padded batches train with CP in a loop of your own:
`shard_batch(batch, strategy="thd_balanced", hf_packing=True, hf_loss="causal_lm")` (docs/guide.md, "Hugging Face
transformers"; examples/torchrun/hf.py --packing), the one recipe the refusals below name.
Needs transformers and accelerate (the Trainer's own requirement).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import transformers
from torch.utils.data import DataLoader, RandomSampler

from ..backend import backend as cp_backend
from ..errors import CPCompileError
from ..layouts import LAYOUTS
from ..mesh import resolve_group
from ..sharding import shard_batch

PACKED_FIX = (
    "HF's packed or padded batches in a training loop of your own: shard_batch(batch, strategy='thd_balanced', "
    "hf_packing=True, hf_loss='causal_lm') (examples/torchrun/hf.py --packing; CPTrainer does not take them yet)"
)
"""The fix the collator's refusals name for packed and padded batches: the guide's one recipe for them."""


def _check_global_batch(batch: dict[str, Any]) -> None:
    """Refuse what CP cannot apply to a Hugging Face batch, before any rank trains on it."""
    mask = batch.get("attention_mask")
    if isinstance(mask, torch.Tensor) and not bool(mask.all()):
        raise CPCompileError(
            "CPCollator: the batch has padding (attention_mask has zeros); a CP rank's attention cannot skip "
            "another rank's padded keys. Fix: batches of equal-length rows (pack or cut the texts to one length, "
            f"e.g. group_texts), or {PACKED_FIX}."
        )
    pos = batch.get("position_ids")
    if isinstance(pos, torch.Tensor):
        expected = torch.arange(pos.shape[-1], device=pos.device).expand_as(pos)
        if not torch.equal(pos, expected):
            raise CPCompileError(
                "CPCollator: position_ids restart inside a row (HF padding-free packing, e.g. "
                "DataCollatorWithFlattening): a CP rank would attend across the document boundaries, which only "
                f"these position_ids mark. Fix: a collator without flattening (equal-length rows), or {PACKED_FIX}."
            )


class CPCollator:
    """Collate the GLOBAL batch with `collator`, then keep this rank's tokens (shard_batch with hf_loss)."""

    def __init__(
        self,
        collator: Callable[[list], dict],
        *,
        strategy: str = "zigzag",
        mesh=None,
        group=None,
        hf_loss: str = "causal_lm",
    ) -> None:
        if strategy not in LAYOUTS:
            raise CPCompileError(
                f"CPCollator(strategy={strategy!r}): the Trainer path takes dense rows. Fix: one of "
                f"{', '.join(sorted(LAYOUTS))}."
            )
        self.collator, self.strategy, self.mesh, self.group, self.hf_loss = collator, strategy, mesh, group, hf_loss

    def __call__(self, features: list) -> dict[str, Any]:
        batch = dict(self.collator(features))
        _check_global_batch(batch)
        batch.pop("attention_mask", None)  # all ones (checked): nothing to mask
        return shard_batch(batch, strategy=self.strategy, mesh=self.mesh, group=self.group, hf_loss=self.hf_loss)


class CPTrainer(transformers.Trainer):
    """`transformers.Trainer` training with cpcompile CP over every process (launch with torchrun).

    `cp_strategy` ("flat" or "zigzag"), `cp_comm` and `cp_inner` go to `cpcompile.backend`; the model must use
    attn_implementation="cpcompile". Everything else is the Trainer's own arguments."""

    def __init__(
        self,
        *args: Any,
        cp_strategy: str = "zigzag",
        cp_comm: str = "all_gather",
        cp_inner: str = "inductor",
        cp_mesh=None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        group = resolve_group(cp_mesh, None)
        world = dist.get_world_size() if dist.is_initialized() else 1
        if group.size != world:
            raise CPCompileError(
                f"CPTrainer: the CP group has {group.size} of the {world} processes; data parallelism across CP "
                "groups is not supported here. Fix: a CP group (mesh) over every process."
            )
        self.data_collator = CPCollator(self.data_collator, strategy=cp_strategy, mesh=cp_mesh)
        backend = cp_backend(strategy=cp_strategy, comm=cp_comm, mesh=cp_mesh, inner=cp_inner)
        self.model.compile(backend=backend, fullgraph=True)  # in place: the Trainer keeps the same module
        self.cp_backend = backend

    def _get_collator_with_removed_columns(self, data_collator, description=None):
        """Columns are removed from the features before CPCollator sees them (its own keys stay)."""
        if not isinstance(data_collator, CPCollator):
            return super()._get_collator_with_removed_columns(data_collator, description)
        inner = super()._get_collator_with_removed_columns(data_collator.collator, description)
        return CPCollator(inner, strategy=data_collator.strategy, mesh=data_collator.mesh,
                          group=data_collator.group, hf_loss=data_collator.hf_loss)  # fmt: skip

    def get_train_dataloader(self) -> DataLoader:
        """The same GLOBAL batches on every rank: a sampler seeded by args.seed, not split over the processes."""
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        generator = torch.Generator().manual_seed(self.args.seed)
        return DataLoader(
            self.train_dataset,
            batch_size=self._train_batch_size,
            sampler=RandomSampler(self.train_dataset, generator=generator),
            collate_fn=self._get_collator_with_removed_columns(self.data_collator, "training"),
            drop_last=self.args.dataloader_drop_last,
        )
