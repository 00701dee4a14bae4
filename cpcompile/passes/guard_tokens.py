"""The token guard: after the rewrite, refuse any op left in the graph that mixes tokens along the CP-sharded dim.

Under CP each rank holds only its own tokens. Token-wise ops (linear, MLP, norms, RoPE with sharded position_ids)
are exact on them; cpcompile rewrites attention; anything else that combines tokens (attention that is not SDPA or
varlen_attn: nn.MultiheadAttention, HF eager, a hand-written softmax(q @ k^T) @ v; a cumsum or scan, a convolution
or pooling over tokens, a sort along them, a mean over tokens used per token) would silently compute on this
rank's tokens alone. The guard raises ONE CPCompileError naming the first such op, its node and source line, at
compile time, before any collective.

How it decides: token_flow.py runs the rewritten graph once on meta tensors with the sequence-carrying inputs
tagged and applies cpcompile's own rule for each op's family (cpcompile/guard/): where its outputs hold tokens,
or a refusal. Why own rules and not DTensor's: DTensor's differ between torch versions (2.11 has no rule for the
`(B*L, H)` flatten every nn.Linear makes, 2.14.1's strategy API refuses aten.cat) and its answers are about
communication, not about what a rank's tokens mean (an arange over the local length is "replicated" to it).
DTensor is asked only about ops no rule covers (guard/fallback.py). The rule:

1. An op is refused when it needs other ranks' tokens: a contraction, scan, convolution, sort, softmax or reorder
   along the tokens, a slice/select/pad of the token axis, tokens meeting tokens (q @ k^T).
2. A sum/mean/max/min over tokens (cross_entropy with reduction="sum"/"mean" too) yields a Share: each rank holds
   its share. That is fine as long as the share only flows to the graph's outputs through ops that keep it a
   share (scaling, adding shares, views): the user sums it across ranks (README's loss recipe). It is refused
   when anything else consumes it before that sum: a nonlinearity, a product of two shares, a per-token use.
3. Positions made from the LOCAL length (an arange over it, a model buffer sliced to it) combined with token data
   are refused: pass the GLOBAL position ids.
4. A higher-order op with a body (torch.utils.checkpoint, wrap, invoke_subgraph) is looked into, its body run with
   the same tags; any other higher-order op fed a sequence-carrying value is refused (cannot be analysed).
   A `flex_attention` node left after the rewrite is refused outright (the rewrite did not reach it); a flex
   region whose score_mod/mask_mod buffers carry the sharded sequence is refused (the mods index them by GLOBAL
   position, so they must be whole).
5. An op with no rule and no DTensor answer (a custom kernel) fed sequence-carrying values is refused: cpcompile
   cannot tell. Code that is token-local but refused is exempted with `cpcompile.mark_token_local(fn_or_op)`.

Which inputs carry the sequence, and on which dim: the rewritten sites give this rank's local length L (SDPA q
(B, H, L, D): dim 2; varlen q (T_local, H, D): dim 0). Every graph input that is not model state (parameters and
buffers: Dynamo marks them as static inputs) and has a dim of size L is placed `Shard` on that dim; inputs that
feed only a varlen site's cu_seqlens are GLOBAL offsets and never placed. A dim of size L that is not the sequence
(batch == L, hidden == L) is resolved by consistency: when the first assignment refuses something or leaves a
site's q/k/v off their sequence dim, the other choices of dim for inputs with several size-L dims are tried, and
the graph is accepted if one of them places every site's q/k/v on the sequence dim with nothing refused. An input
is never dropped from the assignment to make a refusal go away (a token mask's cumsum into position ids must stay
refused).

A declared token mixer's region (cpcompile/mixers/) is a site too: its token inputs must arrive on its seq dim,
its outputs hold the tokens there, and its local length counts like an attention site's.

Graphs with no rewritten site (a model whose attention is nn.MultiheadAttention or HF eager has none): the local
length is unknown, so each distinct size of the inputs' dims is tried as the sequence length; a size is taken as
the sequence when some op makes two values sharded on it meet along it (every token against every token:
q @ k^T, SDPA inside nn.MultiheadAttention), and that run's first refusal is raised. A graph with no site and no
such pairwise use (a lone cumsum or conv in a graph of its own) is not checked: its sequence dim cannot be told
from its batch dim. Also skipped: DTensor graphs (DTensor's own propagation redistributes what an op needs, so a
flat Shard stays correct; a zigzag Shard is a permuted sequence and is not checked), no process
group or a CP group of one rank (nothing is sharded), and any graph the analysis itself fails on (an op meta
tensors cannot run, a bug): a warning says so; a failure of the checker must not block a model.
"""

from __future__ import annotations

import itertools
import logging

import torch
import torch.fx
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree

