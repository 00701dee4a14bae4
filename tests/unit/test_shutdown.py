"""destroy_process_group must really destroy the process group: one that outlives it (something still holds it)
keeps gloo's worker threads running into interpreter shutdown, where one that frees a collective's tensor needs the
GIL, is ended by Python and aborts the process ("terminate called without an active exception" after `done:`, 1
run in 7 of examples/torchrun/packed.py; issue 43). cpcompile's plans and backend memory hold nothing, and
cpcompile.destroy_process_group releases what Dynamo and torch keep, so the threads are gone when it returns."""

from __future__ import annotations

import gc
import subprocess
import sys
import weakref

import pytest
import torch

import cpcompile
from cpcompile.testing.model import TinyConfig, TinyLlama
from tests.support.fake_pg import fake_group


def test_plans_and_backend_memory_do_not_keep_the_group_alive():
    """After a compile, the backend's plans (kept by the backend and in Dynamo's graphs) and the token guard's
    memory of the backend (its config) let the group go once it is destroyed."""
    model = TinyLlama(TinyConfig(layers=1))
    ids, pos = torch.randint(0, 128, (1, 8)), torch.arange(8)[None]
    with fake_group(rank=0, world=2) as group:
        be = cpcompile.backend(strategy="zigzag", inner="eager")
        torch.compile(model, backend=be, fullgraph=True)(ids, pos)
        group_ref, config_ref = weakref.ref(group), weakref.ref(be.config)
        del group
    gc.collect()
    assert be.plans and all(plan.group.group is None for plan in be.plans)
    assert group_ref() is None, gc.get_referrers(group_ref())
    del be
    gc.collect()
    assert config_ref() is None  # the token guard's memory of the backend went with it


SCRIPT = """
import glob, os, sys
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
if {import_first}:
    import cpcompile
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
import cpcompile
import torch.distributed._functional_collectives as funcol
mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("cp",))
# all_gather_single where torch has it (2.13+), all_gather_tensor before: either imports torch.distributed.nn
gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
funcol.wait_tensor(gather(torch.ones(4), 0, dist.group.WORLD.group_name))
del mesh
cpcompile.destroy_process_group()
names = [open(f).read() for f in glob.glob("/proc/self/task/*/comm")]
print("gloo threads:", sum(n.startswith(("pt_gloo", "gloo_tcp")) for n in names))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc")
@pytest.mark.parametrize("import_first", [True, False], ids=["cpcompile-imported-first", "group-started-first"])
def test_destroy_process_group_joins_gloo_threads(import_first):
    """A one-rank gloo group that ran a functional collective (which imports torch.distributed.nn.functional, whose
    defaults bind the default group): after cpcompile.destroy_process_group no gloo thread is left, whether
    cpcompile was imported before the group started or after."""
    proc = subprocess.run([sys.executable, "-c", SCRIPT.format(import_first=import_first)], capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "gloo threads: 0" in proc.stdout, proc.stdout + proc.stderr[-2000:]
