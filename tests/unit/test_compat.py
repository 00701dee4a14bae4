"""Each torch compatibility patch (cpcompile/compat/) is needed on the installed torch exactly where it says
(its TORCH_VERSIONS): the unpatched behaviour, measured in a fresh interpreter that never imports cpcompile, is
still broken there (or torch's internals still look as the module reads them), and fixed by the patch; where a
patch is not needed it changes nothing."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from cpcompile.compat import (
    compile_frames,
    dist_nn_defaults,
    dtensor_cpu_sdpa,
    dtensor_planners,
    eager_attention,
    mesh_flatten,
    varlen_fake,
    varlen_gqa,
)
from cpcompile.compat.versions import serves, torch_minor

UNPATCHED = """
import json, torch, torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.nn.attention.varlen import varlen_attn
found = {"sdpa_builtin": F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention}
prop = DTensor._op_dispatcher.sharding_propagator
tables = [getattr(prop, n, {}) for n in ("op_strategy_funcs", "op_to_rules", "op_single_dim_strategy_funcs")]
cpu_ops = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward")
found["dtensor_rules"] = [n for n in cpu_ops if any(getattr(torch.ops.aten, n).default in t for t in tables)]
mesh = DeviceMesh("cpu", torch.arange(1), _init_backend=False, _rank=0)
q = DTensor.from_local(torch.randn(2, 2, 8, 4), mesh, [Shard(0)], run_check=False)
lse = DTensor.from_local(torch.randn(2, 2, 8), mesh, [Shard(0)], run_check=False)
try:  # the backward kernel alone (torch 2.13's forward takes a fallback that runs for a minute, then this fails)
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(q, q, q, q, q, lse, 0.0, False)
    found["dtensor_cpu_sdpa"] = "works"
except NotImplementedError as e:
    found["dtensor_cpu_sdpa"] = "broken" if "sharding strategy" in str(e) else repr(e)
with FakeTensorMode():
    q, v, cu = torch.randn(8, 2, 16), torch.randn(8, 2, 8), torch.tensor([0, 8], dtype=torch.int32)
    found["varlen_width"] = varlen_attn(q, q, v, cu, cu, 8, 8).shape[-1]
print(json.dumps(found))
"""
"""torch's own behaviour, in a fresh interpreter that never imports cpcompile."""