from ..errors import CPCompileError, site_error
from ..mesh import cp_mesh_dim, resolve_group
from ..mixers import TOKEN_REGION
from .match import is_cp_attention, is_flex, is_sdpa, is_varlen
from .token_flow import BODY_OPERANDS, Flag, Result, concrete, track

log = logging.getLogger("cpcompile")

MAX_ASSIGNMENTS = 16
"""At most this many choices of sequence dims are tried for one graph (ambiguous dims are rare)."""
_SEEN: dict[int, tuple[object, set[int]]] = {}
"""id(backend config) -> (config, the local sequence lengths of the attention sites compiled with it): a later
graph of the same backend with no site (after a graph break) whose inputs have one is checked with it as the
sequence length, fully."""


def _seen(config) -> set[int]:
    return _SEEN.setdefault(id(config), (config, set()))[1]


MAX_SIZES = 6
"""A graph with no site: at most this many candidate sequence lengths are tried."""

_SDPA_FIX = (
    "compute attention with torch.nn.functional.scaled_dot_product_attention or "
    "torch.nn.attention.varlen.varlen_attn (sliding windows, softcap: cpcompile.attention), which cpcompile "
    'rewrites into CP regions (Hugging Face: attn_implementation="cpcompile", registered by `import cpcompile`)'
)
_MARK_FIX = (
    "if the op is in fact token-local (each output token depends only on its own token), mark it or the "
    "function around it: cpcompile.mark_token_local(fn_or_op)"
)


def _walk(gm: torch.fx.GraphModule):
    """Every node of the graph and of the bodies its higher-order ops call (get_attr GraphModules)."""
    for node in gm.graph.nodes:
        yield node
        if node.op == "get_attr":
            sub = getattr(gm, str(node.target), None)
            if isinstance(sub, torch.fx.GraphModule):
                yield from _walk(sub)


def refuse_flex_attention(gm: torch.fx.GraphModule) -> None:
    """A flex_attention node left after the rewrite is refused: the pass rewrites every one it finds (or refuses
    it when planning), so one left sits where the rewrite does not reach, and would attend to local tokens."""
    for node in _walk(gm):
        if is_flex(node):
            raise site_error(
                node,
                "this flex_attention call was not rewritten into a CP region (it sits inside a higher-order op the "
                "pass does not search), so it would attend over this rank's tokens only",
                "call flex_attention in the compiled graph itself or inside torch.utils.checkpoint",
                what="flex_attention node",
            )


def _value(node: torch.fx.Node):
    return node.meta.get("example_value", node.meta.get("val"))


def _is_state(node: torch.fx.Node, value: torch.Tensor) -> bool:
    """Parameters and buffers (Dynamo marks both as static inputs) never carry the sequence."""
    if isinstance(value, torch.nn.Parameter):
        return True
    if "_dynamo_static_input_type" in (node.meta.get("tensor_dict") or {}):
        return True
    grapharg = node.meta.get("grapharg")
    return isinstance(getattr(grapharg, "example", None), torch.nn.Parameter)


def _state_inputs(gm: torch.fx.GraphModule) -> frozenset[str]:
    """Placeholders that are model state (parameters, buffers)."""
    return frozenset(
        n.name
        for n in gm.graph.nodes
        if n.op == "placeholder" and isinstance(v := _value(n), torch.Tensor) and _is_state(n, v)
    )


def _dtensor_inputs(gm: torch.fx.GraphModule) -> list[tuple[torch.fx.Node, int]]:
    """(placeholder, token dim) of every DTensor input sharded on its CP mesh dim (global shapes)."""
    found = []
    for node in gm.graph.nodes:
        value = _value(node) if node.op == "placeholder" else None
        if isinstance(value, DTensor) and (cp := cp_mesh_dim(value.device_mesh)) is not None:
            p = value.placements[cp]
            if p.is_shard():
                found.append((node, p.dim % value.dim()))
    return found


def _data_inputs(gm: torch.fx.GraphModule, strategy: str = "zigzag") -> list | None:
    """(placeholder, traced value) of every tensor input that is not model state; None: the graph is skipped."""
    inputs = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        value = _value(node)
        if isinstance(value, DTensor):
            return None if strategy == "flat" else _dtensor_inputs(gm)
        if not isinstance(value, torch.Tensor) or _is_state(node, value):
            continue
        inputs.append((node, torch.empty(concrete(value.shape), dtype=value.dtype, device="meta")))
    return inputs


def _cu_only_inputs(gm: torch.fx.GraphModule) -> set[str]:
    """Inputs that reach varlen regions' cu_seqlens but no q/k/v: global document offsets, never sharded."""
    cu, qkv = set(), set()
    for node in _walk(gm):
        plan = node.meta.get("cpcompile_plan")
        if plan is not None and node.op == "call_function":
            qkv |= _top_inputs(gm, node.args[:3])
            if plan.site.kind == "varlen":
                cu |= _top_inputs(gm, node.args[3:4])
            if plan.site.kind == "flex":  # the global BlockMask's tensors
                cu |= _top_inputs(gm, [t for t in node.args[5] if isinstance(t, torch.fx.Node)])
    return cu - qkv


