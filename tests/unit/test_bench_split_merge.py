"""bench.thd_cases.fused_split_merge: the THD sweep's cuDNN rows run the provider's split merge compiled, as a
region runs it. The compiled pieces must give the provider's own results (to fp32 rounding: Inductor fuses the
fp32 math, so one ulp may differ; a wrong merge is off by O(1)), and leave the provider as it was."""

from __future__ import annotations

import torch

from bench import thd_cases
from cpcompile.kernels import cudnn_split, cudnn_varlen


def _pieces(t: int, h: int = 2, d: int = 4):
    g = torch.Generator().manual_seed(t)
    o1, o2 = (torch.randn(t, h, d, generator=g, dtype=torch.bfloat16) for _ in range(2))
    l1, l2 = (torch.randn(h, t, generator=g) for _ in range(2))
    rows = torch.rand(t, generator=g) < 0.5
    dark = ~rows & (torch.rand(t, generator=g) < 0.2)
    return o1, l1, o2, l2, rows, dark


def test_the_compiled_merge_is_the_providers_and_is_undone():
    with thd_cases.fused_split_merge():
        assert cudnn_varlen.merge is not cudnn_split.merge
        # the names the provider's forward and backward look up when they run
        for method in (cudnn_varlen.CuDNNVarlenKernel.forward, cudnn_varlen.CuDNNVarlenKernel.backward):
            assert method.__globals__["merge"] is cudnn_varlen.merge
            assert method.__globals__["combine"] is cudnn_varlen.combine
        assert "merge" in cudnn_varlen.CuDNNVarlenKernel.forward.__code__.co_names
        assert "combine" in cudnn_varlen.CuDNNVarlenKernel.backward.__code__.co_names
        for t in (37, 64):  # dynamic shapes: one compile serves both
            o1, l1, o2, l2, rows, dark = _pieces(t)
            for got, want in zip(
                cudnn_varlen.merge(o1, l1, o2, l2, rows, dark), cudnn_split.merge(o1, l1, o2, l2, rows, dark)
            ):
                torch.testing.assert_close(got, want)
            keys = torch.rand(t) < 0.3
            got = cudnn_varlen.combine((o1, o1, o2), (o2, o2, o1), rows, keys, dark)
            want = cudnn_split.combine((o1, o1, o2), (o2, o2, o1), rows, keys, dark)
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b)
    assert (cudnn_varlen.merge, cudnn_varlen.combine) == (cudnn_split.merge, cudnn_split.combine)
