"""Every token-guard refusal names the fix that is right for its cause (issue 43.2): a label shift (Hugging Face's
loss, or a hand-written one) and local positions are the batch's to fix (shard_batch with hf_loss="causal_lm", the
GLOBAL position ids), so those messages name shard_batch with the backend's strategy and never offer
mark_token_local, which would make the result silently wrong; an op the guard may misread (a cumsum, a custom op, a
reduction used per token) keeps the mark as a conditional last resort. One message per kind, on a fake CP group."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tests.errors.test_token_guard import B, D, L, attend, no_marks, refusal  # noqa: F401

MARK = "cpcompile.mark_token_local"
HF_LOSS_FIX = "cpcompile.shard_batch(batch, strategy='zigzag', mesh=..., hf_loss=\"causal_lm\")"


def fix_of(msg: str) -> str:
    return msg.split("Fix:", 1)[1]


def hand_written_causal_loss(x, labels):
    logits = attend(x)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


def local_positions(x):
    return attend(x + torch.arange(x.shape[1])[None, :, None])


def branch_on_max(x, pos):
    return attend(x) * (pos.max() > 4 * L)  # a per-rank max decides a value


def length_number(x):
    return attend(x * math.log(x.shape[1]))


def mean_used_per_token(x):
    return attend(x - x.mean(dim=1, keepdim=True))


def cumsum(x):
    return attend(x).cumsum(dim=1)


@pytest.mark.parametrize(
    "fn,extra,needs,mark",
    [
        (hand_written_causal_loss, (torch.randint(0, D, (B, L)),), HF_LOSS_FIX, False),
        (local_positions, (), "cpcompile.shard_batch(batch, strategy='zigzag', mesh=...) adds position_ids", False),
        (branch_on_max, (torch.arange(L).expand(B, L),), "decide such values from the whole batch", False),
        (length_number, (), "use the GLOBAL length", False),
        (mean_used_per_token, (), "normalise per token, not over tokens", True),
        (cumsum, (), "cpcompile.token_mixer", True),
    ],
)
def test_each_refusal_names_the_fix_for_its_cause(no_comm, fn, extra, needs, mark):
    fix = fix_of(refusal(fn, torch.randn(B, L, D), *extra))
    assert needs in fix, fix
    assert (MARK in fix) is mark, fix


def test_hf_loss_over_unsharded_labels_names_hf_loss(no_comm):
    """An HF causal LM given labels without shard_batch(hf_loss=...) (here: the whole batch, shard_batch forgotten):
    its loss pads and shifts the labels; the fix is shard_batch's hf_loss, not a mark (which was offered)."""
    pytest.importorskip("transformers")
    from tests.support.hf_zoo import batch, build

    full = batch("llama", B, 2 * L)
    model = build("llama", "cpcompile")
    pos = torch.arange(2 * L).expand(B, -1)
    msg = refusal(lambda ids, labels: model(input_ids=ids, labels=labels, position_ids=pos, use_cache=False).loss,
                  full["input_ids"], full["labels"])  # fmt: skip
    assert "in ForCausalLMLoss" in msg and "Hugging Face's causal-LM loss shifts the labels" in msg, msg
    assert HF_LOSS_FIX in fix_of(msg) and MARK not in msg, msg
