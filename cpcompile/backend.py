"""cpcompile.backend(...): a torch.compile backend that rewrites attention into CP regions, then compiles."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.fx

from .dtensor_ops import register_cpu_sdpa_rules
from .errors import CPCompileError
from .groups import resolve_group
from .kernels import KERNEL_NAMES
from .layouts import LAYOUTS
from .layouts.thd import THD_LAYOUTS
from .passes import COMMS, CPConfig, CPPlan, find_attention_sites, plan_site, rewrite_graph
from .passes.dtensor import is_dtensor_site, localize_dtensor_site

INNER = ("inductor", "aot_eager", "eager")

register_cpu_sdpa_rules()  # at import: Dynamo traces SDPA on CPU DTensors before any backend is called


def _inner_compiler(name: str | Callable) -> Callable:
    if callable(name):
        return name
    if name == "inductor":
        from torch._inductor.compile_fx import compile_fx

        return compile_fx
    if name == "aot_eager":
        from torch._dynamo.backends.debugging import aot_eager

        return aot_eager
    return lambda gm, example_inputs: gm.forward


@dataclass
class CPBackend:
    """The backend object torch.compile calls once per captured graph.

    `plans` lists every site rewritten so far (one CPPlan each), across all graphs this backend compiled.
    """

    config: CPConfig
    mesh: object = None
    group: dist.ProcessGroup | None = None
    inner: str | Callable = "inductor"
    plans: list[CPPlan] = field(default_factory=list)

    def transform(self, gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
        """Run the pass alone (find, plan every site, then rewrite): all validation precedes any rewrite."""
        sites = find_attention_sites(gm)
        if not sites:
            return gm
        plans = []
        for site in sites:
            if is_dtensor_site(site):  # mesh and seq dim come from the placements
                site, group = localize_dtensor_site(site, self.config.strategy, self.mesh, self.group)
            else:
                group = resolve_group(self.mesh, self.group)
            plans.append(plan_site(site, self.config, group))
        rewrite_graph(gm, plans)
        self.plans.extend(plans)
        return gm

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        return _inner_compiler(self.inner)(self.transform(gm), example_inputs)


def backend(
    strategy: str = "flat",
    comm: str = "all_gather",
    *,
    mesh=None,
    group: dist.ProcessGroup | None = None,
    kernel: str = "auto",
    inner: str | Callable = "inductor",
) -> CPBackend:
    """A torch.compile backend that runs every attention node context-parallel.

    strategy: token layout across ranks ("flat", "zigzag"; "thd", "thd_zigzag" for packed documents under
    torch.nn.attention.varlen.varlen_attn); comm: "all_gather" (gather K/V) or "a2a" (Ulysses: trade heads for
    sequence); mesh: a 1-D DeviceMesh or one
    with a dim named "cp"; group: a ProcessGroup (neither: the default group); kernel: "auto" or a provider
    name; inner: the compiler after the pass ("inductor", "aot_eager", "eager", or any torch.compile backend
    callable, e.g. one that records aot_autograd graphs).
    """
    for what, value, allowed in (
        ("strategy", strategy, (*LAYOUTS, *THD_LAYOUTS)),
        ("comm", comm, COMMS),
        ("kernel", kernel, KERNEL_NAMES),
        ("inner", inner, INNER),
    ):
        if not (what == "inner" and callable(value)) and value not in allowed:
            raise CPCompileError(f"unknown {what} {value!r}. Fix: use one of {list(allowed)}.")
    if mesh is not None and group is not None:
        raise CPCompileError("both mesh= and group= were given. Fix: pass only one of them.")
    return CPBackend(CPConfig(strategy=strategy, comm=comm, kernel=kernel), mesh=mesh, group=group, inner=inner)


def default_backend(gm: torch.fx.GraphModule, example_inputs):
    """Entry point for torch.compile(model, backend="cpcompile"): flat layout, all-gather, default group."""
    return backend()(gm, example_inputs)
