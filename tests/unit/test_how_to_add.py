"""The steps of docs/architecture.md's "How to add a comm / a family": a toy attention family (causal linear
attention, a custom op) and a toy comm that serves it, each added by ONE registry entry (families.registry.FAMILIES,
comms.registry.COMMS) and nothing else, then found, planned, rewritten, guarded, costed and run on CPU.

If some step switched on the family's or the comm's name instead of reading the registries (a planner picked by
`site.kind` with a fallback, an `isinstance` on a plan type, a comm's region read from a per-family field), the
toy site would reach the wrong code and a check below fails."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
import torch.fx

import cpcompile
from cpcompile.comm.collectives import all_gather_dim0
from cpcompile.comm.entry import Comm, Region
from cpcompile.comms.registry import COMMS
from cpcompile.cost import SiteShape
from cpcompile.cost.work import CallWork
from cpcompile.families.cost_shape import site_shape
from cpcompile.families.family import Family
from cpcompile.families.plans import CPConfig, CPPlan
from cpcompile.families.registry import FAMILIES
from cpcompile.families.site import AttentionSite, traced_tensor
from cpcompile.mesh import CPGroup
from tests.support.fake_pg import fake_group

ROOT = Path(__file__).resolve().parents[2] / "cpcompile"


@torch.library.custom_op("cpcompile_toy::linear_attention", mutates_args=())
def linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal linear attention over dim 2 of (B, H, L, D): out_t = q_t . sum_{s <= t} k_s^T v_s."""
    state = torch.einsum("bhld,bhle->bhlde", k, v).cumsum(2)
    return torch.einsum("bhld,bhlde->bhle", q, state)


@linear_attention.register_fake
def _(q, k, v):
    return q.new_empty(*q.shape[:-1], v.shape[-1])


TOY_TARGETS = (torch.ops.cpcompile_toy.linear_attention.default, torch.ops.cpcompile_toy.linear_attention)


# step 1 of "a family": its region call's schema, its matcher, its plan type, its planner, its entry


class ToyCall(NamedTuple):
    q: Any
    k: Any
    v: Any


def match_toy(node: torch.fx.Node, body=None) -> AttentionSite | None:
    if node.op != "call_function" or node.target not in TOY_TARGETS:
        return None
    q, k, v = node.args[:3]
    qv, kv, vv = (traced_tensor(t) for t in (q, k, v))
    return AttentionSite(
        node=node, kind="toy", query=q, key=k, value=v, attn_mask=None, dropout_p=0.0, is_causal=True, scale=None,
        enable_gqa=False, q_shape=tuple(qv.shape), k_shape=tuple(kv.shape), v_shape=tuple(vv.shape), dtype=qv.dtype,
        device=qv.device, body=body,
    )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class ToyPlan(CPPlan):
    def region_call(self) -> ToyCall:
        return ToyCall(self.site.query, self.site.key, self.site.value)

    def region_kwargs(self) -> dict:
        return dict(group_name=self.group.name, rank=self.group.rank, world=self.group.size)

    def block_count(self) -> int:
        return 1


def plan_toy(site: AttentionSite, config: CPConfig, group: CPGroup) -> ToyPlan:
    comm = COMMS[config.comm]
    if not comm.serves("toy"):
        raise cpcompile.CPCompileError(f"comm={config.comm!r} has no toy region")
    return ToyPlan(site, layout="flat", comm=config.comm, kernel="none", causal=True, scale=1.0, group=group)


class ToyCosting:
    """How the cost model counts a toy site (cost/shape.Costing): no documents, the comm's toy region's blocks as
    (q rows, keys) pairs, one kernel call each."""

    family = "toy"
    kernels = "dense"

    def documents(self, shape, layout, cu_seqlens):
        return None, ""

    def wire(self, shape, layout, lse_on_demand):
        return shape.wire_shape()

    def rank_work(self, shape, layout, region, rank, documents, **levels):
        blocks = region.rank_blocks(rank, shape.world, shape.tokens)
        work = CallWork(pairs=sum(q * k for q, k in blocks) * shape.batch, calls=len(blocks))
        return len(blocks), work


def toy_cost_shape(plan: ToyPlan, world: int) -> SiteShape:
    return site_shape(plan.site, ToyCosting(), True, world, 2)


TOY_FAMILY = Family(
    name="toy",
    title="linear attention",
    match=match_toy,
    plan=plan_toy,
    call=ToyCall,
    seq_dim=2,
    out_seq_dims=(2,),
    cost_shape=toy_cost_shape,
    recommend_layouts=lambda: ("flat",),
    overlaps=False,
)


# step 1 of "a comm": its region for each family it serves (here one), its wire bytes, its entry


def toy_gather_region(q, k, v, *, group_name: str, rank: int, world: int) -> torch.Tensor:
    """flat layout: gather every rank's K/V (rank-major = global order), attend this rank's q rows causally."""
    if world > 1:  # (B, H, L, D) -> tokens first for the dim-0 gather, and back
        k, v = (all_gather_dim0(t.movedim(2, 0), group_name).movedim(0, 2) for t in (k, v))
    local = q.shape[2]
    pad = q.new_zeros(*q.shape[:2], local * rank, q.shape[-1])
    return linear_attention(torch.cat((pad, q), 2), k[:, :, : local * (rank + 1)], v[:, :, : local * (rank + 1)])[
        :, :, local * rank :
    ]


