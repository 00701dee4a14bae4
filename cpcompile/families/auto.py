"""comm="auto" and kernel="auto" for one site: the options its rules allow, then the cost model's choice.

The planners (families/*/plan.py) hand over their comm rules as a function (rule broken, fix) or None
per comm; every comm of the registry whose rules the site meets is an option for "auto", every provider that
can run the site's device, dtype, head dims (and window) for kernel="auto". With more than one (comm, kernel)
option, cost/choose.py picks by estimated time, today's order breaking ties. A named comm or kernel is checked
and used as before, and a site with nothing that can run it gets one CPCompileError naming every reason.
"""

from __future__ import annotations

from collections.abc import Callable

from ..comms.registry import COMMS
from ..cost import Choice, SiteShape, choose
from ..cost.measured import measured_at
from ..errors import site_error
from ..kernels import supported_kernels
from .checks import site_kernel
from .site import AttentionSite

AUTO = "auto"


def site_comms(site: AttentionSite, name: str, problem: Callable[[str], tuple[str, str] | None]) -> list[str]:
    """The comms this site may use: `name` when it meets its rules (else its error), or for "auto" every comm of
    the registry that does and that "auto" considers (Comm.auto_option), followed by those it considers only at
    a measured point (`resolve` keeps them where cost/measured.py has the site)."""
    if name != AUTO:
        if (found := problem(name)) is not None:
            raise site_error(site.node, *found)
        return [name]
    options, measured_only, reasons = [], [], []
    for comm, entry in COMMS.items():
        found = problem(comm)
        if found is None and entry.auto_option:
            options.append(comm)
        elif found is None:
            measured_only.append(comm)
            reasons.append((comm, ("comm='auto' never picks it: name it", "")))
        else:
            reasons.append((comm, found))
    if not options:
        rules = "; ".join(f"{comm}: {rule}" for comm, (rule, _) in reasons)
        raise site_error(site.node, f"comm='auto' found no comm that can run it ({rules})", reasons[0][1][1])
    return options + measured_only


def site_kernels(
    site: AttentionSite,
    name: str,
    head_dim: int,
    varlen: bool,
    usable: Callable[[str], bool] = lambda k: True,
    features: tuple[str, ...] = (),
) -> list[str]:
    """The kernels this site may use: `name` (its error when it cannot run here), or for "auto" every provider
    that can run it, with the block `features` it needs (kernels.FEATURES), and passes `usable` (the caller
    raises when `usable` refuses them all)."""
    first = site_kernel(site, name, head_dim, varlen, features)  # the site's error when no provider runs here
    if name != AUTO:
        return [first]
    v_dim = site.v_shape[-1]
    found = supported_kernels(site.device, site.dtype, head_dim, varlen=varlen, v_head_dim=v_dim, features=features)
    return [k for k in found if usable(k)] or [first]


def resolve(shape: SiteShape, layout: str, comms: list[str], kernels: list[str]) -> tuple[str, str, Choice | None]:
    """(comm, kernel, the Choice when the cost model made one: more than one option). Of several comms ("auto"),
    those "auto" does not consider (Comm.auto_option) stay only where the site is a measured point for them and
    for every comm "auto" considers (cost/choose.measured_options)."""
    if len(comms) > 1:  # measured-only comms compete where every comm "auto" considers was measured too
        measured = {c for c in comms if any(measured_at(shape, layout, c, k) for k in kernels)}
        whole = all(c in measured for c in comms if COMMS[c].auto_option)
        comms = [c for c in comms if COMMS[c].auto_option or (whole and c in measured)]
    options = [(comm, kernel) for comm in comms for kernel in kernels]
    if len(options) == 1:
        return (*options[0], None)
    choice = choose(shape, layout, options)
    return choice.chosen.comm, choice.chosen.kernel, choice
