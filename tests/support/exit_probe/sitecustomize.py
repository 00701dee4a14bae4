"""Loaded by every Python process of an example run (tests/examples put this folder on PYTHONPATH): when the
process exits, before Python shuts down (the last atexit handler), it says how many of gloo's threads are alive.

Any alive means the process group outlived destroy_process_group (something still held it), so gloo's worker
threads run on into interpreter shutdown, where one that frees a collective's tensor needs the GIL, is ended by
Python and aborts the process: "terminate called without an active exception" after `done:`, 1 run in 7 on a
busy machine (issue 43). Counting the threads makes that race a deterministic check."""

import atexit
import glob
import sys

PREFIX = "cpcompile-exit-probe: gloo threads alive at exit:"


def _report() -> None:
    names = []
    for path in glob.glob("/proc/self/task/*/comm"):
        try:
            with open(path) as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            continue
    alive = sum(name.startswith(("pt_gloo", "gloo_tcp")) for name in names)
    print(f"{PREFIX} {alive}", file=sys.stderr, flush=True)


if glob.glob("/proc/self/task"):
    atexit.register(_report)
