"""Graphs Dynamo cuts at graph breaks (compiled without fullgraph=True): a graph before the first attention graph
has no local length of its own; the backend keeps it and checks it fully once its first attention graph brings
the length, before that graph's collectives. A per-rank reduction over tokens that decides a value there (HF's
dynamic RoPE compares max(position_ids) + 1 with its cache and branches in Python) is refused on every rank, as
are local-length positions made there and an integer reduction over tokens handed to Python at a break."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import cpcompile
from tests.errors.test_token_guard import B, D, L, attend, no_marks  # noqa: F401
from tests.support.errors import cp_error as _cp_error
from tests.support.fake_pg import fake_group

POSITIONS_FIX = "pass the tokens' GLOBAL position ids"
H = 12
"""The hidden size here: not the local length, so a graph without attention has one reading of its dims (with
L == D the guard refuses when any reading mixes tokens)."""


def compile_broken(fn, *args):
    """Compile (without fullgraph) and run `fn` as rank 0 of a fake CP group of 2."""
    with fake_group(0, 2):
        be = cpcompile.backend(strategy="zigzag", inner="eager")
        torch._dynamo.reset()
        return torch.compile(fn, backend=be)(*args)


def refusal(fn, *args) -> str:
    with pytest.raises(Exception) as excinfo:
        compile_broken(fn, *args)
    return str(_cp_error(excinfo))


def branch_on_max_position(x, pos):
    seq_len = pos.max() + 1
    if seq_len > 4 * L:  # the global batch decides once; each rank would decide on its own positions
        x = x * 2
    return attend(x)


def python_number_from_max_position(x, pos):
    seq_len = int(pos.max())  # a graph break: the per-rank max leaves the graph into Python
    return attend(x * seq_len)


def loss_share_at_a_break(x):
    loss = attend(x).sum()  # a floating-point share: the caller combines it across ranks
    torch._dynamo.graph_break()
    return loss * 2


table = nn.Embedding(64, H)


def positions_before_attention(x):
    x = x + table(torch.arange(x.shape[1]))  # local positions, in a graph with no attention
    torch._dynamo.graph_break()
    return attend(x)


def global_positions_before_attention(x, pos):
    x = x + table(pos)
    torch._dynamo.graph_break()
    return attend(x)


def test_a_per_rank_max_deciding_a_branch_is_refused(no_comm):
    pos = torch.arange(L).expand(B, L)
    msg = refusal(branch_on_max_position, torch.randn(B, L, D), pos)
    assert f"node 'gt' at {__file__}:" in msg and "if seq_len > 4 * L" in msg, msg
    assert "reduction over tokens decide a value" in msg and "max(position_ids)" in msg, msg


def test_an_integer_reduction_over_tokens_leaving_at_a_break_is_refused(no_comm):
    msg = refusal(python_number_from_max_position, torch.randn(B, L, D), torch.arange(L).expand(B, L))
    assert f"node 'max_1' at {__file__}:" in msg and "leaves the graph at a graph break" in msg, msg


def test_local_positions_before_the_first_attention_graph_are_refused(no_comm):
    msg = refusal(positions_before_attention, torch.randn(B, L, H))
    assert f"at {__file__}:" in msg and "LOCAL sequence length" in msg and POSITIONS_FIX in msg, msg


def test_correct_graphs_around_breaks_compile():
    """A loss share returned at a break, global positions before the first attention graph: not refused."""
    compile_broken(loss_share_at_a_break, torch.randn(B, L, H))
    compile_broken(global_positions_before_attention, torch.randn(B, L, H), torch.arange(L).expand(B, L))


@torch.compiler.disable
def eager_cumsum(h):
    return h.cumsum(1) / 4


def around_eager_cumsum(x):
    return attend(eager_cumsum(attend(x)))


def test_tokens_into_a_disabled_function_are_refused(no_comm):
    """The cumsum runs eagerly between two graphs, where no graph sees it (was error 0.4-0.6 on 2 ranks)."""
    msg = refusal(around_eager_cumsum, torch.randn(B, L, H))
    assert "torch.compiler.disable'd function eager_cumsum" in msg and f"({__file__}:" in msg, msg
    assert "cpcompile.mark_token_local(eager_cumsum)" in msg, msg


def test_a_marked_disabled_function_compiles():
    cpcompile.mark_token_local(eager_cumsum)  # a false promise, for the test: the mark is the user's word
    compile_broken(around_eager_cumsum, torch.randn(B, L, H))


# Graphs with no attention at all (issue 45): a separate compiled function, or the part after a graph break. Their
# token dims come from their inputs: shard / shard_batch's marks, an earlier compiled graph's outputs (the handoff);
# nothing known: every reading of their dims is tried, and an op that mixes tokens under one is refused.

conv_h = nn.Conv1d(H, H, 3, padding=1)


def running_sum(x):
    return x.cumsum(dim=1) * 2


def conv_over_sequence(x):
    return conv_h(x.transpose(1, 2)).transpose(1, 2)


mlp_in, mlp_out = nn.Linear(H, 2 * H), nn.Linear(2 * H, H)


def mlp_and_norm(x):
    """Token-local: an MLP and an RMS norm over the hidden dim."""
    return F.rms_norm(mlp_out(F.gelu(mlp_in(x))) + x, (H,))


def compile_alone(fn, x, dynamic=False, strategy="zigzag"):
    with fake_group(0, 2):
        be = cpcompile.backend(strategy=strategy, inner="eager")
        torch._dynamo.reset()
        return torch.compile(fn, backend=be, dynamic=dynamic)(x)


@pytest.mark.parametrize("fn,node", [(running_sum, "cumsum"), (conv_over_sequence, "conv1d")])
@pytest.mark.parametrize("dynamic", [False, True])
def test_token_mixing_in_a_graph_without_attention_is_refused(no_comm, fn, node, dynamic):
    """Fed what shard returns: its mark says dim 1 holds the tokens (was silent: cumsum error 6.23, conv 0.525)."""
    with fake_group(0, 2):
        x = cpcompile.shard(torch.randn(B, 2 * L, H), strategy="zigzag", seq_dim=1)
    with pytest.raises(Exception) as excinfo:
        compile_alone(fn, x, dynamic)
    msg = str(_cp_error(excinfo))
    assert f"node '{node}' at {__file__}:" in msg and "mixes tokens along the sequence dim" in msg, msg
    assert "cannot tell which dim" not in msg, msg  # the mark told it


def test_token_mixing_on_unknown_dims_is_refused_naming_the_reading(no_comm):
    """Hand-cut tokens (no mark): the reading under which the op mixes tokens is named, and the fixes for it."""
    with pytest.raises(Exception) as excinfo:
        compile_alone(running_sum, torch.randn(B, L, H))
    msg = str(_cp_error(excinfo))
    assert "node 'cumsum'" in msg and "cannot tell which dim holds this rank's tokens" in msg, msg
    assert "dim 1 of the input 'l_x_' (size 8) as the sequence" in msg, msg
    fix = msg.split("Fix:")[1]
    assert "inside the graph that has the attention" in fix and "cpcompile.token_mixer" in fix, msg
    assert "cpcompile.mark_token_local" in fix and "shard_batch" in fix, msg


def test_token_local_graph_without_attention_compiles():
    with fake_group(0, 2):
        x = cpcompile.shard(torch.randn(B, 2 * L, H), strategy="zigzag", seq_dim=1)
    for dynamic in (False, True):
        compile_alone(mlp_and_norm, x, dynamic)


def attend_h(x):
    return attend(x.view(B, -1, 2, H // 2).flatten(2))


def test_compiled_outputs_hand_their_tokens_on(no_comm):
    """A graph's outputs that hold tokens are marked when it runs: another backend's graph fed them (no shared
    length, no shard mark) checks them at their token dim, and the cumsum is refused there by the mark."""
    with fake_group(0, 2):
        first = torch.compile(attend_h, backend=cpcompile.backend(strategy="zigzag", inner="eager"))
        y = first(torch.randn(B, L, H))
        second = torch.compile(running_sum, backend=cpcompile.backend(strategy="zigzag", inner="eager"))
        with pytest.raises(Exception) as excinfo:
            second(y)
    msg = str(_cp_error(excinfo))
    assert "node 'cumsum'" in msg and "cannot tell which dim" not in msg, msg


def test_a_batch_sharded_for_another_layout_is_refused(no_comm):
    """shard's mark names the layout: a flat-sharded batch fed to a zigzag backend is refused at compile time."""
    with fake_group(0, 2):
        x = cpcompile.shard(torch.randn(B, 2 * L, H), strategy="flat", seq_dim=1)
    with pytest.raises(Exception) as excinfo:
        compile_alone(mlp_and_norm, x)
    msg = str(_cp_error(excinfo))
    assert "sharded by cpcompile.shard_batch / shard with strategy='flat' for cp=2" in msg, msg
    assert "strategy='zigzag'" in msg.split("Fix:")[1], msg
