"""Multi-rank parity of comm="a2a" (Ulysses) against single-process SDPA, and a small-model training run."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from cpcompile.testing.distributed import run_ranks
from cpcompile.testing.training import train
from tests.support.dtensor import TOL, _dtensor_attention_errors
from tests.support.parity import _assert_reports, compare_sdpa
from tests.support.training import CFG, _assert_matches, _batches

# (batch, q heads, kv heads, global seq, head dim). With cp=2 and cp=4: "gqa" has kv heads >= cp (2 each) and
# kv heads < cp (each kv head replicated to 2 ranks); "kv1" replicates its one kv head to every rank.
SHAPES = {"gqa": (2, 4, 2, 48, 16), "kv1": (1, 4, 1, 48, 8)}


def _sweep(rank, world, llama_strategy):
    results = {}
    for strategy in ("flat", "zigzag"):
        for shape_name, shape in SHAPES.items():
            for causal in (True, False):
                scale = 0.37 if shape_name == "kv1" and causal else None
                results[(strategy, shape_name, causal, "fp32")] = compare_sdpa(
                    strategy, causal, torch.float32, shape, comm="a2a", scale=scale
                )
        results[(strategy, "kv1", True, "bf16")] = compare_sdpa(
            strategy, True, torch.bfloat16, SHAPES["kv1"], comm="a2a"
        )
    # DTensor inputs; at cp=2 of a (dp=2, cp=2) mesh the all-to-alls run on the cp sub-group, not the world
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    dp_slice = slice(None)
    if world == 4:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
        dp_slice = slice(mesh.get_local_rank("dp"), mesh.get_local_rank("dp") + 1)
    errs = _dtensor_attention_errors(mesh, "zigzag", True, torch.float64, dp_slice=dp_slice, comm="a2a")
    results[("dtensor", "zigzag", True, "fp64")] = {k: (e, TOL[torch.float64]) for k, e in errs.items()}
    return results, train(CFG, _batches(), strategy=llama_strategy, comm="a2a")


@pytest.mark.parametrize("world,llama_strategy", [(2, "flat"), (4, "zigzag")])
def test_a2a_parity(world, llama_strategy):
    """Outputs and q/k/v grads for flat and zigzag, causal or not, GQA with kv heads >= and < cp, fp32 and
    bf16; TinyLlama (4 q heads, 2 kv heads: replicated at cp=4) trains like the single-process model."""
    per_rank = run_ranks(_sweep, world, llama_strategy, timeout=600)
    _assert_reports([sdpa for sdpa, _ in per_rank])
    _assert_matches([training for _, training in per_rank], "aot_eager")
