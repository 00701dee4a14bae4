"""The region call's schema (each family's `call`, families/<family>/call.py) is every comm's region signature:
each region of a family takes exactly the schema's fields as its positional parameters, in order, so a reader of
a rewritten region node that takes them by name (read_call) reads what the region reads."""

from __future__ import annotations

import inspect

import pytest

from cpcompile.comms.registry import COMMS
from cpcompile.families.registry import FAMILIES
from cpcompile.families.sdpa.call import DenseCall
from cpcompile.families.varlen.call import VarlenCall
from cpcompile.graph.region_call import read_call


def _positional(fn) -> list[str]:
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in inspect.signature(fn).parameters.values() if p.kind in kinds]


@pytest.mark.parametrize("comm", list(COMMS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_region_takes_its_schema(comm, family):
    region = COMMS[comm].regions.get(family)
    if region is None:
        pytest.skip(f"{comm} has no {family} region")
    assert _positional(region.attention) == list(FAMILIES[family].call._fields)


def test_every_region_serves_a_registered_family():
    """A comm's region under a name no family has would never be called: the registries must agree."""
    for name, comm in COMMS.items():
        assert set(comm.regions) <= set(FAMILIES), (name, set(comm.regions) - set(FAMILIES))


def test_read_call_names_the_args():
    class Node:  # a region node's positional args, then its kwargs elsewhere
        args = ("q", "k", "v", "cu", "ignored")

    assert read_call(VarlenCall, Node()).cu_seqlens == "cu"
    assert read_call(DenseCall, Node()) == DenseCall("q", "k", "v")
