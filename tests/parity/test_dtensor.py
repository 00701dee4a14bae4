"""DTensor in, DTensor out: CP attention on sequence-sharded DTensors vs single-process SDPA (outputs and grads),
the sharding helpers against distribute_tensor/full_tensor, and a whole model in DTensor form staying local."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.experimental import implicit_replication

import cpcompile
from cpcompile.testing.distributed import run_ranks
from cpcompile.testing.model import TinyLlama, token_loss_sum
from tests.support.dtensor import TOL, _dtensor_attention_errors
from tests.support.parity import max_err


def _helpers_errors(mesh) -> dict:
    """Flat shard/unshard against distribute_tensor/to_local/full_tensor, values and gradients."""
    x = torch.randn(2, 12, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    dt = distribute_tensor(x, mesh, [Shard(1)])
    local = cpcompile.shard(x, strategy="flat", seq_dim=1, mesh=mesh)
    errs = {
        "shard == distribute.to_local": max_err(local, dt.to_local()),
        "as_dtensor == distribute": max_err(
            cpcompile.shard(x, strategy="flat", seq_dim=1, mesh=mesh, as_dtensor=True).full_tensor(), x
        ),
        "unshard(local) == full_tensor": max_err(
            cpcompile.unshard(dt.to_local(), strategy="flat", seq_dim=1, mesh=mesh), dt.full_tensor()
        ),
    }
    leaf = dt.detach().requires_grad_()
    w = torch.randn(2, 12, 3, dtype=torch.float64)
    (cpcompile.unshard(leaf, strategy="flat") * w).sum().backward()
    ref = dt.detach().requires_grad_()
    (ref.full_tensor() * w).sum().backward()
    errs["unshard(DTensor) grad == full_tensor grad"] = max_err(leaf.grad.to_local(), ref.grad.to_local())
    return errs


def _model_errors(mesh) -> dict:
    """TinyLlama with replicated DTensor params and Shard(1) DTensor inputs: logits, loss, param grads vs one
    process, and the forward graph's only collectives are the K/V all-gathers (token-wise ops stay local)."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified

    torch.manual_seed(0)
    ref_model = TinyLlama().double()
    model = TinyLlama().double()
    model.load_state_dict(ref_model.state_dict())
    distribute_module(model, mesh)  # every parameter Replicate on the CP mesh
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 128, (2, 16), generator=g)
    pos = torch.arange(16).expand(2, 16)
    labels = torch.randint(0, 128, (2, 16), generator=g)
    ref_logits = ref_model(ids, pos)
    token_loss_sum(ref_logits, labels).backward()

    be = cpcompile.backend(strategy="flat", inner="aot_eager")
    forward_graphs = []

    def record_forward(gm, _):
        forward_graphs.append(gm.code)
        return make_boxed_func(gm.forward)

    def backend(gm, example_inputs):  # cpcompile's pass, then aot_eager that also records the forward graph
        boxed = lambda g, _: make_boxed_func(g.forward)  # noqa: E731
        return aot_module_simplified(be.transform(gm), example_inputs, fw_compiler=record_forward, bw_compiler=boxed)

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    shard = lambda t: cpcompile.shard(t, strategy="flat", seq_dim=1, mesh=mesh, as_dtensor=True)  # noqa: E731
    with implicit_replication():  # rope builds its frequencies with a plain torch.arange
        logits = compiled(shard(ids), shard(pos))
    assert isinstance(logits, DTensor) and logits.placements == (Shard(1),), logits
    local_labels = cpcompile.shard(labels, strategy="flat", seq_dim=1, mesh=mesh)
    token_loss_sum(logits.to_local(), local_labels).backward()
    ops = [ln.split("(")[0].split(".")[-2] for c in forward_graphs for ln in c.splitlines() if "_c10d_" in ln]
    collectives = [op for op in ops if op != "wait_tensor"]
    assert collectives == ["all_gather_into_tensor"] * model.cfg.layers, collectives
    errs = {"logits": max_err(logits.full_tensor(), ref_logits.detach())}
    for (name, p), rp in zip(model.named_parameters(), ref_model.parameters()):
        errs[f"grad {name}"] = max_err(p.grad.full_tensor(), rp.grad)  # Partial(sum) over CP -> summed
    return errs


def _sweep(rank, world):
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    report = {}
    for strategy in ("flat", "zigzag"):
        for causal in (True, False):
            for dtype in (torch.float32, torch.float64):
                errs = _dtensor_attention_errors(mesh, strategy, causal, dtype)
                report.update({(strategy, causal, str(dtype), k): (e, TOL[dtype]) for k, e in errs.items()})
    report.update({(k,): (e, 1e-14) for k, e in _helpers_errors(mesh).items()})
    if world == 2:
        report.update({("model", k): (e, 1e-10) for k, e in _model_errors(mesh).items()})
    if world == 4:  # 2-D (dp, cp) mesh: batch Shard(0) over dp, sequence Shard(2) over cp
        mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
        dp = mesh2.get_local_rank("dp")
        for strategy in ("flat", "zigzag"):
            errs = _dtensor_attention_errors(mesh2, strategy, True, torch.float64, dp_slice=slice(dp, dp + 1))
            report.update({("2d", strategy, k): (e, TOL[torch.float64]) for k, e in errs.items()})
    return report


@pytest.mark.parametrize("world", [2, 4])
def test_dtensor_parity(world):
    failures = [
        f"rank {rank} {case}: error {err:.3g} > {tol:.3g}"
        for rank, report in enumerate(run_ranks(_sweep, world, timeout=500))
        for case, (err, tol) in report.items()
        if not err <= tol
    ]
    assert not failures, "\n".join(failures)
