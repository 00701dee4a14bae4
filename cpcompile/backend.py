"""cpcompile.backend(...): a torch.compile backend that rewrites attention into CP regions, then compiles."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.fx

from . import compat, eager_guard, passes
from .comms.registry import COMMS, comms_that
from .errors import CPCompileError
from .families.registry import get_family
from .inductor_cache import cache_key_patches
from .inner import INNER, inner_compiler
from .kernels import KERNEL_NAMES
from .layouts import STRATEGIES
from .mesh import check_mesh_or_group
from .mixers.relayout_plan import check_mixer_layout
from .passes import CPConfig, CPPlan
from .token_marks import OUTPUTS_META, marking_outputs

INDUCTOR_OVERLAP_PATCHES = {"reorder_for_peak_memory": False}
"""Inductor's peak-memory reordering (on by default) sinks a collective down to its wait when that delays
allocating its output: the ring's shift and the all-gather then run with nothing between issue and wait, no
overlap (seen on a plain SDPA layer: bench/probes/ring_trace.py, tests/graphs/test_ring.py). Graphs holding
those regions (comms whose capabilities say `overlaps`; not flex_attention's, which overlaps nothing) are
compiled in program order, which already issues each collective before the blocks it overlaps and keeps at most
two K/V chunks in flight; Inductor's other passes stay on."""

compat.install()  # at import: Dynamo traces the model (DTensor SDPA on CPU, MLA varlen) before any backend is called


@dataclass
class CPBackend:
    """The backend object torch.compile calls once per captured graph.

    `plans` lists every site rewritten so far (one CPPlan each: layout, comm, kernel, causal, scale, group and
    the site itself), across all graphs this backend compiled; the "cpcompile" logger reports the same. `graphs`
    counts those graphs: a recompile (Dynamo traces the model again when a value it specialised on changes) is one
    more graph, whose sites are planned and listed again.
    """

    is_cpcompile_backend = True
    """What the eager guard looks for in Dynamo's wrapper chain (eager_guard.py cannot import this module)."""

    config: CPConfig
    inner: str | Callable = "inductor"
    plans: list[CPPlan] = field(default_factory=list)
    graphs: int = 0

    def __post_init__(self) -> None:
        eager_guard.install()  # attention that Dynamo runs eagerly inside a compiled call raises (eager_guard.py)

    @property
    def mesh(self):
        return self.config.mesh

    @property
    def group(self) -> dist.ProcessGroup | None:
        return self.config.group

    def transform(self, gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
        """Run the pass alone (passes.run: the steps of passes.PASSES): every site is planned before any is
        rewritten."""
        self.plans.extend(passes.run(gm, self.config))
        return gm

    def __call__(self, gm: torch.fx.GraphModule, example_inputs, *, mode: str | None = None, options=None):
        """torch.compile's mode= and options= (passed only when given) reach the inner compiler (inner.py)."""
        inner_compiler(self.inner, mode, options, {})  # a mode/options the inner cannot take: refused first
        before = len(self.plans)
        self.graphs += 1
        gm = self.transform(gm)
        new = self.plans[before:]
        patches = {}
        if self.inner == "inductor" and new:
            # the caches must see cpcompile's code (inductor_cache.py); a user's own post-grad pass is kept in it
            user_pass = (options or {}).get("post_grad_custom_post_pass")
            patches = cache_key_patches(user_pass)
            options = {k: v for k, v in (options or {}).items() if k != "post_grad_custom_post_pass"} or None
            if any(COMMS[p.comm].capabilities.overlaps and get_family(p.site.kind).overlaps for p in new):
                patches.update(INDUCTOR_OVERLAP_PATCHES)
        compiled = inner_compiler(self.inner, mode, options, patches)(gm, example_inputs)
        # the outputs that hold tokens (the guard's finding) are marked when it runs: the graph fed them next (after a
        # graph break, or another compiled function) knows where their tokens are (token_marks.py)
        return marking_outputs(compiled, gm.meta.get(OUTPUTS_META, ()))


def check_choices(strategy: str, comm: str, kernel: str) -> None:
    """A CPCompileError naming the valid values for an unknown strategy, comm or kernel."""
    for what, value, allowed in (
        ("strategy", strategy, STRATEGIES),
        ("comm", comm, (*COMMS, "auto")),
        ("kernel", kernel, KERNEL_NAMES),
    ):
        if value not in allowed:
            raise CPCompileError(f"unknown {what} {value!r}. Fix: use one of {list(allowed)}.")


def check_deferred_merge(comm: str, deferred_merge: bool) -> None:
    """deferred_merge=True only with a comm whose regions merge partial outputs over steps (the ring)."""
    if deferred_merge and (comm == "auto" or not COMMS[comm].capabilities.defers_merge):
        raise CPCompileError(
            f"deferred_merge=True with comm={comm!r}: only {comms_that(lambda c: c.capabilities.defers_merge)} merge "
            "partial outputs over steps. Fix: drop deferred_merge, or use comm='ring'."
        )


def backend(
    strategy: str = "flat",
    comm: str = "all_gather",
    *,
    mesh=None,
    group: dist.ProcessGroup | None = None,
    kernel: str = "auto",
    inner: str | Callable = "inductor",
    regather: bool = False,
    mixer_layout: str = "same",
    check_batch: bool = True,
    deferred_merge: bool = False,
) -> CPBackend:
    """A torch.compile backend that runs every attention node context-parallel.

    strategy: token layout across ranks ("flat", "zigzag"; "thd", "thd_zigzag" for packed documents under
    torch.nn.attention.varlen.varlen_attn); comm: "all_gather" (gather K/V), "a2a" (Ulysses: trade heads for
    sequence), "ring" (K/V chunks passed around the ring, overlapped with the blocks), "selective" (packed
    documents: each rank gets only the K/V its queries read), "hierarchical" (on a 2-D CP mesh: a2a inside a node,
    a ring of the head share's K/V across nodes) or "auto" (per site, the comm the cost model estimates fastest
    among those it costs, cost/choose.py); mesh: a 1-D DeviceMesh, one with a dim named "cp", or a 2-D CP mesh
    with dims named "cp_inter" (across nodes) and "cp_intra" (inside a node), flattened into one CP group of CP
    rank inter * intra size + intra for every comm (other dims, e.g. "dp", may come first); group: a
    ProcessGroup (neither: the default group); kernel: "auto" (per site, the
    fastest estimate among the providers that can run it) or a provider name; inner: the compiler after the
    pass ("inductor", "aot_eager", "eager", or any torch.compile backend callable, e.g. one that records
    aot_autograd graphs); regather: with comm="all_gather", save only the local K/V for backward and gather
    them again there (one layer's gathered K/V alive at a time, one more gather); mixer_layout: under zigzag,
    where runs of token mixers run on flat chunks between two relayouts (all-to-alls of the tokens): "same" (never),
    "auto" (where that receives fewer bytes), "flat" (always; a run that cannot is refused); check_batch: check
    each step's batch against the layout on every rank (position ids, padding, an unsharded batch:
    regions/batch_check.py; one all-gather of four int64 a graph and step, no host sync), False: off;
    deferred_merge: with comm="ring", keep every step's partial output (and, backward, dq) and merge them once
    after the last step instead of folding each into an fp32 running sum: less memory traffic, more memory alive
    (explain() says how much; regions/deferred.py).
    """
    check_choices(strategy, comm, kernel)
    if not callable(inner) and inner not in INNER:
        raise CPCompileError(f"unknown inner {inner!r}. Fix: use one of {list(INNER)}.")
    if regather and (comm == "auto" or not COMMS[comm].capabilities.regathers):
        raise CPCompileError(
            f"regather=True with comm={comm!r}: only {comms_that(lambda c: c.capabilities.regathers)} keep gathered "
            "K/V for backward. Fix: drop regather, or use comm='all_gather'."
        )
    check_deferred_merge(comm, deferred_merge)
    check_mesh_or_group(mesh, group)
    check_mixer_layout(mixer_layout, strategy)
    config = CPConfig(
        strategy=strategy, comm=comm, kernel=kernel, mesh=mesh, group=group, regather=bool(regather),
        mixer_layout=mixer_layout, check_batch=bool(check_batch), deferred_merge=bool(deferred_merge),
    )  # fmt: skip
    return CPBackend(config, inner=inner)


def default_backend(gm: torch.fx.GraphModule, example_inputs, **compile_kwargs):
    """Entry point for torch.compile(model, backend="cpcompile"): flat layout, all-gather, default group
    (torch.compile's mode= / options= pass through to Inductor)."""
    return backend()(gm, example_inputs, **compile_kwargs)
