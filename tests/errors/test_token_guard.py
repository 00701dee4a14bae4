"""The token guard refuses every op left after the rewrite that mixes tokens along the CP-sharded dim: one
CPCompileError naming the op, its node and the source line here, at compile time, before any collective.
Its escape hatch (cpcompile.mark_token_local) and the higher-order ops it looks into are tested here too;
tests/errors/test_token_guard_models.py checks that real models compile unchanged."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import cpcompile
from cpcompile.token_local import clear_token_local_marks
from tests.support.errors import cp_error as _cp_error
from tests.support.fake_pg import fake_group

B, L, D = 2, 8, 8  # the sequence dim is 1 of (B, L, D)


@pytest.fixture(autouse=True)
def no_marks():
    clear_token_local_marks()
    yield
    clear_token_local_marks()


def compile_cp(fn, *args, strategy="zigzag", world=2):
    """Compile and run `fn` as rank 0 of a fake CP group; returns the backend."""
    with fake_group(0, world):
        be = cpcompile.backend(strategy=strategy, inner="eager")
        torch._dynamo.reset()
        torch.compile(fn, backend=be, fullgraph=True)(*args)
    return be


def refusal(fn, *args, **kwargs) -> str:
    with pytest.raises(Exception) as excinfo:
        compile_cp(fn, *args, **kwargs)
    return str(_cp_error(excinfo))


def attend(x):
    """SDPA over the tokens of x (B, L, D): rewritten into a CP region, so these graphs have a site."""
    q = x.view(x.shape[0], x.shape[1], 2, -1).transpose(1, 2)
    return F.scaled_dot_product_attention(q, q, q, is_causal=True).transpose(1, 2).reshape(x.shape)


mha = nn.MultiheadAttention(D, 2, batch_first=True)
mha_seq_first = nn.MultiheadAttention(D, 2)
encoder = nn.TransformerEncoderLayer(D, 2, 16, dropout=0.0, batch_first=True)
conv = nn.Conv1d(D, D, 3, padding=1)


def multihead(x):
    return mha(x, x, x)[0]


def multihead_seq_first(x):
    y = x.transpose(0, 1)  # (L, B, D)
    return mha_seq_first(y, y, y)[0]


def encoder_layer(x):
    return encoder(x)


def hand_written(x):
    return torch.softmax(x @ x.transpose(-1, -2) / 8**0.5, dim=-1) @ x


def hand_written_beside_sdpa(x):
    return attend(x) + torch.softmax(x @ x.transpose(-1, -2), dim=-1) @ x


def cumsum(x):
    return attend(x).cumsum(dim=1)


def conv_over_tokens(x):
    return attend(conv(x.transpose(1, 2)).transpose(1, 2))


def mean_used_per_token(x):
    return attend(x - x.mean(dim=1, keepdim=True))


def sort_tokens(x):
    return attend(x).sort(dim=1).values


def pool_tokens(x):
    return attend(x) + F.avg_pool1d(x.transpose(1, 2), 3, 1, padding=1).transpose(1, 2)


def shift_tokens(x):
    return attend(x)[:, 1:] - x[:, :-1]


def exp_of_loss_share(x):
    return attend(x).sum().exp()


def mean_into_attention(x):
    return attend(x.mean(dim=1, keepdim=True).expand_as(x).contiguous())


@pytest.mark.parametrize(
    "fn,node,op",
    [
        (multihead, "multi_head_attention_forward", "aten.bmm"),
        (multihead_seq_first, "multi_head_attention_forward", "aten.bmm"),
        (encoder_layer, "multi_head_attention_forward", "aten."),
        (hand_written, "matmul", "aten.bmm"),
        (hand_written_beside_sdpa, "matmul", "aten.bmm"),
        (cumsum, "cumsum", "aten.cumsum"),
        (conv_over_tokens, "conv1d", "aten.convolution"),
        (mean_used_per_token, "sub", "aten.sub"),
        (sort_tokens, "sort", "aten.sort"),
        (pool_tokens, "avg_pool1d", "aten.avg_pool2d"),
        (shift_tokens, "getitem", "aten.slice"),
        (exp_of_loss_share, "exp", "aten.exp"),
        (mean_into_attention, "expand_as", "aten.expand"),
    ],
)
def test_token_mixing_is_refused(no_comm, fn, node, op):
    msg = refusal(fn, torch.randn(B, L, D))
    assert f"cpcompile cannot run node '{node}' at {__file__}:" in msg, msg
    rule, fix = msg.split("Fix:")
    assert op in rule and ("mixes tokens" in rule or "reduction over tokens" in rule), msg
    assert "cpcompile.mark_token_local" in fix, msg
    if fn in (multihead, encoder_layer, hand_written):
        assert 'attn_implementation="cpcompile"' in fix and "scaled_dot_product_attention" in fix, msg


def test_refusal_names_the_line(no_comm):
    msg = refusal(cumsum, torch.randn(B, L, D))
    assert "in cumsum: `return attend(x).cumsum(dim=1)`" in msg, msg


def test_flex_attention_is_rewritten_not_refused():
    """flex_attention is a CP region now (tests/parity/test_flex.py); what cannot be rewritten is refused by the
    planner (tests/errors/test_flex_errors.py), and a flex call the rewrite did not reach by the guard."""
    from torch.nn.attention.flex_attention import flex_attention

    def flex(x):
        q = x.view(B, L, 2, -1).transpose(1, 2)
        return flex_attention(q, q, q)

    be = compile_cp(flex, torch.randn(B, L, D))
    assert [p.site.kind for p in be.plans] == ["flex"]


def token_wise(x):
    return F.gelu(attend(F.rms_norm(x, (D,)))) * 2 + x


def loss_sum(x):
    return attend(x).sum()


def loss_shares_scaled(x, count):
    return (attend(x).square().sum() + x.sum()) / count  # shares added and scaled stay shares


def cross_entropy_sum(x, labels):
    return F.cross_entropy(attend(x).flatten(0, 1), labels.flatten(), reduction="sum")


def cross_entropy_mean(x, labels):
    return F.cross_entropy(attend(x).flatten(0, 1), labels.flatten())


def max_over_tokens(x):
    return attend(x).amax(dim=1)


@pytest.mark.parametrize(
    "fn,extra",
    [
        (token_wise, ()),
        (loss_sum, ()),
        (loss_shares_scaled, (torch.tensor(5.0),)),
        (cross_entropy_sum, (torch.randint(0, D, (B, L)),)),
        (cross_entropy_mean, (torch.randint(0, D, (B, L)),)),
        (max_over_tokens, ()),
    ],
)
def test_token_wise_and_reductions_at_the_end_compile(fn, extra):
    """A reduction over tokens whose per-rank share only reaches the outputs is fine (the user sums it)."""
    be = compile_cp(fn, torch.randn(B, L, D), *extra)
    assert len(be.plans) == 1


def test_cu_seqlens_is_global():
    """cu_seqlens (here with as many entries as this rank has tokens) is never taken as sharded: slicing it is
    fine."""
    from torch.nn.attention.varlen import varlen_attn

    def packed(q, cu):
        return varlen_attn(q, q, q, cu, cu, 16, 16, window_size=(-1, 0)), cu[1:] - cu[:-1]

    cu = torch.tensor([0, 1, 2, 3, 4, 5, 9, 16], dtype=torch.int32)
    assert len(compile_cp(packed, torch.randn(8, 2, 4), cu, strategy="thd").plans) == 1


def test_analysis_failure_is_a_refusal(no_comm, monkeypatch):
    """A graph the checker itself fails on (a bug, an op meta tensors cannot run) is refused, not compiled
    unchecked: it could be silently wrong."""
    from cpcompile.guard import infer

    def broken(*args):
        raise RuntimeError("meta kernel missing")

    monkeypatch.setattr(infer, "track", broken)
    msg = refusal(cumsum, torch.randn(B, L, D))
    assert "could not analyse this graph (RuntimeError: meta kernel missing)" in msg, msg


def test_a_graph_after_a_graph_break_is_checked(no_comm):
    """The graph after a break has no attention site: the local length of the backend's earlier graph tells
    which dim holds the tokens, and a cumsum over them is refused."""

    def broken_model(x):
        y = attend(x)
        torch._dynamo.graph_break()
        return y.cumsum(dim=1)

    with fake_group(0, 2):
        be = cpcompile.backend(strategy="zigzag", inner="eager")
        torch._dynamo.reset()
        with pytest.raises(Exception) as excinfo:
            torch.compile(broken_model, backend=be)(torch.randn(B, L, D))
    msg = str(_cp_error(excinfo))
    assert "node 'cumsum'" in msg and "aten.cumsum" in msg, msg


def test_ambiguous_sizes_are_resolved():
    """Batch, hidden and sequence of one size: the assignment that puts q/k/v on the sequence wins."""
    compile_cp(token_wise, torch.randn(L, L, D))  # B == L == D

    def seq_first(x):  # (L, B, D) with B == L: the sequence is dim 0 here
        return attend(x.transpose(0, 1)).transpose(0, 1) * 2

    compile_cp(seq_first, torch.randn(L, L, D))


def body_cumsum(x):
    return x.cumsum(dim=1) * 2


def body_token_wise(x):
    return F.gelu(x) * 2


def test_checkpoint_bodies_are_looked_into(no_comm):
    def mixing(x):
        return attend(x) + checkpoint(body_cumsum, x, use_reentrant=False)

    msg = refusal(mixing, torch.randn(B, L, D, requires_grad=True))
    assert f"node 'cumsum' at {__file__}" in msg and "in body_cumsum" in msg, msg


def test_token_wise_checkpoint_body_compiles():
    def clean(x):
        return attend(x) + checkpoint(body_token_wise, x, use_reentrant=False)

    compile_cp(clean, torch.randn(B, L, D, requires_grad=True))


@torch.compiler.nested_compile_region
def region_cumsum(x):
    return x.cumsum(dim=1) * 2


@torch.compiler.nested_compile_region
def region_token_wise(x):
    return F.dropout(F.gelu(x), 0.1, training=True)


def test_invoke_subgraph_and_wrap_bodies_are_looked_into(no_comm):
    from torch._higher_order_ops.wrap import wrap

    msg = refusal(lambda x: attend(x) + region_cumsum(x), torch.randn(B, L, D))
    assert f"node 'cumsum' at {__file__}" in msg and "in region_cumsum" in msg, msg
    msg = refusal(lambda x: attend(x) + wrap(body_cumsum, x), torch.randn(B, L, D))
    assert f"node 'cumsum' at {__file__}" in msg and "in body_cumsum" in msg, msg


def test_token_wise_subgraph_and_wrap_bodies_compile():
    from torch._higher_order_ops.wrap import wrap

    compile_cp(lambda x: attend(x) + region_token_wise(x) + region_token_wise(2 * x), torch.randn(B, L, D))
    compile_cp(lambda x: attend(x) + wrap(body_token_wise, x), torch.randn(B, L, D))


def test_attention_in_a_checkpoint_body_is_rewritten_and_passes_the_guard():
    """The pass rewrites attention inside activation-checkpoint bodies (graph/bodies.py); the guard then sees
    a region there, not an SDPA left on local tokens, and lets the model through."""

    def checkpointed(x):
        return checkpoint(attend, x, use_reentrant=False)

    assert len(compile_cp(checkpointed, torch.randn(B, L, D, requires_grad=True)).plans) == 1


def test_attention_in_cond_branches_passes_the_guard():
    def clean(x, flag):
        return torch.cond(flag.sum() > 0, lambda x: attend(x), lambda x: 2 * attend(x), (x,))

    def constant_branch(x, flag):  # one branch returns no tokens at all: a token-wise constant
        return attend(x) + torch.cond(flag.sum() > 0, lambda x: x * 2, lambda x: torch.ones(B, L, D), (x,))

    assert len(compile_cp(clean, torch.randn(B, L, D), torch.ones(1)).plans) == 2
    compile_cp(constant_branch, torch.randn(B, L, D), torch.ones(1))


def test_cond_branches_are_looked_into(no_comm):
    def mixing(x, flag):
        return attend(x) + torch.cond(flag.sum() > 0, body_cumsum, body_token_wise, (x,))

    msg = refusal(mixing, torch.randn(B, L, D), torch.ones(1))
    assert f"node 'cumsum' at {__file__}" in msg and "in body_cumsum" in msg, msg


def test_cond_branches_that_place_the_sequence_differently_are_refused(no_comm):
    """One branch keeps the tokens on dim 1, the other moves them to dim 2 (L == D): after the cond nobody can
    tell where they are, so what follows cannot be checked."""

    def diverging(x, flag):
        y = torch.cond(flag.sum() > 0, lambda x: x * 2, lambda x: x.transpose(1, 2).contiguous(), (x,))
        return attend(x) + y

    assert L == D
    msg = refusal(diverging, torch.randn(B, L, D), torch.ones(1))
    assert "higher-order op cond" in msg and "two branches place the sequence dim differently" in msg, msg


@torch.library.custom_op("cpcompile_test::fused_scale", mutates_args=())
def fused_scale(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@fused_scale.register_fake
def _(x):
    return torch.empty_like(x)


def custom_op_model(x):
    return attend(fused_scale(x))


def test_op_without_rule_is_refused_until_marked(no_comm):
    msg = refusal(custom_op_model, torch.randn(B, L, D))
    assert "cpcompile_test.fused_scale.default" in msg and "cannot tell whether it mixes tokens" in msg, msg
    assert "cpcompile.mark_token_local" in msg, msg


def test_marked_op_compiles():
    cpcompile.mark_token_local(fused_scale)
    compile_cp(custom_op_model, torch.randn(B, L, D))


def test_op_packet_mark():
    cpcompile.mark_token_local(torch.ops.cpcompile_test.fused_scale)
    compile_cp(custom_op_model, torch.randn(B, L, D))


def running_max(x):
    """Refused as a scan over tokens; marking it is the user's promise (here a false one, for the test)."""
    return torch.cummax(x, dim=1).values


