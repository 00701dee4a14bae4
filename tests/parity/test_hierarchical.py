"""comm="hierarchical" on a 2-D CP mesh ("cp_inter", "cp_intra") against one process: 4 gloo ranks as 2x2, 6 as
2x3 and 3x2; flat and zigzag, causal and full, GQA (kv heads split, and replicated where a node has more ranks than
kv heads), a sliding window with softcap and sinks, forward and backward in fp64, sharded with the mesh itself
(CP rank = inter rank * intra size + intra rank); packed documents under thd (causal and full, the lse read
through return_aux); and the 2-D mesh's flattened group under a 1-D comm. FSDP2 with
a "dp" dim before the two CP dims ((dp, cp_inter, cp_intra) = (2, 2, 1) on 4 ranks, (2, 1, 3) on 6): TinyLlama
trains like one process on the whole batch. One pool of ranks per world size (aot_eager, tiny shapes)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import cpcompile
from cpcompile.testing.distributed import RankPool
from cpcompile.testing.model import TinyConfig, TinyLlama, token_loss_sum
from cpcompile.testing.varlen_model import GQA
from tests.support.parity import max_err
from tests.support.thd_parity import compare_packed, cu_of, packed_case, window_mask

pytestmark = pytest.mark.multirank

SEQ, D = 48, 8  # divides by 2 * 6: zigzag chunks of 4 tokens at 6 ranks
CASES = {
    # world: [(mesh (inter, intra), strategy, causal, (hq, hkv), comm, feature)]
    4: [
        ((2, 2), "zigzag", True, (4, 2), "hierarchical", None),
        ((2, 2), "flat", False, (2, 2), "hierarchical", None),
        ((2, 2), "flat", True, (4, 1), "hierarchical", None),  # one kv head replicated to both ranks of a node
        ((2, 2), "zigzag", True, (4, 2), "hierarchical", "window"),  # window (5, 0), softcap, sinks
        ((2, 2), "zigzag", True, (4, 2), "a2a", None),  # a 1-D comm over the flattened 2-D group
    ],
    6: [
        ((2, 3), "zigzag", True, (6, 3), "hierarchical", None),
        ((2, 3), "flat", True, (3, 1), "hierarchical", None),
        ((3, 2), "zigzag", False, (4, 2), "hierarchical", None),
        ((3, 2), "zigzag", True, (2, 1), "hierarchical", None),
    ],
}


@pytest.fixture(scope="module", params=sorted(CASES))
def pool(request):
    p = RankPool(request.param)
    yield p
    p.close()


def _attention(causal: bool, feature: str | None, sinks: torch.Tensor | None):
    if feature is None:
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    return lambda q, k, v: cpcompile.attention(q, k, v, is_causal=causal, window=(5, 0), softcap=8.0, sinks=sinks)


def _errors(mesh_shape, strategy, causal, heads, comm, feature) -> dict:
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("cp_inter", "cp_intra"))
    g = torch.Generator().manual_seed(0)
    hq, hkv = heads
    shapes = ((2, hq, SEQ, D), (2, hkv, SEQ, D), (2, hkv, SEQ, D), (2, hq, SEQ, D))
    q, k, v, dout = (torch.randn(s, generator=g, dtype=torch.float64) for s in shapes)
    sinks = torch.randn(hq, generator=g, dtype=torch.float64) if feature else None
    attn = _attention(causal, feature, sinks)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = attn(*leaves)
    ref.backward(dout)
    shard = lambda t: cpcompile.shard(t, strategy=strategy, seq_dim=2, mesh=mesh)  # noqa: E731
    local = [shard(t).requires_grad_() for t in (q, k, v)]
    be = cpcompile.backend(strategy=strategy, comm=comm, mesh=mesh, inner="aot_eager")
    torch._dynamo.reset()
    out = torch.compile(attn, backend=be, fullgraph=True)(*local)
    out.backward(shard(dout))
    (plan,) = be.plans
    assert plan.comm == comm and plan.group.level_sizes == mesh_shape, (plan.comm, plan.group)
    errs = {"out": max_err(out, shard(ref))}
    errs.update({name: max_err(t.grad, shard(r.grad)) for name, t, r in zip(("dq", "dk", "dv"), local, leaves)})
    return errs


DOCS = [5, 1, 20, 3, 7, 12, 24]  # 72 tokens: 18 a rank at 4, 12 at 6; documents span ranks and nodes
PACKED = {  # world: [(mesh, causal, (hq, hkv))]
    4: [((2, 2), True, (4, 2)), ((2, 2), False, (4, 1))],
    6: [((2, 3), True, (6, 3)), ((3, 2), True, (4, 2))],
}


def _packed_errors(mesh_shape, causal, heads) -> dict:
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("cp_inter", "cp_intra"))
    be = cpcompile.backend(strategy="thd", comm="hierarchical", mesh=mesh, inner="aot_eager")
    report = compare_packed("thd", causal, torch.float64, DOCS, heads=heads, backend=be)
    (plan,) = be.plans
    assert plan.comm == "hierarchical" and plan.group.level_sizes == mesh_shape, (plan.comm, plan.group)
    return {name: err for name, (err, _) in report.items()}


def _lse_errors(mesh_shape, heads) -> dict:
    """(out, lse) of causal varlen_attn with return_aux against per-document attention in fp64."""
    from torch.nn.attention.varlen import AuxRequest, varlen_attn

    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("cp_inter", "cp_intra"))
    cu = cu_of(DOCS)
    q, k, v, _ = packed_case(3, int(cu[-1]), *heads, D)

    def fn(q, k, v, cu):
        aux = AuxRequest(lse=True)
        return varlen_attn(q, k, v, cu, cu, 24, 24, window_size=(-1, 0), return_aux=aux, **GQA)

    shard = lambda t, dim=0: cpcompile.shard(t, strategy="thd", seq_dim=dim, cu_seqlens=cu, mesh=mesh)  # noqa: E731
    be = cpcompile.backend(strategy="thd", comm="hierarchical", mesh=mesh, inner="aot_eager")
    torch._dynamo.reset()
    out, lse = torch.compile(fn, backend=be, fullgraph=True)(shard(q), shard(k), shard(v), cu)
    ref_out, ref_lse = torch.zeros_like(q), torch.zeros(heads[0], q.shape[0], dtype=q.dtype)
    groups = heads[0] // heads[1]
    for a, b in zip(cu.tolist(), cu.tolist()[1:]):
        qd, kd, vd = q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1)
        kd, vd = kd.repeat_interleave(groups, 0), vd.repeat_interleave(groups, 0)
        scores = (qd @ kd.transpose(1, 2) / D**0.5).masked_fill(~window_mask(b - a, (-1, 0)), float("-inf"))
        ref_lse[:, a:b] = scores.logsumexp(-1)
        ref_out[a:b] = (scores.softmax(-1) @ vd).transpose(0, 1)
    return {"out": max_err(out, shard(ref_out)), "lse": max_err(lse, shard(ref_lse, 1))}


def _run(rank, world):
    results = {case: _errors(*case) for case in CASES[world]}
    results.update({("thd", *case): _packed_errors(*case) for case in PACKED[world]})
    mesh_shape, _, heads = PACKED[world][0]
    results[("thd lse", mesh_shape)] = _lse_errors(mesh_shape, heads)
    return results


def test_hierarchical_parity(pool):
    per_rank = pool.run(_run, timeout=600)
    allowed = {"lse": 1e-5}  # returned in fp32, as varlen_attn returns it; everything else fp64
    bad = {
        (r, c, name): err
        for r, found in enumerate(per_rank)
        for c, errs in found.items()
        for name, err in errs.items()
        if not err <= allowed.get(name, 1e-10)
    }
    assert not bad, bad


FSDP_MESH = {4: (2, 2, 1), 6: (2, 1, 3)}  # (dp, cp_inter, cp_intra): every dim of size > 1 somewhere
CFG = TinyConfig(dim=48, heads=6, kv_heads=3, hidden=64)
ROWS, STEPS = 2, 2  # rows a dp rank, SGD steps


def _batch(dp: int):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, CFG.vocab, (dp * ROWS, SEQ), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full((dp * ROWS, 1), -100)], 1)
    labels[0, :5] = -100  # uneven targets across ranks: each rank divides by the global count
    return ids, labels


def _steps(model, loss_of) -> list:
    """(loss, every parameter's gradient) of STEPS SGD steps; the parameters after them."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    out = []
    for _ in range(STEPS):
        loss = loss_of()
        loss.backward()
        out.append((loss.detach().clone(), {k: p.grad.detach().clone() for k, p in model.named_parameters()}))
        opt.step()
        opt.zero_grad()
    return out, dict(model.named_parameters())


def _fsdp_errors(rank, world) -> dict:
    """FSDP2 over the flattened (dp, cp_inter, cp_intra) mesh (its reduce-scatter sums the CP ranks' partial grads and
    the dp replicas'), the 3-D mesh given as it is to shard_batch and the backend (its two CP dims are the CP group)."""
    dp, inter, intra = FSDP_MESH[world]
    mesh = init_device_mesh("cpu", (dp, inter, intra), mesh_dim_names=("dp", "cp_inter", "cp_intra"))
    ids, labels = _batch(dp)
    count = (labels != -100).sum()
    torch.manual_seed(0)
    ref = TinyLlama(CFG).double()
    pos = torch.arange(SEQ).expand(dp * ROWS, SEQ)
    ref_steps, ref_params = _steps(ref, lambda: token_loss_sum(ref(ids, pos), labels) / count)

    torch.manual_seed(0)
    model = TinyLlama(CFG).double()
    be = cpcompile.backend(strategy="zigzag", comm="hierarchical", mesh=mesh, inner="aot_eager")
    for block in model.blocks:
        block.compile(backend=be, fullgraph=True)
    flat = mesh._flatten("dp_cp")
    for module in (*model.blocks, model):
        fully_shard(module, mesh=flat)
    for m in model.modules():
        if hasattr(m, "set_gradient_divide_factor"):
            m.set_gradient_divide_factor(1.0)  # sum over ranks: each rank's loss is already / the global count
    mine = slice(mesh.get_local_rank("dp") * ROWS, (mesh.get_local_rank("dp") + 1) * ROWS)
    local = cpcompile.shard_batch({"input_ids": ids[mine], "labels": labels[mine]}, strategy="zigzag", mesh=mesh)
    steps, params = _steps(model, lambda: token_loss_sum(model(local["input_ids"], local["position_ids"]),
                                                         local["labels"]) / count)  # fmt: skip
    errors = {"plans": float(not be.plans or any(p.comm != "hierarchical" for p in be.plans))}
    for (loss, grads), (ref_loss, ref_grads) in zip(steps, ref_steps):
        dist.all_reduce(loss)  # the ranks' shares sum to the global mean loss
        errors["loss"] = max(errors.get("loss", 0.0), abs(loss.item() - ref_loss.item()))
        grad = max((g.full_tensor() - ref_grads[k]).abs().max().item() for k, g in grads.items())
        errors["grads"] = max(errors.get("grads", 0.0), grad)
    errors["params"] = max((p.detach().full_tensor() - ref_params[k]).abs().max().item() for k, p in params.items())
    return errors


def test_fsdp2_on_a_dp_dim_before_the_cp_dims(pool):
    per_rank = pool.run(_fsdp_errors, timeout=600)
    # the loss is summed in fp32 (token_loss_sum), everything else is fp64
    bad = [(r, e) for r, e in enumerate(per_rank) if not (e["plans"] == 0 and e["loss"] < 1e-5 and
                                                       max(e["grads"], e["params"]) < 1e-12)]  # fmt: skip
    assert not bad, bad
