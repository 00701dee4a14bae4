"""Attention sinks (GPT-OSS's `s_aux`): one learned logit per q head in every row's softmax denominator.

A sink is a key every row sees, with score `sink[h]` (not scaled, not softcapped) and value zero. So it is one more
partial of the LSE merge, (out 0, lse sink), folded in once after every block and ring step of a row:
    lse' = logaddexp(lse, sink),   out' = out * exp(lse - lse') = out * sigmoid(lse - sink).
No kernel needs to know about it, so every comm, layout and kernel takes it.

Backward: the kernels' backward run with the FINAL (out', lse') gives the exact q/k/v gradients (their
probabilities exp(s - lse') carry the sink in the denominator, and dout . out' is the row term the sink changes),
so the regions pass them as they already do. The sink's own gradient is the zero-valued key's score gradient:
    dsink[h] = -sum over batch and rows of (dout . out') * exp(sink[h] - lse').
Each rank sums over its own rows (its share, like every parameter gradient under CP; a2a: its heads' rows).
"""

from __future__ import annotations

import torch


def _per_head(sinks: torch.Tensor, lse: torch.Tensor, lse_last: bool) -> torch.Tensor:
    """sinks (H,) as lse's dtype, broadcastable against lse: dense (B, H, S), or varlen (H, T) when not lse_last."""
    s = sinks.to(lse.dtype)
    return s.view(1, -1, 1) if lse_last else s.view(-1, 1)


def fold_sinks(
    out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor, lse_last: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out', lse'): the sink folded into a final merged result, computed in lse's dtype (the accumulation dtype),
    out' in out's dtype. `lse_last`: out (B, H, S, Dv) and lse (B, H, S); else out (T, H, Dv) and lse (H, T)."""
    total = torch.logaddexp(lse, _per_head(sinks, lse, lse_last))
    weight = torch.exp(lse - total)  # a row that saw no key (-inf): weight 0, lse' = sink
    weight = weight.unsqueeze(-1) if lse_last else weight.t().unsqueeze(-1)
    return (out.to(lse.dtype) * weight).to(out.dtype), total


def sinks_grad(
    dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor, lse_last: bool = True
) -> torch.Tensor:
    """This rank's gradient of the sinks (H,), given the final out' and lse' (fold_sinks') and their dout."""
    dot = (dout.to(lse.dtype) * out.to(lse.dtype)).sum(-1)  # dense (B, H, S); varlen (T, H)
    if not lse_last:
        dot = dot.t()
    grad = -(dot * torch.exp(_per_head(sinks, lse, lse_last) - lse))
    return (grad.sum((0, 2)) if lse_last else grad.sum(1)).to(sinks.dtype)
