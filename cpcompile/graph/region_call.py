"""Reading a region call back from a rewritten graph: by the field names of its family's schema.

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