def _top_inputs(gm: torch.fx.GraphModule, args) -> set[str]:
    """Names of the top-level placeholders that `args` (nodes of gm, or of a body it calls) depend on."""
    body_calls: dict[int, list[tuple[torch.fx.Node, int]]] = {}
    for node in _walk(gm):
        if node.op == "call_function" and isinstance(node.target, torch._ops.HigherOrderOperator):
            start = BODY_OPERANDS.get(node.target.name())
            if start is not None and node.args and isinstance(node.args[0], torch.fx.Node):
                body = getattr(node.graph.owning_module, str(node.args[0].target), None)
                if body is not None:
                    body_calls.setdefault(id(body.graph), []).append((node, start))
    found, seen = set(), set()
    stack = [a for a in args if isinstance(a, torch.fx.Node)]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op == "placeholder":
            calls = body_calls.get(id(node.graph))
            if calls is None:
                found.add(node.name)
                continue
            index = [n for n in node.graph.nodes if n.op == "placeholder"].index(node)
            for call, start in calls:
                if start + index < len(call.args) and isinstance(call.args[start + index], torch.fx.Node):
                    stack.append(call.args[start + index])
            continue
        stack.extend(node.all_input_nodes)
    return found


def _mixer_lengths(gm: torch.fx.GraphModule) -> set[int]:
    """The local lengths of the token mixers' regions (cpcompile/mixers/): their outputs' seq dim."""
    found = set()
    for node in _walk(gm):
        seq = node.meta.get(TOKEN_REGION)
        if seq is not None:
            out = next(t for t in pytree.tree_leaves(_value(node)) if isinstance(t, torch.Tensor))
            found.add(int(out.shape[seq]))
    return found


def _preferred(dims: list[int]) -> list[int]:
    """Candidate dims, the likeliest first: dim 1 ((batch, seq, ...) inputs), then the rest in order."""
    return sorted(dims, key=lambda d: (d != 1, d))


def _assignments(inputs, lengths: set[int], skip: set[str]):
    """Seeds {placeholder: seq dim}: the preferred dims first, then the other choices of ambiguous inputs."""
    choices = []
    for node, value in inputs:
        dims = [d for d, n in enumerate(value.shape) if n in lengths]
        if dims and node.name not in skip:
            choices.append((node.name, _preferred(dims)))
    names = [n for n, _ in choices]
    for combo in itertools.islice(itertools.product(*(d for _, d in choices)), MAX_ASSIGNMENTS):
        yield dict(zip(names, combo))


def _cp_size(state) -> int:
    if state.plans:
        return state.plans[0].group.size
    if state.config.cp_group is not None:
        return state.config.cp_group.size
    try:
        return resolve_group(state.config.mesh, state.config.group).size
    except CPCompileError:
        return 1


def _clean(result: Result) -> bool:
    return not result.flags and not result.inconsistent


def _track(gm: torch.fx.GraphModule, seeds: dict[str, int], length: int | None) -> Result:
    """token_flow.track; a failure of the analysis itself (an op meta tensors cannot run, a bug) is a refusal:
    an unchecked graph could be silently wrong."""
    try:
        return track(gm, seeds, length, _state_inputs(gm))
    except Exception as e:  # noqa: BLE001
        raise CPCompileError(
            f"cpcompile's token guard could not analyse this graph ({type(e).__name__}: {e}), so it cannot tell "
            "whether an op in it mixes tokens across the CP ranks. Fix: mark the code that runs it token-local if "
            "it is (cpcompile.mark_token_local(fn_or_module)), or report the op that fails"
        ) from e


