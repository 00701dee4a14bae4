"""bench.thd_cases' kernels-alone timings prepare each block's metadata once, before the timed calls, as a region
prepares it once per batch (records: `kernels_prepared`); the timed calls get it as `prepared=` and build none."""

from __future__ import annotations

import pytest

from bench import thd_cases
from cpcompile.kernels import get_varlen_kernel

KERNEL = "cpu_varlen_ref"


@pytest.fixture
def counted(monkeypatch):
    """The CPU reference provider on CPU tensors, its prepare calls and the prepared= its calls get, counted."""
    monkeypatch.setattr(thd_cases, "DEVICE", "cpu")
    impl = type(get_varlen_kernel(KERNEL))
    seen = {"prepare": 0, "calls": []}
    prepare, forward, backward = impl.prepare, impl.forward, impl.backward

    def counting_prepare(self, *args, **kwargs):
        seen["prepare"] += 1
        return prepare(self, *args, **kwargs)

    def recording(method):
        def run(self, *args, **kwargs):
            seen["calls"].append(kwargs.get("prepared"))
            return method(self, *args, **kwargs)

        return run

    monkeypatch.setattr(impl, "prepare", counting_prepare)
    monkeypatch.setattr(impl, "forward", recording(forward))
    monkeypatch.setattr(impl, "backward", recording(backward))
    return seen


@pytest.mark.parametrize("layout", ["thd", "thd_balanced"])
def test_all_gather_kernels_alone_prepare_once(counted, layout):
    lengths, cp = [96, 160, 48, 208], 2
    case = thd_cases.rank_case(layout, lengths, cp, 1)
    run = thd_cases.kernels_only_fn(*case, KERNEL)
    built, counted["calls"] = counted["prepare"], []
    run()
    run()
    assert counted["prepare"] == built  # nothing prepared inside the timed calls
    assert len(counted["calls"]) == 2 * 2 * len(case[4]) and all(p is not None for p in counted["calls"])


def test_a2a_kernel_alone_prepares_once(counted):
    case = thd_cases.a2a_rank_case([96, 160, 48, 208], 2, "thd")
    run = thd_cases.a2a_kernels_only_fn(*case, 2, KERNEL, "thd")
    built, counted["calls"] = counted["prepare"], []
    run()
    assert counted["prepare"] == built == 1
    forward, backward = counted["calls"]
    assert isinstance(forward, list) and backward is forward  # the one prepared list, built before the calls


def test_model_cu_plans_are_kept_per_device(monkeypatch):
    """A plan made for one device is not handed to a run on another (a CPU smoke test and a GPU run may share a
    process): thd_cases.model_cu's cache is keyed by the device as well as the layout, documents and cp."""
    lengths = [96, 32, 128]
    monkeypatch.setattr(thd_cases, "DEVICE", "meta")
    assert thd_cases.model_cu("thd_balanced", lengths, 2)[0].device.type == "meta"
    monkeypatch.setattr(thd_cases, "DEVICE", "cpu")
    assert thd_cases.model_cu("thd_balanced", lengths, 2)[0].device.type == "cpu"
