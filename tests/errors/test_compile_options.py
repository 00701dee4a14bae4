"""torch.compile(mode=..., options=...) with the cpcompile backend: the mode's and the options' Inductor config
reach Inductor (with the CP regions' own patches); inner compilers that take no config refuse them with one
CPCompileError; a callable inner gets them as torch.compile would pass them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import cpcompile
from cpcompile.backend import INDUCTOR_OVERLAP_PATCHES
from cpcompile.inductor_cache import CodeKey
from tests.support.errors import cp_error
from tests.support.fake_pg import fake_group


def _attn(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True) * 2


def _qkv():
    return [torch.randn(1, 2, 8, 4) for _ in range(3)]


@pytest.fixture
def recorded(monkeypatch):
    """Inductor replaced by a recorder of its config patches (the graph then runs eagerly)."""
    import torch._inductor.compile_fx as cfx

    seen = []

    def fake_compile_fx(gm, example_inputs, config_patches=None, **kwargs):
        patches = dict(config_patches or {})
        # every graph with CP regions keys Inductor's caches on cpcompile's code (inductor_cache.py)
        assert isinstance(patches.pop("post_grad_custom_post_pass", None), CodeKey)
        seen.append(patches)
        return gm.forward

    monkeypatch.setattr(cfx, "compile_fx", fake_compile_fx)
    return seen


def _run(backend, **compile_kwargs):
    with fake_group(0, 2):
        torch._dynamo.reset()
        torch.compile(_attn, backend=backend, fullgraph=True, **compile_kwargs)(*_qkv())


def test_mode_reaches_inductor(recorded):
    _run(cpcompile.backend(strategy="zigzag"), mode="max-autotune-no-cudagraphs")
    assert recorded == [{"max_autotune": True, "coordinate_descent_tuning": True, **INDUCTOR_OVERLAP_PATCHES}]


def test_options_reach_inductor(recorded):
    _run(cpcompile.backend(strategy="zigzag"), options={"epilogue_fusion": False})
    assert recorded == [{"epilogue_fusion": False, **INDUCTOR_OVERLAP_PATCHES}]


def test_user_options_win_over_the_overlap_patch(recorded):
    _run(cpcompile.backend(strategy="zigzag"), options={"reorder_for_peak_memory": True})
    assert recorded == [{"reorder_for_peak_memory": True}]


def test_registered_name_takes_mode(recorded):
    _run("cpcompile", mode="max-autotune-no-cudagraphs")
    assert recorded and recorded[0]["max_autotune"] is True


def test_callable_inner_gets_them_as_torch_compile_passes_them():
    seen = []

    def inner(gm, example_inputs, **kwargs):
        seen.append(kwargs)
        return gm.forward

    _run(cpcompile.backend(strategy="zigzag", inner=inner), options={"x": 1})
    _run(cpcompile.backend(strategy="zigzag", inner=inner), mode="reduce-overhead")
    assert seen == [{"options": {"x": 1}}, {"mode": "reduce-overhead"}]


@pytest.mark.parametrize("inner", ["aot_eager", "eager"])
def test_non_inductor_inner_refuses_them(inner):
    with pytest.raises(Exception) as excinfo:
        _run(cpcompile.backend(strategy="zigzag", inner=inner), mode="max-autotune-no-cudagraphs")
    assert "mode and options configure Inductor" in str(cp_error(excinfo))
    assert "Fix: drop mode=/options=, or use inner='inductor'" in str(cp_error(excinfo))


def test_unknown_option_is_one_clear_error(recorded):
    with pytest.raises(Exception) as excinfo:
        _run(cpcompile.backend(strategy="zigzag"), options={"no_such_option": 1})
    assert "not an Inductor option" in str(cp_error(excinfo))
    assert recorded == []


def test_deferred_merge_only_with_the_ring():
    for comm in ("all_gather", "a2a", "selective", "auto"):
        with pytest.raises(
            cpcompile.CPCompileError, match=rf"deferred_merge=True with comm='{comm}'.*Fix: drop deferred_merge"
        ):
            cpcompile.backend(strategy="zigzag" if comm != "selective" else "thd", comm=comm, deferred_merge=True)
    cpcompile.backend(strategy="zigzag", comm="ring", deferred_merge=True)  # no error
