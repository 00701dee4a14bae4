"""The token guard's CPCompileErrors: for each kind of Flag, why the op is wrong under CP and what to do."""

from __future__ import annotations

import re

import torch.fx

from ..errors import CPCompileError, site_error
from ..graph.targets import is_cp_attention, is_sdpa, is_varlen
from ..token_marks import TokenMark
from .flow import Flag

SDPA_FIX = (
    "compute attention with torch.nn.functional.scaled_dot_product_attention or "
    "torch.nn.attention.varlen.varlen_attn (sliding windows, softcap: cpcompile.attention), which cpcompile "
    'rewrites into CP regions (Hugging Face: attn_implementation="cpcompile", registered by `import cpcompile`)'
)
MARK_FIX = (
    "if the op is in fact token-local (each output token depends only on its own token), mark it or the "
    "function around it: cpcompile.mark_token_local(fn_or_op)"
)


HF_LOSS = re.compile(r"transformers[/\\]loss[/\\]")
"""Hugging Face's loss functions' file (transformers/loss/loss_utils.py): a refusal there is its label shift."""
LABELS = re.compile(r"label", re.IGNORECASE)
"""Graph inputs that are labels (Dynamo names placeholders after the arguments)."""


SHIFTS = ("aten.slice", "aten.constant_pad_nd", "aten.roll", "aten.narrow", "aten.pad")
"""Ops that shift tokens along the sequence: in a graph that takes labels, the causal-LM loss's shift."""


def loss_cause(flag: Flag) -> str | None:
    """The cause: "hf_loss" when the refused op is Hugging Face's loss (it pads and shifts the labels along the
    sequence); "labels" when it shifts tokens (a slice, pad or roll of the token axis) in a graph that takes an
    input named *label*: a hand-written causal-LM loss shifting its logits or labels; else None. Either way the
    fix is the batch's (labels shifted over the global sequence: shard_batch's hf_loss), never a mark."""
    if flag.node is None:
        return None
    if HF_LOSS.search(flag.node.meta.get("stack_trace") or ""):
        return "hf_loss"
    if flag.kind != "gather" or not flag.op.startswith(SHIFTS):
        return None
    inputs = flag.node.graph.find_nodes(op="placeholder")
    return "labels" if any(LABELS.search(n.name) for n in inputs) else None


def loss_fix(cause: str, strategy: str) -> tuple[str, str]:
    """(what the rule adds, the fix) for a refusal caused by a label shift (loss_cause)."""
    batch = f'cpcompile.shard_batch(batch, strategy={strategy!r}, mesh=..., hf_loss="causal_lm")'
    if cause == "hf_loss":
        why = (
            "Hugging Face's causal-LM loss shifts the labels by one along the sequence, and each rank's last "
            "token's label is the next rank's first"
        )
        fix = (
            f"shard the GLOBAL batch with {batch}: it adds shift_labels (the labels shifted over the whole "
            "sequence) and num_items_in_batch, so the model shifts nothing and each rank's loss is its share of "
            "the global mean (sum the losses and the gradients over the ranks)"
        )
        return why, fix
    why = (
        "a causal-LM loss shifts the logits or the labels by one along the sequence here, and each rank's last "
        "token's label is the next rank's first"
    )
    fix = (
        f"shift the labels over the GLOBAL sequence before sharding ({batch} adds them as shift_labels) or pass "
        "labels already shifted, and compute the loss per token (README's loss recipe)"
    )
    return why, fix


def refusal(flag: Flag, strategy: str = "zigzag") -> CPCompileError:
    """The CPCompileError for a flagged op: which op and node, why it is wrong under CP, what to do (`strategy`:
    the backend's, named in fixes that shard the batch)."""
    op, node = flag.op, flag.node
    if is_sdpa(node) or is_varlen(node) or is_cp_attention(node):
        rule = (
            "this attention call was not rewritten into a CP region (it sits inside a higher-order op the rewrite "
            "does not enter), so it would attend over this rank's tokens only"
        )
        fix = "call it outside torch.utils.checkpoint / wrap / invoke_subgraph in the compiled graph"
        return site_error(node, rule, fix)
    if flag.kind == "flex_buffer":
        rule = (
            f"{op} holds this rank's tokens only ({flag.detail}), but under CP the score_mod/mask_mod index it by "
            "GLOBAL position, so it would be read out of range or at the wrong tokens"
        )
        fix = "pass the whole tensor (built for the global sequence, as for one GPU), not its shard_batch shard"
        return site_error(node, rule, fix)
    rule, fix = _explain(flag, strategy)
    if (cause := loss_cause(flag)) is not None:  # the batch's fix; a mark would make it silently wrong
        why, fix = loss_fix(cause, strategy)
        return site_error(node, f"{rule}: {why}", fix, what="node", action="run")
    if flag.reading:
        rule += (
            "; this graph has no attention and no input cpcompile knows to hold tokens (one cpcompile.shard / "
            "shard_batch returned, or another compiled graph's output), so cpcompile cannot tell which dim holds "
            f"this rank's tokens, and with {flag.reading} this op mixes them"
        )
        if not flag.pairwise:  # attention written by hand: the attention fix stays the right one
            fix = UNDETERMINED_FIX
    return site_error(node, rule, fix, what="node", action="run")


UNDETERMINED_FIX = (
    "run it inside the graph that has the attention (compile it with the model, fullgraph=True), or feed this "
    "graph the tensors cpcompile.shard_batch / shard return (on the device they run on) so that cpcompile knows "
    "their token dim; a head-local token mixer: cpcompile.token_mixer(module_or_fn, heads_dim=...); " + MARK_FIX
)