@pytest.fixture(scope="module")
def unpatched() -> dict:
    proc = subprocess.run([sys.executable, "-c", UNPATCHED], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _dtensor_sdpa() -> str:
    """SDPA forward and backward on CPU DTensors (a one-rank mesh without a process group), here: patched."""
    mesh = DeviceMesh("cpu", torch.arange(1), _init_backend=False, _rank=0)
    q = DTensor.from_local(torch.randn(2, 2, 8, 4, requires_grad=True), mesh, [Shard(0)], run_check=False)
    F.scaled_dot_product_attention(q, q, q).sum().backward()
    return "works"


def test_versions():
    assert torch_minor("2.14.1+cu130") == "2.14" and torch_minor("2.11.0") == "2.11"
    assert serves(("2.11", "2.13"), "2.13.0+cpu") and not serves(("2.11",), "2.13.0+cpu")


def test_dtensor_cpu_sdpa_is_needed_where_stated(unpatched):
    """Unpatched, the CPU SDPA kernels have no DTensor sharding rule and the backward fails for want of one on the
    releases the module lists (and only there); patched, SDPA forward and backward on CPU DTensors run."""
    needed = serves(dtensor_cpu_sdpa.TORCH_VERSIONS)
    assert unpatched["dtensor_cpu_sdpa"] == ("broken" if needed else "works"), unpatched
    assert (len(unpatched["dtensor_rules"]) < len(dtensor_cpu_sdpa.CPU_OPS)) == needed, unpatched
    assert _dtensor_sdpa() == "works"


def test_dtensor_cpu_sdpa_replaces_no_rule():
    """Registration only fills what torch lacks: called again (or on a torch that has the rules) it adds none."""
    assert all(dtensor_cpu_sdpa.has_rule(op) for op in dtensor_cpu_sdpa.CPU_OPS)
    assert dtensor_cpu_sdpa.register_cpu_sdpa_rules() == []


def test_varlen_fake_is_needed_where_stated(unpatched):
    """Unpatched, the fake gives an MLA call (v's head dim 8, q's 16) q's width on the releases the module lists;
    patched, v's; equal widths keep torch's output."""
    assert unpatched["varlen_width"] == (16 if serves(varlen_fake.TORCH_VERSIONS) else 8), unpatched
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.nn.attention.varlen import varlen_attn

    with FakeTensorMode():
        q, v, cu = torch.randn(8, 2, 16), torch.randn(8, 2, 8), torch.tensor([0, 8], dtype=torch.int32)
        assert varlen_attn(q, q, v, cu, cu, 8, 8).shape[-1] == 8
        assert varlen_attn(q, q, q, cu, cu, 8, 8).shape == q.shape
    assert varlen_fake.fix_varlen_fake() is False  # already wrapped at import


def test_compile_frames_lead_to_the_backend():
    """A compiled call (of a function, of a module) runs inside the frames compile_frames names, each of which
    leads to its backend: a name no compiled call uses any more fails here."""
    found = []

    def backend(gm, example_inputs):
        def run(*args):
            for name, callback in compile_frames.compile_callbacks(sys._getframe()):
                if any(x is backend for x in compile_frames.backend_chain(callback)):
                    found.append(name)
            return gm(*args)

        return run

    torch._dynamo.reset()
    torch.compile(lambda x: x + 1, backend=backend)(torch.ones(2))
    torch.compile(torch.nn.Linear(2, 2), backend=backend)(torch.ones(2))
    assert set(found) == compile_frames.WRAPPER_NAMES and len(found) == 2, found
    assert serves(compile_frames.TORCH_VERSIONS)


def test_eager_attention_hooks_what_torch_has(unpatched):
    """F.scaled_dot_product_attention is torch's builtin until hooked (what guarded_sdpa calls through), and
    varlen_attn's ops are the ones VARLEN_OPS lists for this release, each a custom op with its _init_fn."""
    assert unpatched["sdpa_builtin"] is True
    assert serves(eager_attention.TORCH_VERSIONS)
    import torch.nn.attention.varlen as varlen

    for name, versions in eager_attention.VARLEN_OPS.items():
        op = getattr(varlen, name, None)
        assert (op is not None) == serves(versions), name
        assert op is None or callable(op._init_fn)


def test_eager_attention_is_installed_once():
    import cpcompile

    cpcompile.backend(strategy="flat", inner="eager")  # installs the hooks
    assert F.scaled_dot_product_attention is eager_attention.guarded_sdpa
    q = torch.randn(1, 2, 4, 8)  # no compiled call in progress: torch's own result
    torch.testing.assert_close(F.scaled_dot_product_attention(q, q, q), eager_attention.SDPA(q, q, q))


def test_varlen_gqa_keyword_is_missing_where_stated():
    """varlen_attn lacks enable_gqa on the releases varlen_gqa lists (and only there)."""
    assert (varlen_gqa.VARLEN_GQA_KWARGS == {}) == serves(varlen_gqa.TORCH_VERSIONS)


def test_mesh_flatten_is_there_where_stated():
    """DeviceMesh._flatten (what a 2-D CP mesh's group comes from) exists on the releases mesh_flatten serves."""
    from torch.distributed.device_mesh import DeviceMesh

    assert callable(getattr(DeviceMesh, "_flatten", None)) == serves(mesh_flatten.TORCH_VERSIONS)


def test_graph_break_is_read_from_dynamo():
    """A graph cut at a graph break says so; a frame's whole graph does not."""
    from cpcompile.compat import graph_break

    found = []

    def backend(gm, example_inputs):
        found.append(graph_break.ends_at_graph_break(gm))
        return gm

    def broken(x):
        y = x + 1
        torch._dynamo.graph_break()
        return y * 2

    torch._dynamo.reset()
    torch.compile(broken, backend=backend)(torch.ones(2))
    assert found == [True, False], found
    assert serves(graph_break.TORCH_VERSIONS)


PINS = """
import json, torch, torch.distributed as dist
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
import torch.distributed.nn.functional as f  # imported while the default group exists: defaults bind it
names = [n for n, fn in vars(f).items() if callable(fn) and any(d is dist.group.WORLD for d in getattr(fn, "__defaults__", None) or ())]
print(json.dumps(names))
"""


def test_dist_nn_defaults_pin_the_group_where_stated():
    """torch.distributed.nn.functional, imported while the default group exists, pins it in its defaults (a fresh
    interpreter, no cpcompile); here, unpinned, no function's defaults hold a process group."""
    proc = subprocess.run([sys.executable, "-c", PINS], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    pinned = json.loads(proc.stdout.strip().splitlines()[-1])
    assert bool(pinned) == serves(dist_nn_defaults.TORCH_VERSIONS), pinned
    assert "all_reduce" in pinned or not pinned
    dist_nn_defaults.unpin_default_group()
    assert dist_nn_defaults.pinning_functions() == []


def test_dtensor_planner_cache_is_there_where_stated():
    """DTensor's redistribute planner cache, whose planners keep their meshes, exists where dtensor_planners says,
    and is emptied there."""
    import torch.distributed.tensor._redistribute as redistribute

    if serves(dtensor_planners.TORCH_VERSIONS):
        assert isinstance(getattr(redistribute, "_planner_cache", None), dict)
    released = dtensor_planners.release_planners()
    assert released == hasattr(redistribute, "clear_redistribute_planner_cache")
    if released:
        assert not redistribute._planner_cache
