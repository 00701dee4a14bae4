"""backend(deferred_merge=True) on CUDA under Inductor, where the merge after the last step is Inductor's fused
kernel over every step's partial: the ring's output and q/k/v gradients against fp64 attention, with the bf16
rule of tests/gpu/test_gpu.py, dense (zigzag, flat; cuDNN) and packed (thd, thd_zigzag; FA2 varlen). Gloo ranks
sharing one GPU, collectives through host memory (tests/gpu/test_gpu.py says why)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import cpcompile
from cpcompile.testing.distributed import run_ranks
from tests.gpu.test_gpu import _rank_setup, _reference, _varlen_fn, _varlen_reference
from tests.support.parity import bf16_rule, max_err, sdpa_case
from tests.support.roundings import dense_partials, packed_partials, roundings
from tests.support.thd_parity import cu_of, doc_reference, packed_case

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SHAPE = (1, 8, 2, 768, 64)  # batch, q heads, kv heads, global seq, head dim
DOCS = {"thd": [1, 300, 45, 150, 16, 256], "thd_zigzag": [64, 320, 48, 336]}  # 768 tokens, 2cp | every length
NAMES = ("out", "dq", "dk", "dv")


def _backend(strategy: str, kernel: str):
    return cpcompile.backend(strategy=strategy, comm="ring", kernel=kernel, inner="inductor", deferred_merge=True)


def _dense(strategy: str, world: int) -> list[str]:
    q, k, v, dout = sdpa_case(3, *SHAPE)
    exact = _reference(q, k, v, dout, True, torch.float64)
    low = _reference(q, k, v, dout, True, torch.bfloat16)
    shard = lambda t: cpcompile.shard(t.to("cuda", torch.bfloat16), strategy=strategy, seq_dim=2)  # noqa: E731
    leaves = [shard(t).detach().requires_grad_() for t in (q, k, v)]
    torch._dynamo.reset()

    def attn(a, b, c):
        return F.scaled_dot_product_attention(a, b, c, is_causal=True, enable_gqa=True)

    out = torch.compile(attn, backend=_backend(strategy, "auto"), fullgraph=True)(*leaves)
    out.backward(shard(dout))
    partials = dense_partials(strategy, "ring", world, True, SHAPE[1], SHAPE[2])
    failures = []
    for name, g, e, lo in zip(NAMES, [out.detach()] + [t.grad for t in leaves], exact, low):
        err, ref_err = max_err(g, shard(e)), max_err(shard(lo), shard(e))
        allowed = bf16_rule(err, ref_err, torch.bfloat16, roundings(partials[name]))
        if not err <= allowed:
            failures.append(f"{strategy} {name}: error {err:.3g} > allowed {allowed:.3g}")
    return failures


def _packed(strategy: str, world: int) -> list[str]:
    cu = cu_of(DOCS[strategy])
    q, k, v, dout = (t.to("cuda") for t in packed_case(5, int(cu[-1]), 8, 2, 64))
    exact = doc_reference(q, k, v, dout, cu, True, torch.float64, None)
    low = _varlen_reference(q, k, v, dout, cu, True, None)
    shard = lambda t: cpcompile.shard(t.cpu(), strategy=strategy, seq_dim=0, cu_seqlens=cu)  # noqa: E731
    leaves = [shard(t).to("cuda", torch.bfloat16).detach().requires_grad_() for t in (q, k, v)]
    torch._dynamo.reset()
    longest = int((cu[1:] - cu[:-1]).max())
    fn = torch.compile(_varlen_fn(True), backend=_backend(strategy, "flash_varlen"), fullgraph=True)
    out = fn(*leaves, cu.to("cuda"), longest)
    out.backward(shard(dout).to("cuda", torch.bfloat16))
    # a q row gets a bf16 partial from every step that holds pieces of its document (thd_zigzag: two blocks a
    # step for the back chunk), merged in fp32: up to the keys' count (packed_partials counts one varlen call)
    partials = packed_partials(strategy, "ring", world, 8, 2)
    partials["out"] = partials["dq"] = partials["dk"]
    failures = []
    for name, g, e, lo in zip(NAMES, [out.detach()] + [t.grad for t in leaves], exact, low):
        err, ref_err = max_err(g.cpu(), shard(e)), max_err(shard(lo), shard(e))
        allowed = bf16_rule(err, ref_err, torch.bfloat16, roundings(partials[name]))
        if not err <= allowed:
            failures.append(f"{strategy} {name}: error {err:.3g} > allowed {allowed:.3g}")
    return failures


def _sweep(rank, world):
    _rank_setup()
    failures = [f for s in ("zigzag", "flat") for f in _dense(s, world)]
    failures += [f for s in ("thd", "thd_zigzag") for f in _packed(s, world)]
    return [f"rank {rank} {f}" for f in failures]


@pytest.mark.multirank
@pytest.mark.parametrize("world", [2, 4])
def test_gpu_ring_deferred_merge_parity(world):
    failures = [f for fs in run_ranks(_sweep, world, timeout=600) for f in fs]
    assert not failures, "\n".join(failures)
