"""Count the aten ops the packed regions dispatch on the host, per region call and per executor call (ring step).

Compiled, a region's own ops are Inductor kernels; what still runs eagerly op by op, at every ring step, is the
inside of the executor's custom ops (`cpcompile::attend_varlen_blocks(_backward)`) around the attention kernel:
the profile of ring over thd_zigzag on the H200 found that host work, not the kernels, set the step time. This
runs a region eagerly on a fake process group, rank `rank` of `world`, with cudnn_varlen on a CPU stand-in of its
op (tests/support/cudnn_stand_in.py) whose calls count as one op each (the kernel's own work is not cpcompile's),
and counts every aten op, inside the cpcompile ops too.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.support.cudnn_stand_in import CuDNNStandIn
from tests.support.fake_pg import fake_group
from tests.support.thd_parity import cu_of

EXECUTOR_OPS = ("attend_varlen_blocks", "attend_varlen_blocks_backward")
LENGTHS = [64, 32, 160, 0, 256]
"""Documents of the counted batch (every length a multiple of 2 * 8, thd_zigzag at cp=8): the counts depend
only on the number of blocks and which sides they vouch for, not on the lengths."""


@dataclass
class Count:
    """Ops of one region call: `total` (all of them) and, per executor op call in order, (op name, its ops)."""

    total: int = 0
    calls: list[tuple[str, int]] = field(default_factory=list)
    names: Counter = field(default_factory=Counter)
    call_names: list[Counter] = field(default_factory=list)
    """Per executor op call, in order: its ops by name."""

    def per_call(self, op: str) -> list[int]:
        return [n for name, n in self.calls if name == op]


class HostOps(TorchDispatchMode):
    """Counts aten ops, descending into cpcompile's custom ops (each also counted as one op); `opaque` calls
    count one op and nothing inside."""

    def __init__(self) -> None:
        super().__init__()
        self.count = Count()
        self.paused = 0
        self.inside: list[Counter] = []

    def _add(self, name: str) -> None:
        if self.paused:
            return
        self.count.total += 1
        self.count.names[name] += 1
        if self.inside:
            self.inside[-1][name] += 1

    def opaque(self, fn):
        """`fn` as one op; its tensors made contiguous, as the real kernel allocates them."""

        def run(*args, **kwargs):
            self._add("kernel")
            self.paused += 1
            try:
                return tuple(t.contiguous() for t in fn(*args, **kwargs))
            finally:
                self.paused -= 1

        return run

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self._add(str(func))
        if func.namespace != "cpcompile" or self.paused:
            return func(*args, **kwargs)
        name = func.__name__.split(".")[0]
        self.inside.append(Counter())
        try:
            with self:  # the op's Python kernel, below autograd, with this mode on again
                out = func.redispatch(torch._C.DispatchKeySet(torch._C.DispatchKey.CPU), *args, **kwargs)
        finally:
            inner = self.inside.pop()
        if name in EXECUTOR_OPS and not self.paused:
            self.count.calls.append((name, sum(inner.values())))
            self.count.call_names.append(inner)
        return out


@contextlib.contextmanager
def cudnn_stand_in(mode: HostOps):
    """cudnn_varlen's ops replaced by the CPU stand-in, each of its calls one opaque op of `mode` (the stand-in's
    checks of the metadata columns are the test's work, not the region's)."""
    from cpcompile.kernels import cudnn_varlen as cv

    ops = CuDNNStandIn()
    ops.cudnn_thd_fwd, ops.cudnn_thd_bwd = mode.opaque(ops.cudnn_thd_fwd), mode.opaque(ops.cudnn_thd_bwd)
    real = cv._ops
    cv._ops = lambda: ops
    try:
        yield
    finally:
        cv._ops = real


def _inputs(layout: str, world: int, hq: int = 4, hkv: int = 2, d: int = 8):
    from cpcompile.layouts.thd import get_packed_layout

    cu = cu_of(LENGTHS)
    total = sum(LENGTHS)
    lay = get_packed_layout(layout)
    cu = lay.prepare(cu, total, world)  # thd_balanced: this batch's plan
    g = torch.Generator().manual_seed(0)
    local = total // world
    q, k, v, dout = (torch.randn(local, h, d, generator=g, dtype=torch.bfloat16) for h in (hq, hkv, hkv, hq))
    return cu, q, k, v, dout


def count_region(comm: str, layout: str, world: int = 8, rank: int = 0, kernel: str = "cudnn_varlen") -> Count:
    """Ops of one eager forward + backward of the packed region `comm` ("ring" or "all_gather") on `layout`,
    causal, rank `rank` of `world` on a fake group, `kernel` (cudnn_varlen: on the stand-in)."""
    from cpcompile.comms.all_gather.varlen import all_gather_varlen_attention
    from cpcompile.comms.ring.varlen import ring_varlen_attention

    region = {"ring": ring_varlen_attention, "all_gather": all_gather_varlen_attention}[comm]
    cu, q, k, v, dout = _inputs(layout, world)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    mode = HostOps()
    with fake_group(rank, world) as group:
        name = group.group_name
        stand_in = cudnn_stand_in(mode) if kernel == "cudnn_varlen" else contextlib.nullcontext()
        with stand_in, mode:
            out, _, _ = region(
                q, k, v, cu, layout=layout, causal=True, scale=0.3, kernel=kernel, group_name=name, rank=rank,
                world=world, max_doc=max(LENGTHS),
            )  # fmt: skip
            out.backward(dout)
    return mode.count
