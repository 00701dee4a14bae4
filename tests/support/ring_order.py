"""Whether Inductor's code for a ring region issues each K/V shift before the kernels it should overlap.

The ring's forward is, per step: issue the next shift, run this step's blocks, wait for the shift. Inductor may
reorder independent nodes, and a shift issued after the step's kernels overlaps nothing: the step then waits for
the whole transfer. Read from the generated code (the order Inductor launches in), the property is: after each
wait but the last, the next shift comes before any attention kernel, and at least one kernel runs between each
shift and its wait (for a layout whose every step has blocks: zigzag; flat's causal ranks skip steps).
"""

from __future__ import annotations

import re

ATTENTION = r"_scaled_dot_product_\w*attention\w*"
EVENT = re.compile(rf"\b(all_to_all_single|wait_tensor|{ATTENTION})\.default\(")


def launch_events(code: str) -> list[str]:
    """'shift', 'wait' and 'kernel' in the order the generated code issues them (kernel backward ops excluded)."""
    names = {"all_to_all_single": "shift", "wait_tensor": "wait"}
    return [names.get(m.group(1), "kernel") for m in EVENT.finditer(code) if "backward" not in m.group(1)]


def shifts_overlap_kernels(events: list[str]) -> str | None:
    """None when every shift is issued before the step's kernels and overlaps at least one, else what is wrong."""
    shifts = [i for i, e in enumerate(events) if e == "shift"]
    waits = [i for i, e in enumerate(events) if e == "wait"]
    if not shifts or len(shifts) != len(waits):
        return f"{len(shifts)} shifts and {len(waits)} waits in {events}"
    for n, (s, w) in enumerate(zip(shifts, waits)):
        if "kernel" not in events[s:w]:
            return f"shift {n} overlaps no kernel: {events}"
        if n and "kernel" in events[waits[n - 1] : s]:
            return f"shift {n} is issued after a kernel of its step: {events}"
    return None
