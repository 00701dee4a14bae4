"""Hugging Face MoE models' aux loss (`output_router_logits=True`) under CP: the experts' load counted over the CP
group, each rank returning its share of the one-process loss.

transformers 5.24's `load_balancing_loss_func` (one copy per MoE modeling module: Qwen3-MoE, Mixtral, Qwen2-MoE,
OLMoE, GraniteMoE, Jamba, Qwen3-Next, GPT-OSS, ...) is Switch Transformer's loss over every layer's router:

    aux = E * sum_e f_e * P_e,   f_e = C_e / N,   P_e = S_e / N

C_e: the top-k assignments to expert e, N: the routed rows (tokens x layers; padding left out under an attention
mask), S_e: the sum of the router's probabilities for e. On a rank's own tokens f and P are that rank's, and the
product of two per-rank fractions is not the batch's (the token guard refused it at its histc). C and N carry no
gradient (top-k indices, counts), so the loss is linear in the probabilities given the batch's counts:

    aux = sum over ranks r of  E / N^2 * sum_e C_e * S_e^(r)

The replacement computes exactly that: C and N summed over the CP group (cpcompile::rank_total, one all-gather of
E + 1 numbers a step), S^(r) over the rank's own tokens, so each rank's aux loss (and the loss the model adds it
to, `loss += router_aux_loss_coef * aux_loss`) is its share: the shares add up to the one-process aux loss, and the
gradients the ranks' shares give, summed as every parameter gradient is, are its gradient. Without CP (eagerly, one
process, another backend) rank_total is the values themselves and the function is the one-process loss (equal to
transformers' up to rounding: tests/unit/test_hf_models.py). Replaced in the modeling modules of "cpcompile" models
when they are built (hf_models.py), where the function has transformers' signature.
"""

from __future__ import annotations

import inspect
import sys

import torch
import torch.nn as nn

from ..rank_total import rank_total

SIGNATURE = ("gate_logits", "num_experts", "top_k", "attention_mask")
"""The parameters of the function replaced (transformers 5.24's; another signature is left as it is)."""
_REPLACED: dict[str, object] = {}
"""Modeling module name -> transformers' own function."""


def load_balancing_loss_func(
    gate_logits: torch.Tensor | tuple[torch.Tensor] | None,
    num_experts: int | None = None,
    top_k: int = 2,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor | int:
    """transformers' Switch Transformer aux loss (same arguments, same value without CP); under CP this rank's share
    of it, the experts' counts and the routed rows summed over the CP group (module doc)."""
    if gate_logits is None or not isinstance(gate_logits, tuple):
        return 0
    device = gate_logits[0].device
    experts = torch.arange(num_experts, device=device)
    mask = None
    if attention_mask is not None:  # the same (batch x length) rows in every layer
        mask = attention_mask.reshape(-1).to(device=device, dtype=torch.float32)
    counts = probs = rows = None  # sums over this rank's tokens, started from the first layer's (not from zeros,
    for layer_gate in gate_logits:  # which the token guard would take for a replicated value added to a share)
        routing = torch.nn.functional.softmax(layer_gate.to(device), dim=-1)
        _, selected = torch.topk(routing, top_k, dim=-1)
        hits = (selected.unsqueeze(-1) == experts).sum(1).float()  # (rows, experts): top-k assignments a row
        routed = routing.float()
        weight = torch.ones_like(routed[:, 0]) if mask is None else mask
        hits, routed = hits * weight.unsqueeze(-1), routed * weight.unsqueeze(-1)
        layer = (hits.sum(0), routed.sum(0), weight.sum())
        counts, probs, rows = layer if counts is None else (counts + layer[0], probs + layer[1], rows + layer[2])
    counts, rows = rank_total([counts, rows])  # the batch's, over the CP group
    return torch.sum(counts * probs) * num_experts / (rows * rows)


def replace_aux_loss(model: nn.Module) -> list[str]:
    """Replace `load_balancing_loss_func` in the modeling modules `model`'s layers come from, where it has
    transformers' signature; returns the modules' names."""
    names = []
    for module_name in sorted({type(m).__module__ for m in model.modules()}):
        modeling = sys.modules.get(module_name)
        fn = getattr(modeling, "load_balancing_loss_func", None)
        if fn is None:
            continue
        if fn is not load_balancing_loss_func:
            if tuple(inspect.signature(fn).parameters) != SIGNATURE:
                continue
            _REPLACED[module_name] = fn
            modeling.load_balancing_loss_func = load_balancing_loss_func
        names.append(module_name)
    return names


def original(module_name: str):
    """transformers' own load_balancing_loss_func of a modeling module replaced here (None: not replaced)."""
    return _REPLACED.get(module_name)
