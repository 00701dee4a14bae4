"""comm="a2a"'s region, written once over any head-local function: trade sequence for heads, run the function on
every token of this rank's heads, trade heads back for sequence.

A head-local function (attention, a causal conv, a linear-attention or SSM scan) computes each head of its output
from the same head of its inputs, so it is exact on the whole sequence for heads/cp of the heads. `head_parallel`
is that composition; what differs between callers is only how their tensors travel, a `HeadExchange`:

- attention (heads.py: `DenseHeads`, `PackedHeads`): q/k/v as (B, H, n, D), GQA's kv heads replicated by the
  caller for the ranks that read them, the received buffers kept rank-major (the executor's blocks know where
  every chunk sits, so no reorder copy) and zigzag's causal slots exchanged one at a time; a packed region's lse
  goes back by its own small all-to-all;
- token mixers (mixers/exchange.py: `MixerHeads`): any tensors with tokens on one dim and heads on another, put
  in GLOBAL order by one copy (a scan's code must see its tokens in order).

Folding those into one exchange would change what crosses the wire (attention keeps the batch dim beside the
heads, a mixer flattens every dim but the token's) or add a reorder copy to attention, so they stay two
exchanges; both pack their tensors of one dtype side by side per token into ONE all-to-all
(`exchange_side_by_side`). Backward is autograd's: each all-to-all's backward is the reverse all-to-all.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from ...comm.collectives import exchange_first


class HeadExchange(Protocol):
    """How a region's tensors trade sequence for heads (`to_heads`) and back (`to_tokens`)."""

    def to_heads(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """This rank's tokens of every head -> every token of this rank's heads (the inner function's inputs)."""
        ...

    def to_tokens(self, outputs: Any) -> Any:
        """The inner function's outputs (every token of this rank's heads) -> this rank's tokens of every head."""
        ...


def head_parallel(fn: Callable[..., Any], inputs: Sequence[torch.Tensor], exchange: HeadExchange) -> Any:
    """`fn` (head-local) run head-parallel: its inputs moved to heads by `exchange`, its outputs moved back.

    `fn` takes the received tensors positionally. It may return its outputs lazily (a generator): the exchange
    then sends each back as it is produced, so a region with several outputs (the dense attention region's q
    buffers) issues each output's all-to-all before computing the next, in the order it always had."""
    return exchange.to_tokens(fn(*exchange.to_heads(inputs)))


def exchange_side_by_side(
    parts: Sequence[torch.Tensor], group_name: str, arrange: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> list[torch.Tensor]:
    """ONE equal-split all-to-all per dtype of `parts` (world, n, ..., width_i): block j of each goes to rank j,
    the parts of one dtype packed side by side along the last dim (their other dims equal). Returns each part as
    received (block j from rank j), split from the received buffer after `arrange` of it (a view or a reorder of
    its leading dims, e.g. rank-major blocks flattened into one token dim)."""
    got: list[torch.Tensor | None] = [None] * len(parts)
    for dtype in dict.fromkeys(p.dtype for p in parts):
        idx = [i for i, p in enumerate(parts) if p.dtype == dtype]
        same = [parts[i] for i in idx]
        received = exchange_first(torch.cat(same, dim=-1) if len(same) > 1 else same[0], group_name)
        if arrange is not None:
            received = arrange(received)
        for i, part in zip(idx, received.split([p.shape[-1] for p in same], dim=-1)):
            got[i] = part
    return got  # type: ignore[return-value]
