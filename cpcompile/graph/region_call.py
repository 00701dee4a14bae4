"""Reading a call's arguments by name, never by position: a region call back from a rewritten graph by the field
names of its family's schema (`read_call`), an op's call by its torch schema (`schema_bound`: the attention ops the
families match, the flex mask's marker op). A token mixer's call is read by mixers/declare.read_mixer_call.

Each attention family declares its region call once (families/<family>/call.py: DenseCall, VarlenCall, FlexCall, a
NamedTuple of the positional inputs every comm's region of that family takes, in order; `Family.call`). A plan
builds its region call as one of these (CPPlan.region_call); the rewrite passes it on as the call's positional
args, and whoever reads a rewritten region node takes them back by name (`read_call`), never by position
(tests/unit/test_region_call.py checks every comm's regions against their family's schema).
"""

from __future__ import annotations

from typing import NamedTuple, TypeVar

import torch.fx

Call = TypeVar("Call", bound=NamedTuple)


def read_call(schema: type[Call], node: torch.fx.Node) -> Call:
    """The region call of a rewritten region node (a call_function of a `schema` region), by name."""
    return schema._make(node.args[: len(schema._fields)])


def schema_bound(node: torch.fx.Node, schema: torch.FunctionSchema) -> dict:
    """A call's arguments by its schema's names, defaults filled in."""
    bound = {a.name: a.default_value if a.has_default_value() else None for a in schema.arguments}
    bound.update(zip((a.name for a in schema.arguments), node.args))
    bound.update(node.kwargs)
    return bound
