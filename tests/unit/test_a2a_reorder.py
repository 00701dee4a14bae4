"""comms/a2a/reorder.permute_rows: a permutation's gather whose backward is the inverse gather.

A wrong inverse (or one applied the wrong way round) moves each row's gradient to another row: the gradient
comparison against index_select's own backward catches it; the traced backward must hold no scatter-add
(the atomic index_add it replaces)."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from cpcompile.comms.a2a.reorder import permute_rows


def _perm(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    index = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    inverse = torch.empty_like(index).scatter_(0, index, torch.arange(n))
    return index, inverse


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_forward_and_gradient_equal_index_select(dim, seed):
    gen = torch.Generator().manual_seed(10 + seed)
    shape = (12, 5, 3) if dim == 0 else (4, 12, 3)
    index, inverse = _perm(12, seed)
    x = torch.randn(shape, generator=gen, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(shape, generator=gen, dtype=torch.float64)
    ours = permute_rows(x, index, inverse, dim)
    (g_ours,) = torch.autograd.grad(ours, x, grad)
    ref = x.index_select(dim, index)
    (g_ref,) = torch.autograd.grad(ref, x, grad)
    assert torch.equal(ours, ref)
    assert torch.equal(g_ours, g_ref)
    assert torch.autograd.gradcheck(lambda t: permute_rows(t, index, inverse, dim), (x,))


def test_backward_is_a_gather_not_a_scatter_add():
    index, inverse = _perm(16, 3)

    def grads(x, g):
        return torch.autograd.grad(permute_rows(x, index, inverse), x, g)

    x = torch.randn(16, 4, requires_grad=True)
    graph = make_fx(grads)(x, torch.randn(16, 4))
    targets = [str(n.target) for n in graph.graph.nodes if n.op == "call_function"]
    assert sum("index_select" in t for t in targets) == 2, targets  # forward and backward
    assert not any("index_add" in t or "scatter" in t or "index_put" in t for t in targets), targets
