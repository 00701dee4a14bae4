"""kernel="auto" with several CUDA providers, under every comm: what a GPU does, on CPU.

On CPU only one provider runs a site, so the cost model is never asked there; on CUDA kernel="auto" costs every
provider that can run the site under the NAMED comm too (comm="ring" crashed there once: the ring had no wire
bytes). Here the CUDA providers are replaced by stand-ins that claim the CPU and compute with the CPU kernels,
so each comm x layout plans with a real cost-model choice among cudnn / flash (varlen: cudnn_varlen /
flash_varlen) and then runs forward and backward on a fake process group (one rank of 4).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.varlen import varlen_attn

import cpcompile
from cpcompile import kernels
from cpcompile.comms.registry import COMMS
from cpcompile.testing.varlen_model import GQA
from tests.support.fake_pg import fake_group

WORLD, RANK = 4, 1


class StandIn:
    """A CUDA provider's name over a CPU provider's arithmetic: it claims every device and dtype it can run."""

    def __init__(self, cpu_provider):
        self._cpu = cpu_provider

    def supports(self, device, dtype):
        return self._cpu.supports(torch.device("cpu"), dtype)

    def __getattr__(self, name):
        return getattr(self._cpu, name)


@pytest.fixture
def cuda_stand_ins(monkeypatch):
    dense = {name: StandIn(kernels.PROVIDERS["cpu_flash"]) for name in ("cudnn", "flash")}
    packed = {name: StandIn(kernels.VARLEN_PROVIDERS["cpu_varlen_ref"]) for name in ("cudnn_varlen", "flash_varlen")}
    monkeypatch.setattr(kernels, "PROVIDERS", {**kernels.PROVIDERS, **dense})
    monkeypatch.setattr(kernels, "VARLEN_PROVIDERS", {**kernels.VARLEN_PROVIDERS, **packed})


def _compile_and_run(fn, be, *inputs):
    torch._dynamo.reset()
    out = torch.compile(fn, backend=be, fullgraph=True)(*inputs)
    out = out[0] if isinstance(out, tuple) else out
    out.float().sum().backward()
    return be.plans


@pytest.mark.parametrize("comm", [n for n, c in COMMS.items() if c.serves("sdpa") and not c.capabilities.levels])
@pytest.mark.parametrize("layout", ["flat", "zigzag"])
def test_dense_auto_kernel_under_every_comm(cuda_stand_ins, comm, layout):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 32, 16, generator=g, requires_grad=True) for h in (8, 4, 4))

    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    with fake_group(RANK, WORLD):
        plans = _compile_and_run(fn, cpcompile.backend(strategy=layout, comm=comm, inner="aot_eager"), q, k, v)
    (plan,) = plans
    assert plan.comm == comm and plan.choice is not None, plan
    assert {o.kernel for o in plan.choice.options} == {"cudnn", "flash", "cpu_flash"}
    assert plan.kernel == plan.choice.chosen.kernel


@pytest.mark.parametrize(
    "comm, layout",
    [
        (c, s)
        for c in COMMS
        for s in ("thd", "thd_zigzag")
        if s in COMMS[c].capabilities.packed_layouts and not COMMS[c].capabilities.levels  # 1-D group here
    ],
)
def test_packed_auto_kernel_under_every_comm(cuda_stand_ins, comm, layout):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(16, h, 16, generator=g, requires_grad=True) for h in (8, 4, 4))
    cu = torch.tensor([0, 16, 48, 64], dtype=torch.int32)

    def fn(q, k, v, cu):
        return varlen_attn(q, k, v, cu, cu, 32, 32, window_size=(-1, 0), **GQA)

    with fake_group(RANK, WORLD):
        plans = _compile_and_run(fn, cpcompile.backend(strategy=layout, comm=comm, inner="aot_eager"), q, k, v, cu)
    (plan,) = plans
    assert plan.comm == comm and plan.choice is not None, plan
    assert {o.kernel for o in plan.choice.options} == {"cudnn_varlen", "flash_varlen", "cpu_varlen_ref"}
    assert plan.kernel == plan.choice.chosen.kernel


@pytest.mark.parametrize("comm", [c for c in COMMS if "thd_balanced" in COMMS[c].capabilities.packed_layouts])
def test_thd_balanced_auto_kernel_is_costed(cuda_stand_ins, comm):
    """thd_balanced's blocks come from each batch's plan, and the planner costs its kernels with the plan of the
    assumed documents, as it does its comms: it once took the first provider in VARLEN_AUTO_ORDER uncosted, so
    the FA2-first order ran FA2 at every shard length, where cuDNN is faster on long shards."""
    g = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 16, 48, 64], dtype=torch.int32)
    with fake_group(RANK, WORLD):
        model_cu = cpcompile.plan_documents(cu, strategy="thd_balanced")
        x = torch.randn(64, 8, 16, generator=g)
        q, k, v = (
            cpcompile.shard(t[:, :h].contiguous(), strategy="thd_balanced", seq_dim=0, cu_seqlens=model_cu)
            .detach()
            .requires_grad_()
            for t, h in ((x, 8), (x, 4), (x * 0.5, 4))
        )

        def fn(q, k, v, cu):
            return varlen_attn(q, k, v, cu, cu, 32, 32, window_size=(-1, 0), **GQA)

        be = cpcompile.backend(strategy="thd_balanced", comm=comm, inner="aot_eager")
        plans = _compile_and_run(fn, be, q, k, v, model_cu)
    (plan,) = plans
    assert plan.comm == comm and plan.choice is not None, plan
    assert {o.kernel for o in plan.choice.options} == {"cudnn_varlen", "flash_varlen", "cpu_varlen_ref"}
    assert plan.kernel == plan.choice.chosen.kernel
