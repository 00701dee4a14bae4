"""cpcompile's logger: one INFO line per rewritten attention site, the graph after the pass at DEBUG.

`TORCH_LOGS="cpcompile"` (INFO) or `TORCH_LOGS="+cpcompile"` (DEBUG) turns it on like torch's own logs;
`logging.getLogger("cpcompile")` is an ordinary logger for any other setup.
"""

from __future__ import annotations

import logging

import torch.fx

from .errors import node_origin

LOGGER_NAME = "cpcompile"
log = logging.getLogger(LOGGER_NAME)


def _register_with_torch() -> None:
    """Name the logger in torch's log registry, so TORCH_LOGS and torch._logging.set_logs know it (torch parses
    TORCH_LOGS when it is imported and accepts any importable module name, so the env var works either way)."""
    from torch._logging import _internal

    if not _internal.log_registry.is_log(LOGGER_NAME):
        _internal.register_log(LOGGER_NAME, LOGGER_NAME)


_register_with_torch()


def site_line(plan) -> str:
    """What the pass did with one site: where it is, and the layout, comm, kernel and blocks it got."""
    extra = ""
    window = getattr(plan, "window", None)
    if window is not None and tuple(window) != (-1, -1):
        extra += f" window={tuple(window)}"
    if getattr(plan, "softcap", 0.0):
        extra += f" softcap={plan.softcap}"
    if plan.dtensor:
        extra += " dtensor"
    if plan.group.levels is not None:  # a 2-D CP mesh: this rank's place on each level
        inter, intra = plan.group.levels
        extra += f" levels=(node {inter.rank} of {inter.size}, rank {intra.rank} of {intra.size} in it)"
    if plan.choice is not None:  # comm="auto" / kernel="auto" weighed several options (cost/choose.py)
        extra += f" auto=({plan.choice.describe()})"
    return (
        f"rewrote {node_origin(plan.site.node)}: layout={plan.layout} comm={plan.comm} kernel={plan.kernel} "
        f"causal={plan.causal} blocks={plan.block_count()}{extra} (rank {plan.group.rank} of {plan.group.size})"
    )


def log_plans(gm: torch.fx.GraphModule, plans: list) -> None:
    """One INFO line per rewritten site; the rewritten graph at DEBUG (only rendered when DEBUG is on)."""
    for plan in plans:
        log.info("%s", site_line(plan))
    if plans and log.isEnabledFor(logging.DEBUG):
        log.debug("graph after the cpcompile pass:\n%s", gm.print_readable(print_output=False))
