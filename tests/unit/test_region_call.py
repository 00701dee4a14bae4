"""The region call's schema (each family's `call`, families/<family>/call.py) is every comm's region signature:
each region of a family takes exactly the schema's fields as its positional parameters, in order, so a reader of
a rewritten region node that takes them by name (read_call) reads what the region reads."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from cpcompile.comms.registry import COMMS
from cpcompile.families.registry import FAMILIES
from cpcompile.families.sdpa.call import DenseCall
from cpcompile.families.varlen.call import VarlenCall
from cpcompile.graph.region_call import read_call

ROOT = Path(__file__).resolve().parents[2] / "cpcompile"
POSITIONAL = re.compile(r"\.args\[([3-9]|[0-9]+ ?[:+])|MIXERS\[node\.args")
"""A call's arguments read by position (a slice, an offset, an index past q/k/v, a mixer's key)."""
READERS = ("graph/region_call.py", "mixers/declare.py")
"""Where calls are read: by a family's schema, an op's torch schema, mixer_call's own split."""


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


def test_calls_are_read_by_name():
    """Region calls, the ops the families match, flex's mask marker and token mixers' calls are read by name
    through their readers (graph/region_call, mixers/declare.read_mixer_call), never by position elsewhere."""
    found = [
        f"{path.relative_to(ROOT).as_posix()}:{n}: {line.strip()}"
        for path in ROOT.rglob("*.py")
        if path.relative_to(ROOT).as_posix() not in READERS
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if POSITIONAL.search(line)
    ]
    assert not found, found
