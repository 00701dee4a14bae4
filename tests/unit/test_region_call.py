"""The region call's schema (graph/region_call.py) is every comm's region signature: each region of a family
takes exactly the schema's fields as its positional parameters, in order, so a reader of a rewritten region node
that takes them by name (read_call) reads what the region reads."""

from __future__ import annotations

import inspect

import pytest

from cpcompile.comm.registry import COMMS
from cpcompile.graph.region_call import DenseCall, FlexCall, VarlenCall, read_call

FAMILIES = {"region": DenseCall, "varlen_region": VarlenCall, "flex_region": FlexCall}


def _positional(fn) -> list[str]:
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in inspect.signature(fn).parameters.values() if p.kind in kinds]


@pytest.mark.parametrize("comm", list(COMMS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_region_takes_its_schema(comm, family):
    region = getattr(COMMS[comm], family)
    if region is None:
        pytest.skip(f"{comm} has no {family}")
    assert _positional(region) == list(FAMILIES[family]._fields)


def test_read_call_names_the_args():
    class Node:  # a region node's positional args, then its kwargs elsewhere
        args = ("q", "k", "v", "cu", "ignored")

    assert read_call(VarlenCall, Node()).cu_seqlens == "cu"
    assert read_call(DenseCall, Node()) == DenseCall("q", "k", "v")
