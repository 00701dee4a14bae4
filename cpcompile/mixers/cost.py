"""The bytes a rank receives in one forward call of a planned mixer, under each comm it could use (explain()).

a2a: every token tensor (inputs and outputs) but the rank's own share of it, (cp-1)/cp of its bytes; a shared
input all-gathered, cp-1 times its bytes. state (flat only): a conv's halo, `context` tokens of each token input;
a linear recurrence's chunk transitions, cp-1 times (batch x heads x Dk x (Dv + Dk)) of the state's dtype.
"""

from __future__ import annotations

import math

import torch
from torch.utils import _pytree as pytree

from .plan import MixerPlan, example
from .plan_state import StatePlan


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def a2a_bytes(plan: MixerPlan | StatePlan) -> int:
    """The forward bytes a rank receives if the mixer ran head-parallel (a2a)."""
    node, spec, cp = plan.node, plan.spec, plan.group.size
    n = len(spec.weight_names)
    kwargs = {k: example(v) for k, v in node.kwargs.items()}
    shared = _tensors([kwargs.pop(k) for k in spec.shared_inputs if k in kwargs])
    tokens = _tensors(([example(a) for a in node.args[1 + n :]], kwargs)) + _tensors(example(node))
    return sum(_nbytes(t) * (cp - 1) // cp for t in tokens) + sum(_nbytes(t) * (cp - 1) for t in shared)


def state_bytes(plan: StatePlan) -> int:
    """The forward bytes a rank receives under state passing."""
    node, spec = plan.node, plan.spec
    if plan.context is not None:
        n = len(spec.weight_names)
        tokens = _tensors(([example(a) for a in node.args[1 + n :]], {k: example(v) for k, v in node.kwargs.items()}))
        return sum(_nbytes(t) // plan.local_len * plan.context for t in tokens)
    b, h, dk, dv = plan.state_shape
    item = torch.empty((), dtype=plan.state_dtype).element_size()
    return (plan.group.size - 1) * math.prod((b, h, dk, dv + dk)) * item


def describe(plan: MixerPlan | StatePlan) -> str:
    """One line: the mixer, its comm, and the bytes of both comms where it has both."""
    a2a = a2a_bytes(plan)
    if plan.comm == "a2a":
        return f"{plan.spec.name}: a2a, {a2a} bytes received a rank per forward call"
    return (
        f"{plan.spec.name}: state passing, {state_bytes(plan)} bytes received a rank per forward call "
        f"(a2a would receive {a2a})"
    )
