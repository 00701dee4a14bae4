"""The all-gather region with attention sinks in bf16 rounds its output once: the partial over the local K/V
(one kernel call, in the kernel's bf16) and the partial over the gathered K/V are merged in fp32, the sink folded
in fp32, and only then rounded. Merging into the bf16 local partial rounded the merge, and the sink fold rounded
again (a quarter of the outputs 1 ulp off). One process: the gather is stood in for by the whole sequence's K/V,
packed as the collective would return it (flat, rank 1 of 2: a causal square over its own K/V, a rectangle over
rank 0's)."""

from __future__ import annotations

import torch

from cpcompile import executor
from cpcompile.comms.all_gather import dense as region
from cpcompile.executor.sinks import fold_sinks

SEQ, HQ, HKV, D, WORLD, RANK = 32, 4, 2, 16, 2, 1


def test_local_and_gathered_partials_and_the_sink_are_rounded_once(monkeypatch):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, HQ, SEQ, D, generator=g).bfloat16()
    k, v = (torch.randn(1, HKV, SEQ, D, generator=g).bfloat16() for _ in range(2))
    sinks = torch.randn(HQ, generator=g)
    n = SEQ // WORLD
    mine = slice(RANK * n, (RANK + 1) * n)
    gathered = torch.cat(
        [region.pack_slots(k[:, :, r * n : (r + 1) * n], v[:, :, r * n : (r + 1) * n], 1) for r in range(WORLD)]
    )
    monkeypatch.setattr(region, "start_all_gather", lambda packed, group_name, world: gathered)
    monkeypatch.setattr(region, "wait", lambda pending: pending)
    qr, kr, vr = q[:, :, mine], k[:, :, mine], v[:, :, mine]
    scale = D**-0.5
    got = region.all_gather_attention(
        qr, kr, vr, layout="flat", causal=True, scale=scale, kernel="cpu_flash", group_name="stand-in",
        rank=RANK, world=WORLD, sinks=sinks,
    )  # fmt: skip

    local, remote = region.split_blocks(region.rank_blocks("flat", True, RANK, WORLD, n))
    assert local and remote
    lo, ll = executor.attend(qr, [kr], [vr], region.encode_dense(local), scale, "cpu_flash", None, True)
    ro, rl = executor.attend(qr, [], [], region.encode_dense(remote), scale, "cpu_flash", gathered, True)
    acc, lse = executor.merged([lo.float(), ro.float()], [ll, rl], torch.float32)
    want = fold_sinks(acc, lse, sinks)[0].to(torch.bfloat16)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=0, atol=0)
