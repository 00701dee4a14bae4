"""What the two parity demos (train_cp.py, train_torchtitan.py) share: progress lines, one-line errors, the
parity verdict. Nothing here imports torch at import time, so `--help` stays fast."""

from __future__ import annotations

import sys
import time
import traceback
from typing import Any, TextIO


class Progress:
    """Rank 0's progress: tqdm on a terminal when it is installed, a `\\r` bar on a terminal without it, one line
    a step elsewhere (a log stays readable). `started` is when the parent began starting the ranks, so the first
    step's time includes rank start-up and compiling."""

    def __init__(self, steps: int, started: float, stream: TextIO = sys.stderr, width: int = 30) -> None:
        self.steps, self.started, self.stream, self.width = steps, started, stream, width
        self.first_done: float | None = None
        self.tty = stream.isatty()
        self.bar = None
        if self.tty:
            try:
                from tqdm import tqdm
            except ImportError:
                pass
            else:
                self.bar = tqdm(total=steps, file=stream, unit="step", desc="training")

    def _rate(self, step: int, now: float) -> str:
        return f"{step / (now - self.first_done):.1f} steps/s" if step > 0 and self.first_done else "..."

    def __call__(self, step: int, loss: float) -> None:
        now = time.time()
        if step == 0:
            self.first_done = now
            note = f"step 1 done {now - self.started:.1f} s after start (ranks started, model traced and compiled)"
            print(note, file=self.stream, flush=True)
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}")
            self.bar.update(1)
            if step + 1 == self.steps:
                self.bar.close()
            return
        text = f"step {step + 1}/{self.steps}  loss {loss:.4f}  {self._rate(step, now)}"
        if not self.tty:
            print(text, file=self.stream, flush=True)
            return
        done = (step + 1) * self.width // self.steps
        bar = f"\r[{'#' * done}{'.' * (self.width - done)}] {text}"
        print(bar, end="" if step + 1 < self.steps else "\n", file=self.stream, flush=True)


def refusal(exc: BaseException) -> dict | None:
    """A CPCompileError anywhere in the exception's chain (Dynamo wraps the backend's errors) as a result a rank
    returns instead of raising: every rank raises the same refusal before any collective, so all of them
    return. None for any other error (the rank raises it)."""
    from cpcompile.brief_errors import refusal_in

    refused = refusal_in(exc)
    return None if refused is None else {"refused": str(refused), "traceback": traceback.format_exc()}


def run_or_explain(run, verbose: bool) -> list[Any] | None:
    """run() (which starts the ranks); on a refusal or a rank's failure print one line saying why (the whole
    traceback with --verbose) and return None."""
    try:
        results = run()
    except (RuntimeError, TimeoutError) as e:
        text = str(e).rstrip()
        if verbose:
            print(text, file=sys.stderr)
        else:
            print(f"error: {text.splitlines()[-1]} (--verbose: the whole traceback)", file=sys.stderr)
        return None
    refused = [r for r in results if isinstance(r, dict) and "refused" in r]
    if refused:
        if verbose:
            print(refused[0]["traceback"], file=sys.stderr)
        print(f"error: {refused[0]['refused']}", file=sys.stderr)
        if not verbose:
            print("(--verbose: the whole traceback)", file=sys.stderr)
        return None
    return results


def report_parity(results: list, ref) -> bool:
    """Print how closely every rank's losses and trained weights match the single process; True when they do."""
    loss_diff = max(abs(a - b) for r in results for a, b in zip(r.losses, ref.losses))
    weight_diff = max((p - ref.params[n]).abs().max().item() for r in results for n, p in r.params.items())
    rewritten = sorted({r.rewritten for r in results})
    per_rank = f"{rewritten[0]} on every rank" if len(rewritten) == 1 else ", ".join(str(r.rewritten) for r in results)
    print(f"attention calls rewritten: {per_rank}")
    print(f"loss: first {ref.losses[0]:.4f} -> last {ref.losses[-1]:.4f} (single process)")
    print(f"parity with single process: max |loss diff| {loss_diff:.2e}, max |weight diff| {weight_diff:.2e}")
    ok = loss_diff <= 1e-4 and weight_diff <= 1e-3
    print("PARITY OK" if ok else "PARITY MISMATCH")
    return ok
