"""The eager-attention guard: attention that Dynamo runs eagerly inside a call of a cpcompile-compiled function
raises CPCompileError (it would attend to local tokens); attention outside such a call runs as usual."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.varlen import varlen_attn

import cpcompile
from tests.support.fake_pg import fake_group

EAGER = r"ran eagerly \(outside a rewritten CP region\)"


def _attn(q):
    return F.scaled_dot_product_attention(q, q, q, is_causal=True)


@torch.compiler.disable
def _disabled_attn(q):
    return _attn(q)


def _calls_disabled(q):
    return _disabled_attn(q) + 1


def _model(q):
    return _attn(q) + 1


def _refused(q):
    return F.scaled_dot_product_attention(q, q, q, dropout_p=0.5) + 1  # the planner refuses dropout


def _q(s=8):
    return torch.randn(1, 2, s, 4)


@pytest.fixture
def backend():
    with fake_group(0, 2):
        torch._dynamo.reset()
        yield cpcompile.backend(strategy="flat", inner="eager")
        torch._dynamo.reset()


def test_compiler_disable(backend):
    with pytest.raises(cpcompile.CPCompileError, match=EAGER):
        torch.compile(_calls_disabled, backend=backend)(_q())


def test_recompile_limit(backend):
    compiled = torch.compile(_model, backend=backend)
    with torch._dynamo.config.patch(recompile_limit=1, automatic_dynamic_shapes=False):
        compiled(_q(8))  # compiled and rewritten
        with pytest.raises(cpcompile.CPCompileError, match=EAGER):
            compiled(_q(16))  # past the limit: Dynamo runs the frame eagerly
    assert len(backend.plans) == 1


def test_suppress_errors(backend):
    """The planner's own CPCompileError, swallowed by suppress_errors, does not turn into eager attention."""
    with torch._dynamo.config.patch(suppress_errors=True):
        with pytest.raises(cpcompile.CPCompileError, match=EAGER):
            torch.compile(_refused, backend=backend)(_q())


def test_force_eager_stance(backend):
    compiled = torch.compile(_model, backend=backend)
    with torch.compiler.set_stance("force_eager"):
        with pytest.raises(cpcompile.CPCompileError, match=EAGER):
            compiled(_q())


def test_graph_break_before_attention_is_compiled(backend):
    """A graph break before attention: Dynamo compiles the attention in the resumed graph (rewritten), so
    nothing runs eagerly and nothing is refused."""

    def broken(q):
        torch._dynamo.graph_break()
        return _attn(q) + 1

    out = torch.compile(broken, backend=backend)(_q())
    assert out.shape == (1, 2, 8, 4) and len(backend.plans) == 1


def test_varlen_attn(backend):
    @torch.compiler.disable
    def disabled(q, cu):
        return varlen_attn(q, q, q, cu, cu, 8, 8)

    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(cpcompile.CPCompileError, match="varlen_attn ran eagerly"):
        torch.compile(lambda q, cu: disabled(q, cu) + 1, backend=backend)(torch.randn(8, 2, 4), cu)


def test_attention_outside_compiled_calls_runs(backend):
    """Not inside a compiled call: a reference model, evaluation, anything else is untouched."""
    torch.compile(_model, backend=backend)(_q())  # the guard is live
    q = _q()
    assert torch.equal(
        F.scaled_dot_product_attention(q, q, q, is_causal=True),
        torch._C._nn.scaled_dot_product_attention(q, q, q, is_causal=True),
    )
    other = torch.compile(_calls_disabled, backend="eager")  # another backend: not cpcompile's business
    assert other(q).shape == q.shape
