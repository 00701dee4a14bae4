"""A stand-in process group whose collectives take the time a link would: one process plays one rank of `world`,
as the fake process group does, but each collective occupies a side CUDA stream for its bytes over a stated
bandwidth (cpcompile/testing/link_model.py), so a compiled step shows how much communication its kernels hide.

    with link_group(rank=0, world=8, topology=Topology(per_node=4)) as link:
        ...compile and run...                         # collectives sleep bytes / bandwidth on the link stream
        link.enabled = False                          # the same compiled graph, compute only (as the fake group)

How one collective runs (`LinkGroup._issue`), with the link on and on CUDA:
1. an event recorded on the current stream marks the input ready;
2. the group's link stream (one per process group, as NCCL has one per communicator, so the collectives of one
   group queue behind each other and two groups' overlap; high priority, so the sleep's one thread block is not
   queued behind the compute kernels' blocks) waits for it, then sleeps `torch.cuda._sleep` for the
   collective's seconds at the calibrated clock (`calibrate`), then records a done event;
3. the Work's `wait()` (functional collectives' `wait_tensor`, where the compiled graph first needs the result)
   makes the then-current stream wait for the done event.

Outputs hold what the fake group's hold: an all-gather's every slot a copy of this rank's input (written on the
current stream when the collective is issued, so the compute-only time pays it too), the other collectives'
outputs as allocated (zeroed on CPU). Nothing is moved between ranks: the measurement is timing. With
the link off, or on CPU, a collective is complete at once (CPU: its bytes and seconds are still counted, which
is what the unit tests and the bench's CPU smoke test check). Functional collectives reach the group through
c10d's Python process-group trampoline (the methods below are the ones torch 2.11 and 2.13 call), under
torch.compile and eagerly alike. `LinkGroup.stands_in_for_peers` tells cpcompile's rank agreement that no peer
runs (passes/agree.py), as for the fake group. For the bench only: never for training.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .link_model import Topology, collective_seconds, sent_to_peers, sleep_cycles

BACKEND = "cpcompile_link"


@dataclass
class Sent:
    """One collective as the link group counted it."""

    group: str
    kind: str
    bytes: int
    seconds: float
    spans_nodes: bool


@dataclass
class Link:
    """What every group of one `link_group` shares: the topology, whether the links are on, the sleep clock and,
    while `recording`, a log of every collective (with CUDA events around each sleep, for `measured_ms`)."""

    world: int
    topology: Topology
    enabled: bool = True
    cycles_per_ms: float = 0.0
    """GPU clock cycles of torch.cuda._sleep a millisecond (`calibrate`); 0 on CPU."""
    scale: float = 1.0
    """Multiplies every sleep (the bench corrects the calibrated clock with measured sleeps)."""
    recording: bool = False
    log: list[Sent] = field(default_factory=list)
    timed: list[tuple[torch.cuda.Event, torch.cuda.Event]] = field(default_factory=list)
    waits: int = 0
    """Works waited while recording: one per logged collective when every result reaches the graph through this
    group's `wait()` (the bench checks it: a wait that bypassed it would hide the link)."""

    def record(self) -> None:
        """Start a fresh log (the next collectives are counted, their sleeps timed)."""
        self.log.clear()
        self.timed.clear()
        self.waits = 0
        self.recording = True

    def stop(self) -> list[Sent]:
        self.recording = False
        return list(self.log)

    def measured_ms(self) -> float:
        """Milliseconds the logged sleeps took on the GPU (synchronizes; 0 on CPU or with the links off)."""
        if not self.timed:
            return 0.0
        torch.cuda.synchronize()
        return sum(start.elapsed_time(end) for start, end in self.timed)


class LinkWork(dist._Work):
    """Done when the link stream's done event is (None: done at once)."""

    def __init__(self, done: torch.cuda.Event | None, result: list[torch.Tensor], link: Link | None = None) -> None:
        super().__init__()
        self._done, self._link = done, link
        self._future = torch.futures.Future()
        self._future.set_result(result)

    def wait(self, timeout=None) -> bool:
        if self._link is not None and self._link.recording:
            self._link.waits += 1
        if self._done is not None:
            torch.cuda.current_stream().wait_event(self._done)
        return True

    def block_current_stream(self) -> None:
        self.wait()

    def is_completed(self) -> bool:
        return self._done is None or self._done.query()

    def get_future(self) -> torch.futures.Future:
        return self._future