def wrong_layout(gm: torch.fx.GraphModule, name: str, mark: TokenMark, strategy: str, world: int) -> CPCompileError:
    """An input sharded by cpcompile.shard / shard_batch with another layout or CP size than the backend's."""
    node = next(n for n in gm.graph.nodes if n.op == "placeholder" and n.name == name)
    source = getattr(getattr(node.meta.get("grapharg"), "source", None), "name", None)
    what = source() if callable(source) else name
    return CPCompileError(
        f"cpcompile cannot run this graph: its input {what} was sharded by cpcompile.shard_batch / shard with "
        f"strategy={mark.strategy!r} for cp={mark.world}, but this backend runs strategy={strategy!r} on "
        f"{world} CP ranks, so this rank's tokens are not the ones its CP regions assume and the result would be "
        f"silently wrong. Fix: shard the batch for the backend: cpcompile.shard_batch(batch, strategy={strategy!r}, "
        "mesh=...) with the backend's mesh (or compile with the strategy the batch was sharded with)"
    )


def _explain(flag: Flag, strategy: str = "zigzag") -> tuple[str, str]:
    """(rule, fix) of a flagged op that is not attention. A mark is offered only where it can be right: an op the
    guard may misread; never for local positions, a per-rank value deciding a branch or the local length."""
    op = flag.op
    if flag.kind == "partial":
        rule = (
            f"{op} uses a reduction over tokens before it is summed across ranks ({flag.detail}): each rank "
            "reduces only its own tokens, so this use sees a partial value and its result would be silently wrong"
        )
        fix = (
            "return reductions over tokens (a loss sum) from the compiled graph and combine them across ranks "
            "afterwards (dist.all_reduce, README's loss recipe); normalise per token, not over tokens; " + MARK_FIX
        )
        return rule, fix
    if flag.kind == "branch":
        rule = (
            f"{op} lets a reduction over tokens decide a value ({flag.detail}): each rank reduces only its own "
            "tokens (a max of its position ids, a count, a sum), so each rank would decide on a different value "
            "(a different branch or size; HF's dynamic RoPE takes max(position_ids)) and compute the wrong result"
        )
        fix = (
            "decide such values from the whole batch outside the compiled model and pass them in (a length: the "
            "GLOBAL length; positions: the tokens' GLOBAL position ids; HF: a RoPE type that does not read "
            "max(position_ids), or compile with fullgraph=True to see the branch)"
        )
        return rule, fix
    if flag.kind == "length":
        rule = (
            f"{op} uses this rank's LOCAL sequence length as a number with token data ({flag.detail}): each rank "
            "holds L of the cp*L tokens, so a scale, mean or position computed from L would be wrong on every rank"
        )
        fix = (
            "use the GLOBAL length (pass it into the model as a number or read it from the batch before "
            f"cpcompile.shard_batch(batch, strategy={strategy!r}, mesh=...)) and build positions from the tokens' "
            "GLOBAL position ids"
        )
        return rule, fix
    if flag.kind == "eager":
        rule = (
            f"{flag.detail}: Dynamo runs it eagerly, outside every graph, so cpcompile can neither rewrite nor check "
            "it; a cumsum, conv or other token mixing there would see this rank's tokens only and be silently wrong"
        )
        fix = (
            f"let Dynamo compile {op} (remove torch.compiler.disable) so that cpcompile checks it; if it is "
            f"token-local (each output token depends only on its own token): cpcompile.mark_token_local({op})"
        )
        return rule, fix
    if flag.kind == "unknown":
        rule = f"{op} takes sequence-sharded values and cpcompile cannot tell whether it mixes tokens ({flag.detail})"
        return rule, MARK_FIX
    if flag.kind == "positions":
        rule = (
            f"{op} uses positions made from this rank's LOCAL sequence length ({flag.detail}): every rank would "
            "number its own tokens 0..L-1, so positions (RoPE, learned or sinusoidal position embeddings, "
            "position-dependent scaling) would be wrong on every rank but one"
        )
        fix = (
            "pass the tokens' GLOBAL position ids into the model and build positions from them "
            f"(cpcompile.shard_batch(batch, strategy={strategy!r}, mesh=...) adds position_ids when the batch has "
            "none; torchtitan: pass positions=)"
        )
        return rule, fix
    if flag.kind == "hop":
        rule = f"the higher-order op {op} takes sequence-sharded values and cpcompile cannot look inside it"
        if flag.detail:
            rule = f"the higher-order op {op} takes sequence-sharded values and {flag.detail}"
        return rule, SDPA_FIX + "; " + MARK_FIX
    how = "it relates tokens to each other, as attention does" if flag.pairwise else "it needs other ranks' tokens"
    rule = (
        f"{op} mixes tokens along the sequence dim that CP shards ({flag.detail}: {how}), so on this rank's "
        "tokens alone its result would be silently wrong"
    )
    fix = (
        f"{SDPA_FIX}; a head- or channel-local token mixer (a short causal depthwise conv, a linear-attention, "
        "gated-delta or SSM scan whose every head reads only its own head) runs head-parallel once declared: "
        "cpcompile.token_mixer(module_or_fn, heads_dim=...) (its code must read head counts and the length "
        "from its inputs), or with its state passed along the chunks (flat or zigzag; token_mixer(..., "
        "comm='state', context=... for a causal conv, state=True for a chunked linear recurrence)); other token "
        "mixing (a mixer that mixes heads, pooling, sorting tokens) is not supported: keep it out of the "
        f"CP-compiled model; {MARK_FIX}"
    )
    return rule, fix
