"""The bytes a rank receives in one forward call of a planned mixer, under each comm it could use (explain(), and
comm="auto"'s choice).

a2a: every token tensor (inputs and outputs) but the rank's own share of it, (cp-1)/cp of its bytes; a shared
input all-gathered, cp-1 times its bytes. state: a conv's halo, `context` tokens of each token input per tail a
rank receives (flat: one, from the previous rank; zigzag: two, one from each neighbour, at cp 2 one); a linear
recurrence's chunk transitions, (cp-1) x chunks a rank of them (batch x heads x Dk x (Dv + Dk) of the state's dtype):
zigzag receives twice flat's.

A layout per layer kind (zigzag attention, flat linear layers between relayouts) is priced with these bytes by
relayout_plan.py.
"""

from __future__ import annotations

import math

import torch
from torch.utils import _pytree as pytree

from ..layouts import get_layout
from .chain import tails_received
from .declare import read_mixer_call
from .plan import MixerPlan, example
from .plan_state import StatePlan


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def a2a_bytes(plan: MixerPlan | StatePlan) -> int:
    """The forward bytes a rank receives if the mixer ran head-parallel (a2a)."""
    call, cp = read_mixer_call(plan.node), plan.group.size
    kwargs = {k: example(v) for k, v in call.kwargs.items() if k != getattr(plan, "documents", None)}
    shared = _tensors([kwargs.pop(k) for k in call.spec.shared_inputs if k in kwargs])
    tokens = _tensors(([example(a) for a in call.args], kwargs)) + _tensors(example(plan.node))
    return sum(_nbytes(t) * (cp - 1) // cp for t in tokens) + sum(_nbytes(t) * (cp - 1) for t in shared)


def state_bytes(plan: StatePlan, layout: str | None = None) -> int:
    """The forward bytes a rank receives under state passing, on the plan's layout or on `layout`."""
    cp = plan.group.size
    lay = get_layout(layout or plan.layout)
    if plan.context is not None:
        call = read_mixer_call(plan.node)
        kwargs = {k: example(v) for k, v in call.kwargs.items() if k != plan.documents}  # offsets: not tokens
        tokens = _tensors(([example(a) for a in call.args], kwargs))
        tails = tails_received(lay, cp) if plan.context else 0
        return tails * sum(_nbytes(t) // plan.local_len * plan.context for t in tokens)
    b, h, dk, dv = plan.state_shape
    item = torch.empty((), dtype=plan.state_dtype).element_size()
    return (cp - 1) * lay.chunks_per_rank * math.prod((b, h, dk, dv + dk)) * item


def describe(plan: MixerPlan | StatePlan) -> str:
    """One line: the mixer, its comm, and the bytes of both comms where it has both (and of flat state passing
    under a layout with several chunks a rank)."""
    a2a = a2a_bytes(plan)
    if plan.comm == "a2a":
        return f"{plan.spec.name}: a2a, {a2a} bytes received a rank per forward call"
    if plan.documents is not None:  # packed documents: a2a does not reset at them (its plan refuses them)
        return (
            f"{plan.spec.name}: state passing, {state_bytes(plan)} bytes received a rank per forward call (packed "
            f"documents from {plan.documents}=; a2a cannot run them)"
        )
    flat = ""
    if get_layout(plan.layout).chunks_per_rank > 1:
        flat = f"; state passing on flat chunks would receive {state_bytes(plan, 'flat')}"
    return (
        f"{plan.spec.name}: state passing, {state_bytes(plan)} bytes received a rank per forward call "
        f"(a2a would receive {a2a}{flat})"
    )
