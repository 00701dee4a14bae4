"""cpcompile.explain: what the pass would do with a model, before any collective runs.

    report = cpcompile.explain(model, input_ids, position_ids, strategy="zigzag", comm="auto", world=8)
    print(report)  # every attention site: shapes, layout, comm, kernel, blocks, bytes, FLOPs per rank; refusals

The example inputs are the GLOBAL batch; explain() cuts rank 0's part itself (explain/inputs.py: the rules of
shard_batch), traces the model once with Dynamo computing nothing (explain/trace.py), and runs the backend's
steps (passes.PASSES: find, plan, agree_ranks, rewrite, mixers, totals, guard) on the graphs, with a stand-in for the
other ranks (explain/ranks.py: every rank of the stand-in world plans each site in this process, and their plans
are compared as the store would) and no region run (so no collective). No process group is created, read or
changed: the plans are made for a stand-in CP group of `world` ranks (CPConfig.cp_group), so explain() works
with or without an initialised torch.distributed and leaves it as it found it. Costs come from cost/ (measured
H200 kernel rates, an assumed link bandwidth); packed sites are costed with the example batch's documents.
"""

from __future__ import annotations

import contextlib
import logging
import math

import torch

from .. import passes
from ..backend import check_choices, check_deferred_merge
from ..comms.registry import get_comm
from ..cost import estimate, wire_shape
from ..errors import CPCompileError, node_source
from ..families.plans import CPConfig, CPPlan
from ..families.registry import FAMILIES, get_family
from ..layouts import THD_LAYOUTS
from ..log import LOGGER_NAME
from ..mixers.relayout_plan import check_mixer_layout
from ..passes import PassState
from ..sharding.conventions import with_hf_labels, with_position_ids
from .inputs import local_inputs, model_offsets, packed_offsets, stand_in_group
from .ranks import Refused, StandInRanks
from .recommend import recommend
from .report import Recommendation, Refusal, Report, SiteReport
from .trace import capture_graphs

__all__ = ["Recommendation", "Refusal", "Report", "SiteReport", "explain"]


def _site_estimate(plan: CPPlan, cu: torch.Tensor | None):
    """The cost model's estimate of the planned site; None for a family without a cost shape (flex_attention: the
    BlockMask sets its work)."""
    cost_shape = get_family(plan.site.kind).cost_shape
    if cost_shape is None:
        return None
    return estimate(cost_shape(plan, plan.group.size), plan.layout, plan.comm, plan.kernel, cu)


def _batch_note(plan: CPPlan, cu: torch.Tensor | None) -> str | None:
    """The comm's note on what it moves for the example batch (Comm.batch_note: selective's slots), or None."""
    note = get_comm(plan.comm).batch_note
    cost_shape = get_family(plan.site.kind).cost_shape
    if note is None or cu is None or cost_shape is None:
        return None
    return note(wire_shape(cost_shape(plan, plan.group.size), plan.layout, plan.comm), cu)


def _site_report(graph: int, plan: CPPlan, cu: torch.Tensor | None) -> SiteReport:
    site = plan.site
    return SiteReport(
        graph=graph,
        node=site.node.name,
        source=node_source(site.node),
        kind=site.kind,
        q_shape=tuple(site.q_shape),
        k_shape=tuple(site.k_shape),
        v_shape=tuple(site.v_shape),
        layout=plan.layout,
        comm=plan.comm,
        kernel=plan.kernel,
        causal=plan.causal,
        window=getattr(plan, "window", None),
        estimate=_site_estimate(plan, cu),
        choice=getattr(plan, "choice", None),
        deferred_bytes=_deferred_bytes(plan),
    )


def _deferred_bytes(plan: CPPlan) -> tuple[int, int] | None:
    """What backend(deferred_merge=True) holds beyond the running merge at this site (comm/entry.Region)."""
    if not getattr(plan, "deferred_merge", False):
        return None
    memory = get_comm(plan.comm).regions[plan.site.kind].deferred_bytes
    return None if memory is None else memory(plan)


