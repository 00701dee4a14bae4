"""Packed documents under comm="a2a" (thd layout): parity with per-document attention, incl. sliding windows.

One spawn per world size, several cases each (causal, full, windows (w, 0), (l, r); GQA with Hkv < cp and
>= cp; fp64 and bf16; lse returned through return_aux), outputs and q/k/v grads on every rank.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn.attention.varlen import AuxRequest, varlen_attn

import cpcompile
from cpcompile.testing.distributed import run_ranks
from tests.support.parity import _assert_reports, max_err
from tests.support.thd_parity import compare_packed, cu_of, packed_case, window_mask


def _a2a():
    return cpcompile.backend(strategy="thd", comm="a2a", inner="aot_eager")


def _lse_case(world: int, lengths: list[int], heads: tuple[int, int], window: tuple[int, int]) -> dict:
    """(out, lse) of a windowed varlen_attn with return_aux, against per-document masked attention in fp64."""
    cu = cu_of(lengths)
    q, k, v, _ = packed_case(3, int(cu[-1]), *heads, 8)

    def fn(q, k, v, cu):
        return varlen_attn(
            q, k, v, cu, cu, 64, 64, window_size=window, enable_gqa=True, return_aux=AuxRequest(lse=True)
        )

    shard = lambda t, dim=0: cpcompile.shard(t, strategy="thd", seq_dim=dim, cu_seqlens=cu)  # noqa: E731
    torch._dynamo.reset()
    out, lse = torch.compile(fn, backend=_a2a(), fullgraph=True)(shard(q), shard(k), shard(v), cu)
    ref_out, ref_lse = torch.zeros_like(q), torch.zeros(heads[0], q.shape[0], dtype=q.dtype)
    groups = heads[0] // heads[1]
    for a, b in zip(cu.tolist(), cu.tolist()[1:]):
        qd, kd, vd = q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1)
        kd, vd = kd.repeat_interleave(groups, 0), vd.repeat_interleave(groups, 0)
        scores = (qd @ kd.transpose(1, 2) / math.sqrt(8)).masked_fill(~window_mask(b - a, window), float("-inf"))
        ref_lse[:, a:b] = scores.logsumexp(-1)
        ref_out[a:b] = (scores.softmax(-1) @ vd).transpose(0, 1)
    return {"out": (max_err(out, shard(ref_out)), 1e-10), "lse": (max_err(lse, shard(ref_lse, 1)), 1e-5)}


def _sweep(rank, world):
    del rank
    f64, bf16 = torch.float64, torch.bfloat16
    edge = [1, 1, 3 * world, 5, 3 * world + 1]  # 1-token documents and ones spanning several ranks
    mixed = [2, 7, 1, 4 * world + 2, 2 * world]
    if world == 2:
        cases = {
            "causal gqa": dict(causal=True, dtype=f64, lengths=edge, heads=(4, 2)),
            "window (2, 0), 1 kv head": dict(causal=True, dtype=f64, lengths=mixed, heads=(4, 1), window=(2, 0)),
            "window (1, 2)": dict(causal=False, dtype=f64, lengths=edge, heads=(2, 2), window=(1, 2)),
        }
    else:
        cases = {
            "causal bf16, kv heads < cp": dict(causal=True, dtype=bf16, lengths=edge, heads=(4, 1)),
            "full": dict(causal=False, dtype=f64, lengths=mixed, heads=(8, 4)),
            "window (-1, 1), kv heads < cp": dict(causal=False, dtype=f64, lengths=mixed, heads=(4, 2), window=(-1, 1)),
        }
    results = {}
    for name, c in cases.items():
        results[name] = compare_packed(
            "thd",
            c["causal"],
            c["dtype"],
            c["lengths"],
            heads=c["heads"],
            backend=_a2a(),
            window=c.get("window"),
            seed=len(results),
        )
    results["lse window (3, 0)"] = _lse_case(world, mixed, (4, 2), (3, 0))
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_thd_a2a_parity(world):
    _assert_reports(run_ranks(_sweep, world, timeout=600))