class LinkGroup(dist.ProcessGroup):
    """Group rank `rank` of the global `ranks`, its collectives timed on `link` (module docstring)."""

    stands_in_for_peers = True

    def __init__(self, rank: int, ranks: list[int], link: Link, name: str) -> None:
        super().__init__(rank, len(ranks))
        self._rank, self._ranks, self._link = rank, list(ranks), link
        self._stream: torch.cuda.Stream | None = None
        self._group_name, self._group_desc = name, ""

    # c10d's names: a Python group keeps its own name and description (c10d sets them after creating it)
    def getBackendName(self) -> str:  # noqa: N802
        return BACKEND

    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._group_name = name

    def getGroupName(self) -> str:  # noqa: N802
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._group_desc = desc

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._group_desc

    def __repr__(self) -> str:
        return f"LinkGroup(rank {self._rank} of global ranks {self._ranks})"

    def _issue(self, kind: str, sample: torch.Tensor, nbytes: int, outputs: list, splits=None) -> LinkWork:
        size, link = len(self._ranks), self._link
        per_peer = sent_to_peers(kind, size, self._rank, nbytes, splits)
        seconds = collective_seconds(kind, self._ranks, self._rank, per_peer, link.topology) * link.scale
        if link.recording:
            spans = link.topology.spans_nodes(self._ranks)
            link.log.append(Sent(self._group_name, kind, sum(per_peer), seconds, spans))
        if not sample.is_cuda and kind != "all_gather":
            for t in outputs:  # zeros, not whatever the allocator held (denormals make CPU math crawl)
                t.zero_()
        if not (link.enabled and sample.is_cuda and seconds > 0):
            return LinkWork(None, outputs, link)
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=sample.device, priority=-1)  # not queued behind compute blocks
        ready, done = torch.cuda.Event(), torch.cuda.Event()
        ready.record()
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(ready)  # no tensor is touched here: nothing for the caching allocator to hold
            start = end = None
            if link.recording:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            torch.cuda._sleep(sleep_cycles(seconds, link.cycles_per_ms))
            if end is not None:
                end.record()
                link.timed.append((start, end))
            done.record()
        return LinkWork(done, outputs, link)

    # all-gather: the input to every other rank; its copies in every slot, as the fake group writes them (the
    # regions' checks compare gathered checksums and verdicts: a gathered copy of this rank's agrees)
    def _allgather_base(self, output, input, opts=None):  # noqa: A002
        self._copies(output, input)
        return self._issue("all_gather", input, _bytes(input), [output])

    def _copies(self, output: torch.Tensor, input: torch.Tensor) -> None:  # noqa: A002
        for chunk in output.chunk(len(self._ranks)):
            chunk.copy_(input.view(chunk.shape))

    all_gather_single = _allgather_base

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        for output, input in zip(outputs, inputs):  # noqa: A001
            self._copies(output, input)
        return self._issue("all_gather", inputs[0], sum(map(_bytes, inputs)), list(outputs))

    def allgather(self, output_lists, inputs, opts=None):
        for t in output_lists[0]:
            t.copy_(inputs[0])
        return self._issue("all_gather", inputs[0], sum(map(_bytes, inputs)), [t for ts in output_lists for t in ts])

    # reduce-scatter: each rank's slice of the input to that rank
    def _reduce_scatter_base(self, output, input, opts=None):  # noqa: A002
        return self._issue("reduce_scatter", input, _bytes(input), [output])

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        return self._issue("reduce_scatter", inputs[0], sum(map(_bytes, inputs)), list(outputs))

    # all-to-all: rows of dim 0 by the input splits (equal parts without them)
    def alltoall_base(self, output, input, output_splits, input_splits, opts=None):  # noqa: A002
        if input_splits:
            row = _bytes(input) // input.shape[0] if input.shape[0] else 0
            return self._issue("all_to_all", input, row, [output], list(input_splits))
        return self._issue("all_to_all", input, _bytes(input), [output])

    all_to_all_single = alltoall_base

    def allreduce(self, tensors, opts=None):
        return self._issue("all_reduce", tensors[0], sum(map(_bytes, tensors)), list(tensors))

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors, opts=None):
        return LinkWork(None, list(tensors))  # not on a step's path: the bench's setup only

    def barrier(self, opts=None):
        return LinkWork(None, [])


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


_ACTIVE: list[Link] = []


def _create(common, backend_options) -> LinkGroup:
    """c10d's backend factory (extended API: the group's global ranks, which decide its links)."""
    link = _ACTIVE[-1]
    ranks = list(common.global_ranks_in_group) or list(range(common.group_size))
    return LinkGroup(common.group_rank, ranks, link, str(common.group_id))


def _register() -> None:
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])


def calibrate(device: int | None = None, cycles: int = 20_000_000) -> float:
    """GPU clock cycles of torch.cuda._sleep a millisecond on this GPU, timed by CUDA events (median of 3, after a
    ~50 ms sleep that takes the SM clock out of idle)."""
    torch.cuda._sleep(5 * cycles)
    ms = []
    for _ in range(4):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        ms.append(start.elapsed_time(end))
    return cycles / sorted(ms[1:])[1]


@contextlib.contextmanager
def link_group(rank: int, world: int, topology: Topology) -> Iterator[Link]:
    """The default process group (and every group made from it: a DeviceMesh's dims) as link groups, this process
    being global rank `rank` of `world`; yields the `Link` they share (calibrated on CUDA)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("link_group: a default process group exists already; destroy it first")
    link = Link(world, topology, cycles_per_ms=calibrate() if torch.cuda.is_available() else 0.0)
    _register()
    _ACTIVE.append(link)
    try:
        dist.init_process_group(BACKEND, store=FakeStore(), rank=rank, world_size=world)
        yield link
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        _ACTIVE.pop()