def model_with_marked_function(x):
    return attend(running_max(x) + x)


class Smoother(nn.Module):
    def forward(self, x):
        return x.cumsum(dim=1) / 2


smoother = Smoother()


def model_with_marked_module(x):
    return attend(smoother(x))


def test_function_and_module_marks():
    with pytest.raises(Exception) as excinfo:
        compile_cp(model_with_marked_function, torch.randn(B, L, D))
    assert "aten.cummax" in str(_cp_error(excinfo))
    assert cpcompile.mark_token_local(running_max) is running_max
    compile_cp(model_with_marked_function, torch.randn(B, L, D))
    cpcompile.mark_token_local(Smoother)
    compile_cp(model_with_marked_module, torch.randn(B, L, D))


class Residual(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return x + self.inner(x)


class CausalConv(nn.Module):
    def forward(self, x):
        return F.pad(x, (0, 0, 1, 0))[:, :-1] + x


def test_an_instance_mark_covers_that_instance_only(no_comm):
    """mark_token_local(one Residual) must not exempt another Residual around a causal conv."""
    linear, conv = Residual(nn.Linear(D, D)), Residual(CausalConv())
    cpcompile.mark_token_local(linear)
    compile_cp(lambda x: attend(linear(x)), torch.randn(B, L, D))
    msg = refusal(lambda x: attend(conv(linear(x))), torch.randn(B, L, D))
    assert "in forward" in msg and "aten.constant_pad_nd" in msg, msg


def test_marked_code_hands_the_sequence_on():
    """Downstream of marked code the sequence dim is still tracked: mixing after it is refused."""
    cpcompile.mark_token_local(running_max)

    def mixes_after(x):
        return attend(running_max(x)).cumsum(dim=1)

    msg = refusal(mixes_after, torch.randn(B, L, D))
    assert "node 'cumsum'" in msg, msg


def test_mark_rejects_what_it_cannot_mark():
    with pytest.raises(TypeError):
        cpcompile.mark_token_local(42)


def test_no_process_group_no_check():
    """Without a CP group nothing is sharded: a hand-written attention compiles as before."""
    torch._dynamo.reset()
    out = torch.compile(hand_written, backend=cpcompile.backend(inner="eager"), fullgraph=True)(torch.randn(B, L, D))
    assert out.shape == (B, L, D)


def test_clearing_marks_keeps_the_integrations_marks(monkeypatch):
    """A user's clear_token_local_marks must not make a registered integration (HF's mask helper, torchtitan's
    RoPE lookup) refuse its own library's code: that once broke HF models for every test after a clear."""
    from cpcompile import token_local

    monkeypatch.setattr(token_local, "_BUILTIN", [])

    def library_helper(x):
        return x

    def user_fn(x):
        return x

    token_local.mark_builtin_token_local(library_helper)
    cpcompile.mark_token_local(user_fn)
    clear_token_local_marks()
    key = lambda f: (f.__code__.co_filename, f.__code__.co_name)  # noqa: E731
    assert key(library_helper) in token_local._CODE and key(user_fn) not in token_local._CODE