def check_graph(
    gm: torch.fx.GraphModule, plans: list, seen: set[int] | None = None, strategy: str = "zigzag"
) -> Flag | None:
    """The first op of `gm` that mixes tokens along the sharded dim (None: none, or the graph is skipped)."""
    inputs = _data_inputs(gm, strategy)
    if not inputs:
        return None
    if isinstance(inputs[0][1], int):  # DTensor inputs under a permuted layout: their placements say where
        result = _track(gm, {n.name: d for n, d in inputs}, None)
        return result.flags[0] if result.flags else None
    lengths = {p.site.q_shape[0] if p.site.kind == "varlen" else p.site.q_shape[2] for p in plans}
    lengths |= _mixer_lengths(gm)
    if lengths:
        if seen is not None:
            seen.update(lengths)
        results = []
        for seeds in _assignments(inputs, lengths, _cu_only_inputs(gm)):
            result = _track(gm, seeds, min(lengths))
            if _clean(result) or (not result.flags and not results):
                return None  # consistent and clean, or the first choice refuses nothing
            results.append(result)
        flagged = [r for r in results if r.flags]
        chosen = next((r for r in flagged if not r.inconsistent), flagged[0] if flagged else None)
        if chosen is None:
            log.debug("cpcompile token guard: no sequence assignment places every site's q/k/v; skipped")
            return None
        return chosen.flags[0]
    sizes = sorted({n for _, v in inputs for n in v.shape if n > 1})
    for size in sorted((seen or set()) & set(sizes)):  # a local length an earlier graph's attention had
        for seeds in itertools.islice(_assignments(inputs, {size}, set()), 4):
            result = _track(gm, seeds, size)
            if result.flags:
                return result.flags[0]
    if len(sizes) > MAX_SIZES:
        return None
    for size in sizes:
        for seeds in itertools.islice(_assignments(inputs, {size}, set()), 4):
            result = _track(gm, seeds, None)
            if any(f.pairwise for f in result.flags):
                return result.flags[0]
    return None


def refusal(flag: Flag) -> CPCompileError:
    """The CPCompileError for a flagged op: which op and node, why it is wrong under CP, what to do."""
    op, node = flag.op, flag.node
    if is_sdpa(node) or is_varlen(node) or is_cp_attention(node):
        rule = (
            "this attention call was not rewritten into a CP region (it sits inside a higher-order op the rewrite "
            "does not enter), so it would attend over this rank's tokens only"
        )
        fix = "call it outside torch.utils.checkpoint / wrap / invoke_subgraph in the compiled graph"
        return site_error(node, rule, fix)
    if flag.kind == "partial":
        rule = (
            f"{op} uses a reduction over tokens before it is summed across ranks ({flag.detail}): each rank "
            "reduces only its own tokens, so this use sees a partial value and its result would be silently wrong"
        )
        fix = (
            "return reductions over tokens (a loss sum) from the compiled graph and combine them across ranks "
            "afterwards (dist.all_reduce, README's loss recipe); normalise per token, not over tokens; " + _MARK_FIX
        )
    elif flag.kind == "unknown":
        rule = f"{op} takes sequence-sharded values and cpcompile cannot tell whether it mixes tokens ({flag.detail})"
        fix = _MARK_FIX
    elif flag.kind == "positions":
        rule = (
            f"{op} uses positions made from this rank's LOCAL sequence length ({flag.detail}): every rank would "
            "number its own tokens 0..L-1, so positions (RoPE, learned or sinusoidal position embeddings, "
            "position-dependent scaling) would be wrong on every rank but one"
        )
        fix = (
            "pass the tokens' GLOBAL position ids into the model and build positions from them "
            "(cpcompile.shard_batch adds position_ids when the batch has none; torchtitan: pass positions=); "
            + _MARK_FIX
        )
    elif flag.kind == "flex_buffer":
        rule = (
            f"{op} holds this rank's tokens only ({flag.detail}), but under CP the score_mod/mask_mod index it by "
            "GLOBAL position, so it would be read out of range or at the wrong tokens"
        )
        fix = "pass the whole tensor (built for the global sequence, as for one GPU), not its shard_batch shard"
        return site_error(node, rule, fix)
    elif flag.kind == "hop":
        rule = f"the higher-order op {op} takes sequence-sharded values and cpcompile cannot look inside it"
        if flag.detail:
            rule = f"the higher-order op {op} takes sequence-sharded values and {flag.detail}"
        fix = _SDPA_FIX + "; " + _MARK_FIX
    else:
        how = "it relates tokens to each other, as attention does" if flag.pairwise else "it needs other ranks' tokens"
        rule = (
            f"{op} mixes tokens along the sequence dim that CP shards ({flag.detail}: {how}), so on this rank's "
            "tokens alone its result would be silently wrong"
        )
        fix = (
            f"{_SDPA_FIX}; a head- or channel-local token mixer (a short causal depthwise conv, a linear-attention, "
            "gated-delta or SSM scan whose every head reads only its own head) runs head-parallel once declared: "
            "cpcompile.token_mixer(module_or_fn, heads_dim=...) (its code must read head counts and the length "
            "from its inputs); other token mixing (a mixer that mixes heads, pooling, sorting tokens, state passing "
            f"between ranks) is not supported: keep it out of the CP-compiled model; {_MARK_FIX}"
        )
    return site_error(node, rule, fix, what="node", action="run")


def refuse_token_mixing(gm: torch.fx.GraphModule, state) -> None:
    """The pass step (after rewrite): raise one CPCompileError for the first token-mixing op left in `gm`."""
    refuse_flex_attention(gm)
    if _cp_size(state) < 2:
        return
    flag = check_graph(gm, state.plans, _seen(state.config), state.config.strategy)
    if flag is not None:
        raise refusal(flag)
