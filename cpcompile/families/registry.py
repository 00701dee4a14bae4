"""The attention families, in one place: a family is one package (families/<name>/) and one entry here.

find asks every family's matcher, plan hands a site to its family's planner, the rewrite inserts its family's
run-time checks, and the token guard, the cost model, explain() and the backend read the family's rules from its
entry; a comm serves a family by naming a region for it (comm/entry.Comm.regions, keyed by the family's name).
"""

from __future__ import annotations

from ..errors import CPCompileError
from .family import Family
from .flex.family import FLEX
from .sdpa.family import SDPA
from .varlen.family import VARLEN

FAMILIES: dict[str, Family] = {family.name: family for family in (SDPA, VARLEN, FLEX)}


def get_family(name: str) -> Family:
    """The registry entry of the family `name` (an AttentionSite's kind), or a CPCompileError listing them."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise CPCompileError(f"unknown attention family {name!r}. Fix: register it in {list(FAMILIES)}.") from None
