"""The token guard: after the rewrite, refuse any op left in the graph that mixes tokens along the CP-sharded dim.

Under CP each rank holds only its own tokens. Token-wise ops (linear, MLP, norms, RoPE with sharded position_ids)
are exact on them; cpcompile rewrites attention; anything else that combines tokens (attention that is not SDPA or
varlen_attn: nn.MultiheadAttention, HF eager, a hand-written softmax(q @ k^T) @ v; a cumsum or scan, a convolution
or pooling over tokens, a sort along them, a mean over tokens used per token) would silently compute on this
rank's tokens alone. The guard raises ONE CPCompileError naming the first such op, its node and source line, at
compile time, before any collective.

How it decides: the rewritten graph is run once on meta tensors with the sequence-carrying inputs tagged, applying
cpcompile's own rule for each op's family: where its outputs hold tokens, or a refusal. Why own rules and not
DTensor's: DTensor's differ between torch versions (2.11 has no rule for the `(B*L, H)` flatten every nn.Linear
makes, 2.14.1's strategy API refuses aten.cat) and its answers are about communication, not about what a rank's
tokens mean (an arange over the local length is "replicated" to it). DTensor is asked only about ops no rule
covers (fallback.py). The rule:

1. An op is refused when it needs other ranks' tokens: a contraction, scan, convolution, sort, softmax or reorder
   along the tokens, a slice/select/pad of the token axis, tokens meeting tokens (q @ k^T).
2. A sum/mean/max/min over tokens (cross_entropy with reduction="sum"/"mean" too) yields a Share: each rank holds
   its share. That is fine as long as the share only flows to the graph's outputs through ops that keep it a
   share (scaling, adding shares, views): the user sums it across ranks (README's loss recipe). It is refused
   when anything else consumes it before that sum: a nonlinearity, a product of two shares, a per-token use.
3. Positions made from the LOCAL length (an arange over it, a model buffer sliced to it) combined with token data
   are refused: pass the GLOBAL position ids. So is the length used as a number with token data (`x * L`, with
   L from `x.shape[1]`, here or through a name on an earlier line; not a head dim that equals it: length.py),
   and a Share that decides a value (a comparison, `item()`, an integer Share handed to Python at a graph break:
   HF's dynamic RoPE branching on max(position_ids)).
4. A higher-order op whose body runs once (graph/bodies.py ONCE, the table find rewrites by: checkpoint, wrap,
   autocast, invoke_subgraph, hints_wrapper, ...) is looked into, its body run with the same tags, and torch.cond's
   two branches; any other higher-order op fed a sequence-carrying value is refused (cannot be analysed).
   A `flex_attention` node left after the rewrite is refused outright (the rewrite did not reach it); a flex
   region whose score_mod/mask_mod buffers carry the sharded sequence is refused (the mods index them by GLOBAL
   position, so they must be whole).
5. An op with no rule and no DTensor answer (a custom kernel) fed sequence-carrying values is refused: cpcompile
   cannot tell. Code that is token-local but refused is exempted with `cpcompile.mark_token_local(fn_or_op)`.

Graphs with no attention (a separate compiled function, the part after a graph break) are guarded too: their token
dims come from their inputs' marks (cpcompile/token_marks.py: shard / shard_batch's results, an earlier compiled
graph's outputs), else an earlier graph's local length; where nothing tells, an op that mixes tokens under any
reading of the dims is refused (infer.py). One is also kept until a graph of the same backend brings the local
length, then checked fully (infer.check_pending). An input shard / shard_batch sharded for another layout or CP
size is refused (check.refuse_wrong_layout). One cut to call a torch.compiler.disable'd function with this rank's
tokens among its outputs is refused unless that function is marked token-local (no graph shows what it does).

Skipped: DTensor graphs under a flat layout (DTensor's own propagation redistributes what an op needs), no process
group or a CP group of one rank (nothing is sharded). A graph the analysis itself fails on is refused: an
unchecked graph could be silently wrong.

Modules, one job each: check (the entry), infer (which dim holds the sequence; the runs), inputs (which inputs
may carry it; DTensor placements; the regions' local lengths), runner (a graph run node by node, higher-order
bodies), stand_ins (region calls), flow (flags, results, the node tracker), messages (the errors); the
propagation: tags (what a value carries, the token axis through reshapes), rules (pointwise, views), reduce
(reductions, scans, norms, losses, matmuls, convs), index (lookups, writes, factories), length (the local length
as a number), length_source (size reads in the source, followed through assignments), dispatch (the tracker),
fallback (DTensor for ops without a rule).
"""

from .check import refuse_flex_attention, refuse_token_mixing
from .flow import Flag, Result
from .infer import check_graph
from .messages import refusal
from .runner import track

__all__ = ["Flag", "Result", "check_graph", "refusal", "refuse_flex_attention", "refuse_token_mixing", "track"]
