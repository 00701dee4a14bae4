"""What a cpcompile.attention site adds to an SDPA site: its window, its softcap, its token metadata; each checked
here with one clear error (the rest of its plan is families/sdpa/plan.py's)."""

from __future__ import annotations

import torch.fx

from ...errors import site_error
from ..checks import constant
from ..site import AttentionSite

HF_POSITIONS_FIX = (
    "pass the tokens' GLOBAL position ids to the model (cpcompile.shard_batch creates them when the batch has none: "
    "torch.arange of the global length, sharded like the tokens)"
)


def window_of(site: AttentionSite, causal: bool, global_len: int) -> tuple[int, int] | None:
    """The site's sliding window over global positions, None when it has none or it cannot bind at this length."""
    if site.window is None:
        return None
    left, right = (int(constant(site, name, v, int)) for name, v in zip(("window_left", "window_right"), site.window))
    if left < -1 or right < -1:
        raise site_error(
            site.node,
            f"its window ({left}, {right}) has a side below -1; each side is a token count, or -1 for unbounded",
            "pass window=(left, right) with left, right >= 0, or -1 for no bound on that side",
        )
    right = 0 if causal else right
    left = -1 if left >= global_len - 1 else left  # a side that reaches past the sequence does not bind
    right = -1 if right >= global_len - 1 and not causal else right
    if causal and left == -1:
        return None
    return None if (left, right) == (-1, -1) else (left, right)


def softcap_of(site: AttentionSite) -> float:
    softcap = float(constant(site, "softcap", site.softcap, (int, float)))
    if softcap < 0:
        raise site_error(site.node, f"softcap={softcap} is negative", "pass softcap > 0, or 0 for none")
    return softcap


def sinks_of(site: AttentionSite) -> bool:
    """Whether the site has attention sinks; they must be one value a q head, (Hq,) (GPT-OSS's `sinks`)."""
    if site.sinks is None:
        return False
    shape = _shape(site.sinks)
    if shape != (site.q_shape[1],):
        raise site_error(
            site.node,
            f"its attention sinks have shape {shape}; they must be one logit a query head, ({site.q_shape[1]},)",
            "pass sinks of shape (num_query_heads,) (GPT-OSS: the attention module's `sinks` parameter)",
        )
    return True


def _reaches_input(node: torch.fx.Node) -> bool:
    """Whether `node` depends on any placeholder of its graph (a model input, or a body's operand)."""
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            return True
        stack.extend(n.all_input_nodes)
    return False


def _shape(node) -> tuple | None:
    value = node.meta.get("example_value", node.meta.get("val")) if isinstance(node, torch.fx.Node) else None
    return tuple(value.shape) if value is not None and hasattr(value, "shape") else None


def check_token_metadata(site: AttentionSite) -> None:
    """The padding mask and position ids must be this rank's share of the batch: L local tokens each, the
    positions given to the model (not made inside it from the local length, which are wrong on every rank but
    one). Their values are checked at run time (regions/batch_check.py: check_batch)."""
    local = site.q_shape[2]
    for name, node in (("padding mask (attention_mask)", site.padding_mask), ("position ids", site.position_ids)):
        if node is None:
            continue
        shape = _shape(node)
        if shape is None or len(shape) != 2 or shape[-1] != local:
            raise site_error(
                site.node,
                f"its {name} has shape {shape}, but this rank's queries have {local} tokens: it must be this rank's "
                "share of the batch, (batch, local tokens)",
                "shard it with the batch (cpcompile.shard_batch shards attention_mask and position_ids)",
            )
    positions = site.position_ids
    if positions is not None and not _reaches_input(positions):
        raise site_error(
            site.node,
            f"its position ids are computed inside the model from the local length (node '{positions.name}', e.g. "
            "HF's torch.arange when position_ids=None): every rank would use positions 0..L-1 for its own tokens",
            HF_POSITIONS_FIX,
        )