def toy_rank_blocks(rank: int, world: int, local_len: int) -> list[tuple[int, int]]:
    """(q rows, keys) of each block rank `rank` runs: its rows against every key up to its last."""
    return [(local_len, local_len * (rank + 1))]


TOY_COMM = Comm(
    name="toy_gather",
    regions={"toy": Region(toy_gather_region, toy_rank_blocks)},
    wire_bytes=lambda shape: (0, 0),
    auto_option=False,
)


@pytest.fixture
def registered(monkeypatch):
    """The only change a new family and a new comm make: one entry in each registry."""
    monkeypatch.setitem(FAMILIES, TOY_FAMILY.name, TOY_FAMILY)
    monkeypatch.setitem(COMMS, TOY_COMM.name, TOY_COMM)


class ToyModel(torch.nn.Module):
    def __init__(self, heads: int = 2, dim: int = 4):
        super().__init__()
        self.heads, self.dim = heads, dim
        self.qkv = torch.nn.Linear(heads * dim, 3 * heads * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, length, _ = x.shape
        q, k, v = self.qkv(x).view(b, length, 3, self.heads, self.dim).permute(2, 0, 3, 1, 4)
        return linear_attention(q, k, v).transpose(1, 2).reshape(b, length, -1)


def test_toy_family_and_comm_run_through_every_step(registered):
    """cpcompile.backend on a CP group of one rank (the fake backend): found, planned, rewritten into the toy
    comm's region, run; the same numbers as the model without CP."""
    torch.manual_seed(0)
    model, x = ToyModel(), torch.randn(2, 8, 8)
    with fake_group(0, 1) as group:
        be = cpcompile.backend(strategy="flat", comm="toy_gather", group=group, inner="eager")
        out = torch.compile(model, backend=be, fullgraph=True)(x)
    torch.testing.assert_close(out, model(x))
    assert [(type(p), p.site.kind, p.comm) for p in be.plans] == [(ToyPlan, "toy", "toy_gather")]


def test_toy_family_is_planned_guarded_and_costed_by_explain(registered):
    """explain() at world 2 runs passes.PASSES: the other rank plans and agrees, the token guard checks the
    rewritten graph with the toy family's rule (seq_dim, out_seq_dims), and the cost model counts the toy site
    through the toy family's own costing (rank 1's rows read twice rank 0's keys) and recommends its layout."""
    report = cpcompile.explain(ToyModel(), torch.randn(2, 8, 8), strategy="flat", comm="toy_gather", world=2)
    assert not report.refusals, report.refusals
    assert [(s.kind, s.comm) for s in report.sites] == [("toy", "toy_gather")]
    estimate = report.sites[0].estimate
    assert estimate.blocks == (1, 1) and estimate.flops[1] == 2 * estimate.flops[0] > 0
    assert report.recommendation.layout == "flat"


def test_a_comm_without_the_family_is_refused_by_the_family_planner(registered):
    with fake_group(0, 1) as group:
        be = cpcompile.backend(strategy="flat", comm="all_gather", group=group, inner="eager")
        with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="has no toy region"):
            torch.compile(ToyModel(), backend=be, fullgraph=True)(torch.randn(1, 4, 8))


def test_every_comm_is_one_package():
    """Each comm of the registry is built by its own package's entry (comms/<name>/entry.py) and its regions live
    there: a comm is one package plus one registry line."""
    import importlib

    for name, comm in COMMS.items():
        entry = importlib.import_module(f"cpcompile.comms.{name}.entry")
        assert comm in vars(entry).values(), name
        for family, region in comm.regions.items():
            assert region.attention.__module__.startswith(f"cpcompile.comms.{name}."), (name, family)


SWITCHES = ("VarlenPlan", "FlexPlan", "varlen_region", "flex_region", "varlen_rank_blocks")


def _names_a_family(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value in FAMILIES


def test_nothing_outside_a_family_switches_on_its_name():
    """`site.kind == "..."` (or any `.kind` compared with a family's name: the cost model's dense / packed branch),
    a dict keyed by family names, an isinstance on a family's plan type or a comm field per family, outside
    families/: each is a second place a new family would have to be added."""
    found = []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("families/"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and isinstance(node.left, ast.Attribute) and node.left.attr == "kind":
                if isinstance(node.left.value, ast.Attribute) and node.left.value.attr == "site":
                    found.append(f"{rel}:{node.lineno}: site.kind compared")
                elif any(_names_a_family(c) for c in node.comparators):
                    found.append(f"{rel}:{node.lineno}: .kind compared with a family's name")
            if isinstance(node, ast.Name) and node.id in SWITCHES:
                found.append(f"{rel}:{node.lineno}: {node.id}")
            if isinstance(node, ast.Attribute) and node.attr in SWITCHES:
                found.append(f"{rel}:{node.lineno}: .{node.attr}")
    assert not found, found


SHARED_FROM_COMMS = {"comms.a2a.head_parallel"}
"""The one comm module others build on: the token mixers' region is a2a's head_parallel (docs/architecture.md)."""


def test_nothing_outside_comms_reaches_into_a_comm_package():
    """Outside comms/, a comm is read through its registry entry (comms/registry.py), never by importing its package:
    what a comm adds (its notes for explain() too: Comm.batch_note) travels on the entry."""
    found = []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("comms/"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("comms."):
                package = node.module.split(".")[1]
                if package in COMMS and node.module not in SHARED_FROM_COMMS:
                    found.append(f"{rel}:{node.lineno}: {node.module}")
    assert not found, found