STEP_NAMES = {"find": "traced refusal", "mixers": "token mixer", "guard": "token guard"}
"""How a refusal raised by a pass step is labelled in the report (other steps: their name)."""


def _plan_graph(report: Report, graph: int, gm, configs: list[CPConfig], cu, device) -> list:
    """The pass's steps (passes.PASSES) over one graph, as rank 0 of the stand-in world whose other ranks plan
    every site too (explain/ranks.py): refusals recorded, stopping at the first step that refuses."""
    ranks = StandInRanks(configs)
    state = PassState(configs[0], ranks=ranks, device=None if device is None else torch.device(device), compute=False)
    refusal, refused_sites = None, False
    with _warnings() as said:
        for step in passes.PASSES:
            try:
                step(gm, state)
            except Refused:
                refused_sites = True
                break
            except CPCompileError as e:
                refusal = Refusal(STEP_NAMES.get(step.__name__, step.__name__), str(e))
                break
    report.refusals += ranks.ordered()
    for plan in state.plans:
        report.sites.append(_site_report(graph, plan, cu))
        if (note := _batch_note(plan, cu)) is not None:
            report.notes.append(f"site {len(report.sites) - 1}: {note}")
    if refused_sites:
        report.notes.append(
            f"graph {graph}: the token guard did not run (it checks the rewritten graph): fix the refusals first"
        )
        return state.sites
    heads = [m for m in state.mixers if m.comm == "a2a"]
    if heads:
        names = ", ".join(sorted({m.spec.name for m in heads}))
        report.notes.append(f"graph {graph}: {len(heads)} token mixer call(s) run head-parallel over a2a ({names})")
    report.notes += [f"graph {graph}: {line}" for line in dict.fromkeys(m.note for m in state.mixers)]
    if refusal is not None:
        report.refusals.append(refusal)
    report.notes += [f"graph {graph}: {message}" for message in dict.fromkeys(said)]
    return state.sites


@contextlib.contextmanager
def _warnings():
    """The "cpcompile" logger's warnings while the block runs (the pass's, e.g. the token guard's: graph not
    checked, guard off)."""
    said: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: said.append(record.getMessage())
    logger = logging.getLogger(LOGGER_NAME)
    logger.addHandler(handler)
    try:
        yield said
    finally:
        logger.removeHandler(handler)


def _world(world) -> tuple[int, tuple[int, int] | None]:
    """(CP ranks, (inter, intra) of a 2-D CP mesh or None) of explain's `world`, or a CPCompileError."""
    sizes = world if isinstance(world, tuple) and len(world) == 2 else (world,)
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in sizes) or math.prod(sizes) < 2:
        raise CPCompileError(
            f"explain(world={world!r}): CP needs at least 2 ranks. Fix: pass world=2 or more, or world=(inter, "
            "intra) for a 2-D CP mesh."
        )
    return math.prod(sizes), (sizes if len(sizes) == 2 else None)


