"""The token guard's own propagation: where each value holds this rank's tokens, op family by op family.

tags.py: what a value carries (`Seq`: the sharded token axis, possibly merged with other dims; `Share`: a
per-rank reduction over tokens), and how a token axis moves through reshapes. rules.py: one rule per op family
(pointwise, reductions, matmuls, views, indexing, scans/sorts, copies into slices, factories over the local
length) deciding each op's output tags or refusing the op. passes/token_flow.py runs a graph under them;
passes/guard_tokens.py is the pass step.
"""
