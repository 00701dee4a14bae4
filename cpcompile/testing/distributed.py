"""Run a function on N local ranks (gloo on 127.0.0.1) with a hard timeout: a bug fails, it never hangs.

Spawning ranks costs seconds a rank on a small machine (a fresh interpreter imports torch, cpcompile and the test's
modules, then joins the process group), more than most tests' own work. With CPCOMPILE_TEST_SHARED_RANKS=1 (the
test suite sets it: tests/conftest.py) `run_ranks` hands its function to ranks spawned once per (world, backend,
threads) for the whole process instead, each run starting from a reset state (`reset_rank_state`); a failure
stops those ranks and the next run spawns fresh ones.
"""

from __future__ import annotations

import datetime
import io
import os
import queue
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def share_one_gpu() -> None:
    """Set up a spawned rank that shares GPU 0 with the others over gloo: tracebacks on a crash, cuda:0, and
    cpcompile's collectives through host memory (gloo crashes on CUDA all-gathers: cpcompile/comm/route.py).
    Right for kernel correctness; says nothing about communication. CPCOMPILE_TEST_STACKS_AFTER=<seconds>: every
    thread's stack to stderr once that long has passed (what a rank waits on when its peer times out)."""
    import faulthandler

    from ..comm.route import through_host

    faulthandler.enable()
    if after := os.environ.get("CPCOMPILE_TEST_STACKS_AFTER"):
        faulthandler.dump_traceback_later(float(after), exit=False)
    torch.cuda.set_device(0)
    through_host()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _to_bytes(value: Any) -> bytes:
    """Results travel as bytes: tensors sent through the queue would share memory with an exited process."""
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _worker(rank, world, port, backend, fn, args, results, threads):
    torch.set_num_threads(threads)
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    try:
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=int(os.environ.get("CPCOMPILE_TEST_PG_TIMEOUT", "120"))),
        )
        try:
            results.put((rank, "ok", _to_bytes(fn(rank, world, *args))))
        finally:
            dist.destroy_process_group()
    except BaseException:  # report every failure to the parent, which raises it
        results.put((rank, "error", traceback.format_exc()))


SHARED_RANKS_ENV = "CPCOMPILE_TEST_SHARED_RANKS"
_SHARED: dict[tuple[int, str, int], RankPool] = {}


def run_ranks(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    timeout: float = 300.0,
    backend: str = "gloo",
    threads: int = 1,
    fresh: bool = False,
) -> list[Any]:
    """Call fn(rank, world, *args) in `world` spawned processes after init_process_group; return their results.

    `fn` must be importable (module level). Raises RuntimeError with the rank's traceback if any rank fails,
    and TimeoutError (after killing every rank) if they do not all finish within `timeout` seconds. Under
    CPCOMPILE_TEST_SHARED_RANKS=1 the ranks are shared with earlier calls of the same world, backend and threads
    (module docstring) unless `fresh`.
    """
    if not fresh and os.environ.get(SHARED_RANKS_ENV) == "1":
        key = (world, backend, threads)
        if key not in _SHARED:
            _SHARED[key] = RankPool(world, backend, threads)
        return _SHARED[key].run(fn, *args, timeout=timeout)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world, port, backend, fn, args, results, threads), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    try:
        return _collect(procs, results, timeout)
    finally:
        _stop(procs)


def _collect(procs: list, results, timeout: float) -> list[Any]:
    """Every rank's result, in rank order; raises on a rank's error, a dead rank or the timeout."""
    world = len(procs)
    collected: dict[int, Any] = {}
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
    while len(collected) < world:
        left = (deadline - datetime.datetime.now()).total_seconds()
        if left <= 0:
            raise TimeoutError(f"ranks {sorted(set(range(world)) - set(collected))} did not finish in {timeout}s")
        try:
            rank, status, value = results.get(timeout=min(left, 1.0))
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in collected]
            if dead:
                codes = [procs[r].exitcode for r in dead]
                raise RuntimeError(f"rank(s) {dead} died with exit codes {codes}") from None
            continue
        if status == "error":
            raise RuntimeError(f"rank {rank} failed:\n{value}")
        collected[rank] = torch.load(io.BytesIO(value), weights_only=False)
    return [collected[r] for r in range(world)]


def _stop(procs: list) -> None:
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()


def close_shared_pools() -> None:
    """Stop every rank `run_ranks` shares (the suite calls it at the end of the session)."""
    for pool in _SHARED.values():
        pool.close()
    _SHARED.clear()


def reset_rank_state(environ: dict[str, str]) -> None:
    """What a pooled rank resets before each run, so a run sees what a freshly spawned rank would: Dynamo's
    caches, the default dtype, grad mode, a new random seed (a fresh process draws one), determinism, and the
    environment as the rank started with it (`environ`)."""
    torch._dynamo.reset()
    torch.set_default_dtype(torch.float32)
    torch.set_grad_enabled(True)
    torch.seed()
    torch.use_deterministic_algorithms(False)
    for name in set(os.environ) - set(environ):
        del os.environ[name]
    os.environ.update(environ)


def _pool_worker(rank, world, port, backend, tasks, results, threads):
    torch.set_num_threads(threads)
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    environ = dict(os.environ)
    try:
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=int(os.environ.get("CPCOMPILE_TEST_PG_TIMEOUT", "120"))),
        )
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
        return
    while True:  # until RankPool.close kills the process
        fn, args = tasks.get()
        try:
            reset_rank_state(environ)
            results.put((rank, "ok", _to_bytes(fn(rank, world, *args))))
        except BaseException:
            results.put((rank, "error", traceback.format_exc()))


class RankPool:
    """`world` ranks spawned once that run one function after another (`run`, same contract as run_ranks): for
    a test module whose every test would otherwise pay the spawn and the imports again. After a failure the
    ranks are stopped (the others may wait in a collective) and the next `run` spawns fresh ones."""

    def __init__(self, world: int, backend: str = "gloo", threads: int = 1) -> None:
        self.world, self.backend, self.threads = world, backend, threads
        self._procs: list = []
        self._tasks: list = []

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world)]
        port = free_port()
        self._procs = [
            ctx.Process(
                target=_pool_worker,
                args=(r, self.world, port, self.backend, self._tasks[r], self._results, self.threads),
                daemon=True,
            )
            for r in range(self.world)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 300.0) -> list[Any]:
        """fn(rank, world, *args) on every rank; their results in rank order."""
        if not self._procs or any(not p.is_alive() for p in self._procs):
            self.close()
            self._start()
        for t in self._tasks:
            t.put((fn, args))
        try:
            return _collect(self._procs, self._results, timeout)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop the ranks. Killed, not asked to leave: they hold nothing worth a graceful exit, and a rank left
        waiting in a collective by a failed run would never read the request."""
        for p in self._procs:
            p.kill()
            p.join()
        self._procs, self._tasks = [], []