def explain(
    model,
    *example_args,
    strategy: str = "flat",
    comm: str = "all_gather",
    kernel: str = "auto",
    world: int | tuple[int, int] = 2,
    seq_dim: int | None = None,
    cu_seqlens: torch.Tensor | None = None,
    seq_keys=(),
    passthrough_keys=(),
    device: str | torch.device | None = None,
    hf_loss: str | None = None,
    ignore_index: int = -100,
    mixer_layout: str = "same",
    deferred_merge: bool = False,
    **example_kwargs,
) -> Report:
    """What cpcompile.backend(strategy=strategy, comm=comm, kernel=kernel) would do with `model` on `world` CP
    ranks, for the GLOBAL example batch `model(*example_args, **example_kwargs)`: a Report (str(): a table).
    world=(inter, intra): a 2-D CP mesh ("cp_inter", "cp_intra") of inter * intra ranks (comm="hierarchical").

    seq_dim: the sequence dim of the example tensors (default 1; packed strategies 0); cu_seqlens: the global
    document offsets the model takes (packed strategies; the same tensor, or the `cu_seqlens` keyword);
    seq_keys / passthrough_keys: keyword tensors to cut like the tokens / keep whole (as in shard_batch);
    device: plan the kernels for this device instead of the example tensors' (meta tensors: "cpu", or "cuda" in a
    process where CUDA is available, since the kernels' availability checks run here); hf_loss: as in shard_batch
    ("causal_lm": the example's `labels=` become the globally shifted `shift_labels`, `num_items_in_batch` and
    the global `position_ids` (when absent) are added: the batch a Hugging Face model gets under CP); mixer_layout:
    as in backend() (token mixers on flat chunks between relayouts); deferred_merge: as in backend() (the report
    says the memory it holds).
    Unknown names and a world below 2 raise CPCompileError; everything the pass would refuse is a refusal.
    """
    check_choices(strategy, comm, kernel)
    check_mixer_layout(mixer_layout, strategy)
    check_deferred_merge(comm, deferred_merge)
    report = Report(strategy=strategy, comm=comm, kernel=kernel, world=world)
    world, levels = _world(world)
    configs = [
        CPConfig(
            strategy,
            comm,
            kernel,
            cp_group=stand_in_group(r, world, levels),
            mixer_layout=mixer_layout,
            deferred_merge=deferred_merge,
        )
        for r in range(world)
    ]
    try:
        if hf_loss is not None:  # the batch a Hugging Face model gets from shard_batch(..., hf_loss=)
            dim = (0 if strategy in THD_LAYOUTS else 1) if seq_dim is None else seq_dim
            example_kwargs = with_position_ids(dict(example_kwargs), dim, None)  # when the batch has none
            example_kwargs = with_hf_labels(example_kwargs, dim, hf_loss, ignore_index)
        given = packed_offsets(strategy, cu_seqlens, example_kwargs)
        cu = model_offsets(strategy, given, world)  # thd_balanced: this batch's plan
        args, kwargs = local_inputs(
            example_args, example_kwargs, strategy=strategy, rank=0, world=world, seq_dim=seq_dim,
            cu_seqlens=given, seq_keys=seq_keys, passthrough_keys=passthrough_keys, model_cu=cu,
        )  # fmt: skip
    except CPCompileError as e:
        report.refusals.append(Refusal("example inputs", str(e)))
        return report
    graphs, error = capture_graphs(model, args, kwargs, configs[0])
    if error is not None:
        report.refusals.append(Refusal("eager attention", str(error)))
    report.graphs = len(graphs)
    sites = [s for g, gm in enumerate(graphs) for s in _plan_graph(report, g, gm, configs, cu, device)]
    report.device = next((s.device.type for s in sites), "")
    if device is None and any(s.device.type == "meta" for s in sites):
        report.notes.append("the example tensors are on the meta device: pass device='cuda' (or 'cpu') to plan kernels")
    kinds = {s.kind for s in sites}
    present = [f for f in FAMILIES.values() if f.name in kinds]
    report.notes += [f.uncosted_note for f in present if f.cost_shape is None and f.uncosted_note]
    costed = [f for f in present if f.cost_shape is not None]
    if len(costed) > 1:
        names = " and ".join(f.title for f in costed)
        report.notes.append(f"the model has {names} sites; the recommendation covers the {costed[0].title} ones")
    chosen = [s for s in sites if costed and s.kind == costed[0].name]
    offsets = cu if cu is None or cu is given else THD_LAYOUTS[strategy].offsets(cu, world)
    report.recommendation = recommend(chosen, configs[0], offsets) if chosen else None
    if not graphs:
        report.notes.append("Dynamo captured no graph of this call (nothing was compiled, so nothing is rewritten)")
    elif not sites:
        report.notes.append(
            "no scaled_dot_product_attention, varlen_attn or flex_attention call was found in the traced graphs"
        )
    return report
