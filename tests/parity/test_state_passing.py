"""Multi-rank parity of state passing (token_mixer(comm="state")) against one process: a Gated DeltaNet model (a
causal conv with a halo from the previous rank, the gated delta rule with its chunk transitions all-gathered and
composed) around a softmax attention block, cp 2, 3 and 4, fp64, under flat (one chunk a rank) and zigzag (two chunks
a rank, r and 2cp-1-r: each chunk's halo and state come from the chunk before it in sequence order, the attention
keeps its zigzag balance); and HF Qwen3-Next under hf_token_mixers(comm="state") at cp 2, flat and zigzag. Logits, loss and every parameter gradient, gloo ranks, aot_eager. One pool
of 4 ranks: cp=4, cp=2 as the "cp" dim of a (dp=2, cp=2) mesh, cp=3 as a group of ranks 0-2."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import cpcompile
from cpcompile.mixers.relayout import relayout
from cpcompile.testing.distributed import RankPool
from tests.support.gdn import GDNModel
from tests.support.hybrid import hf_hybrid
from tests.support.parity import rel_err

BATCH, VOCAB = 2, 32
TOL = 1e-9
HF_TOL = 1e-5
"""HF's gated delta rule computes in fp32 inside an fp64 model, and state passing splits its chunks at the rank edges
(and adds P @ S in fp32), so it rounds differently from the one process, where a2a rounds alike: measured 4.0e-6 on
the A_log and dt_bias gradients at cp 2 (a2a: 1.4e-7); with HF's function patched to compute in fp64 the same run is
1.3e-7 everywhere (the model's own fp32 decay), so the difference is the scan's fp32 rounding."""
HF_FP64_TOL = 1e-6
"""Zigzag at cp 2 needs 16 tokens (4 a chunk, more than the conv's 3-token halo), where the fp32 rounding above is
larger: flat itself measures 1.0e-5 there (2.6e-5 at 12 tokens), zigzag 1.45e-5 (its four chunk edges against flat's
two), all on the A_log and dt_bias gradients, whose sums over tokens cancel. So the zigzag run calls HF's own scan
code computing in fp64 (`fp64_scan`: its source with float32 -> float64) and is held to 1e-6, ten times tighter
than flat's bound: measured 1.6e-7 (flat: 1.1e-7), the model's own fp32 decay (`A_log.float()`)."""


def fp64_scan():
    """HF Qwen3-Next's torch_chunk_gated_delta_rule, its source with every float32 made float64, declared with
    hf_token_mixers' own keywords for comm="state" (HF_MIXERS, HF_STATE)."""
    import ast
    import inspect

    import transformers.models.qwen3_next.modeling_qwen3_next as modeling

    from cpcompile.mixers.hf import HF_MIXERS, HF_STATE

    name = "torch_chunk_gated_delta_rule"
    module_source = inspect.getsource(modeling)  # the module attribute is the declared function by now
    found = next(n for n in ast.parse(module_source).body if isinstance(n, ast.FunctionDef) and n.name == name)
    source = ast.get_source_segment(module_source, found)  # from `def`, without the hub decorator
    assert "torch.float32" in source, "HF's scan no longer casts to float32: revisit this test"
    namespace = dict(vars(modeling))
    exec(source.replace("torch.float32", "torch.float64"), namespace)
    return cpcompile.token_mixer(namespace[name], comm="state", **HF_MIXERS[name], **HF_STATE[name])


def _compare(rank, world, cp, name="gdn", strategy="flat", mixer_layout="same"):
    torch._dynamo.reset()
    torch.manual_seed(0)
    # 4 tokens a chunk: more than the conv's 3-token halo, fewer than HF's 64-token chunk (zigzag: 2 chunks a rank)
    seq = 4 * cp * (2 if strategy == "zigzag" else 1)
    if mixer_layout == "flat":  # 10 tokens a rank: a size no other dim of GDNModel has (relayout_plan.py's rule)
        seq = 5 * cp * 2
    if name != "gdn" or world % cp:  # ranks 0..cp-1 (every rank creates the group); the others idle
        group = dist.new_group(list(range(cp)))
        if rank >= cp:
            return {}
        where = {"group": group}
    else:
        mesh = init_device_mesh("cpu", (world // cp, cp), mesh_dim_names=("dp", "cp"))
        group, where = mesh.get_group("cp"), {"mesh": mesh}
    if name == "gdn":
        model = GDNModel().double()
    else:
        model = hf_hybrid(name, cp, VOCAB).double()
        assert len(cpcompile.hf_token_mixers(model, comm="state")) == 2
        if strategy == "zigzag":  # HF's scan in fp64 (HF_FP64_TOL), restored below
            import transformers.models.qwen3_next.modeling_qwen3_next as modeling

            declared = modeling.torch_chunk_gated_delta_rule
            modeling.torch_chunk_gated_delta_rule = fp64_scan()
            try:
                return _run(model, group, where, seq, strategy, name, mixer_layout)
            finally:
                modeling.torch_chunk_gated_delta_rule = declared
    return _run(model, group, where, seq, strategy, name, mixer_layout)


def _run(model, group, where, seq: int, strategy: str, name: str, mixer_layout: str = "same") -> dict:
    """The one-process run and the CP run of `model` on the same ids: the relative error of each output."""
    ids = torch.randint(0, VOCAB, (BATCH, seq))
    labels = torch.randint(0, VOCAB, (BATCH, seq))
    cp_model = copy.deepcopy(model)
    positions = () if name == "gdn" else (torch.arange(seq).expand(BATCH, seq),)

    logits = model(ids, *positions)
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / labels.numel()
    loss.backward()

    def local(x):
        return cpcompile.shard(x, strategy=strategy, seq_dim=1, **where)

    relayouts = []  # mixer_layout="flat": the relayout calls the pass inserted (there must be some)

    def inner(gm, example_inputs):
        relayouts.extend(n for n in gm.graph.nodes if n.target is relayout)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    options = dict(mixer_layout=mixer_layout, inner=inner if mixer_layout == "flat" else "aot_eager")
    be = cpcompile.backend(strategy=strategy, comm="all_gather", **options, **where)
    out = torch.compile(cp_model, backend=be, fullgraph=True)(local(ids), *(local(p) for p in positions))
    cp_loss = F.cross_entropy(out.flatten(0, 1), local(labels).flatten(), reduction="sum") / labels.numel()
    cp_loss.backward()
    assert mixer_layout != "flat" or relayouts, "mixer_layout='flat' inserted no relayout"
    summed = cp_loss.detach().clone()
    dist.all_reduce(summed, group=group)
    full = cpcompile.unshard(out.detach(), strategy=strategy, seq_dim=1, **where)
    errors = {"logits": rel_err(full, logits.detach()), "loss": rel_err(summed, loss.detach())}
    grads = dict(model.named_parameters())
    for param, p in cp_model.named_parameters():
        if p.grad is None:  # an expert no token was routed to, in both runs (checked here)
            assert grads[param].grad is None, param
            continue
        dist.all_reduce(p.grad, group=group)
        errors[param] = rel_err(p.grad, grads[param].grad)
    return errors


@pytest.fixture(scope="module")
def ranks4():
    pool = RankPool(4)
    yield pool
    pool.close()


@pytest.mark.parametrize("strategy", ["flat", "zigzag"])
@pytest.mark.parametrize("cp", [2, 3, 4])
def test_gdn_model_matches_one_process(ranks4, cp, strategy):
    for rank, errors in enumerate(ranks4.run(_compare, cp, "gdn", strategy, timeout=600)[:cp]):
        assert len(errors) == 2 + len(list(GDNModel().parameters())), errors
        bad = {n: e for n, e in errors.items() if not e <= TOL}
        assert not bad, f"rank {rank}: {bad}"


@pytest.mark.parametrize("strategy", ["flat", "zigzag"])
def test_hf_qwen3_next_matches_one_process(ranks4, strategy):
    """HF Qwen3-Next's Gated DeltaNet layer on its torch fallbacks (causal_conv1d_fn: a halo;
    torch_chunk_gated_delta_rule: state passing) and its attention layer, cp 2; under zigzag with HF's scan code
    computing in fp64, to a bound ten times tighter (HF_FP64_TOL says why)."""
    tol = HF_FP64_TOL if strategy == "zigzag" else HF_TOL
    for rank, errors in enumerate(ranks4.run(_compare, 2, "qwen3_next", strategy, timeout=600)[:2]):
        assert "model.model.layers.0.linear_attn.conv1d.weight" in errors, sorted(errors)
        assert "model.model.layers.0.linear_attn.A_log" in errors, sorted(errors)
        bad = {n: e for n, e in errors.items() if not e <= tol}
        assert not bad, f"rank {rank}: {bad}"


@pytest.mark.parametrize("cp", [2])  # cp 3/4's permutations: tests/unit/test_relayout.py, bit-equal (CI time)
def test_gdn_model_between_relayouts_matches_one_process(ranks4, cp):
    """mixer_layout="flat" under zigzag: each GDN layer (a run of two mixers: the conv and the scan) runs on flat
    chunks between two relayouts (one all-to-all of the token tensors zigzag -> flat before it, flat -> zigzag
    after), the attention block on zigzag; the relayouts' backward is the inverse permutation."""
    for rank, errors in enumerate(ranks4.run(_compare, cp, "gdn", "zigzag", "flat", timeout=600)[:cp]):
        assert len(errors) == 2 + len(list(GDNModel().parameters())), errors
        bad = {n: e for n, e in errors.items() if not e <= TOL}
        assert not bad, f"rank {rank}: {bad}"


PACKED = {
    # cp -> batches of document lengths (4 tokens a rank) on one compiled model: a document start exactly at a
    # chunk edge, a chunk that begins inside a document with another starting in it, one-token documents,
    # documents shorter than the conv's 4-token kernel, a document over 3 chunks (cp 3), empty documents (padding)
    2: ([3, 1, 2, 2], [2, 5, 1]),
    3: ([1, 8, 1, 2], [4, 3, 1, 4]),
}
CU_ENTRIES = 6
"""cu_seqlens padded to one shape (empty documents at the end), so the batches share one compile."""


def _compare_packed(rank, world, cp):
    """PackedGDNModel (two GDN layers taking the documents, varlen attention between them) under strategy "thd",
    each batch against the one-process run on the whole buffer: logits, loss and every parameter gradient."""
    from tests.support.gdn import PackedGDNModel

    torch._dynamo.reset()
    group = dist.new_group(list(range(cp)))
    if rank >= cp:
        return []
    torch.manual_seed(0)
    total = sum(PACKED[cp][0])
    model = PackedGDNModel(max_len=total).double()
    cp_model = copy.deepcopy(model)
    model.attn.per_document = True
    be = cpcompile.backend(strategy="thd", comm="all_gather", inner="aot_eager", group=group)
    compiled = torch.compile(cp_model, backend=be, fullgraph=True)
    gen = torch.Generator().manual_seed(1)
    found = []
    for step, lengths in enumerate(PACKED[cp]):
        cu = cpcompile.pad_cu_seqlens([0, *torch.tensor(lengths).cumsum(0).tolist()], total, CU_ENTRIES)
        ids, labels = torch.randint(0, VOCAB, (2, total), generator=gen)
        model.zero_grad()
        cp_model.zero_grad()
        logits = model(ids, cu)
        loss = F.cross_entropy(logits, labels, reduction="sum") / total
        loss.backward()
        local = cpcompile.shard_batch(dict(input_ids=ids, labels=labels, cu_seqlens=cu), strategy="thd", seq_dim=0,
                                      group=group)  # fmt: skip
        with torch._dynamo.config.patch(error_on_recompile=step > 0):
            out = compiled(local["input_ids"], local["cu_seqlens"])
        cp_loss = F.cross_entropy(out, local["labels"], reduction="sum") / total
        cp_loss.backward()
        summed = cp_loss.detach().clone()
        dist.all_reduce(summed, group=group)
        full = cpcompile.unshard(out.detach(), strategy="thd", seq_dim=0, cu_seqlens=cu, group=group)
        errors = {"logits": rel_err(full, logits.detach()), "loss": rel_err(summed, loss.detach())}
        grads = dict(model.named_parameters())
        for name, p in cp_model.named_parameters():
            dist.all_reduce(p.grad, group=group)
            errors[name] = rel_err(p.grad, grads[name].grad)
        found.append(errors)
    return found


@pytest.mark.parametrize("cp", [2, 3])
def test_packed_documents_reset_the_state_and_the_halo(ranks4, cp):
    """Packed documents under state passing (strategy "thd"): each rank's conv and scan restart at every document
    start in its chunk, a chunk that begins at a document start reads no earlier state or halo, and only the first
    segment of a chunk reads the incoming state; two batches of different documents, one compile."""
    from tests.support.gdn import PackedGDNModel

    params = len(list(PackedGDNModel(16).parameters()))
    for rank, batches in enumerate(ranks4.run(_compare_packed, cp, timeout=600)[:cp]):
        assert len(batches) == len(PACKED[cp]), batches
        for step, errors in enumerate(batches):
            assert len(errors) == 2 + params, errors
            bad = {n: e for n, e in errors.items() if not e <= TOL}
            assert not bad, f"rank {rank} batch {step}: {bad}"


class _PackedMixersOnly(torch.nn.Module):
    """A GDN layer over packed documents and nothing else: no attention site, so no varlen check of the offsets."""

    def __init__(self) -> None:
        super().__init__()
        from tests.support.gdn import GDNLayer

        self.embed = torch.nn.Embedding(VOCAB, 32)
        self.gdn = GDNLayer(32, 2, 8, 6, documents=True)

    def forward(self, ids, cu_seqlens):
        return self.gdn(self.embed(ids)[None], cu_seqlens)[0]


def _offsets_outcomes(rank, world) -> dict:
    """Packed mixers alone under thd, cp 2, 24 tokens: offsets that tile the buffer, and offsets that do not
    (decreasing, short of the GLOBAL length, different between the ranks), on one compiled model."""
    torch._dynamo.reset()
    group = dist.new_group([0, 1])
    if rank >= 2:
        return {}
    torch.manual_seed(0)
    model = _PackedMixersOnly().double()
    be = cpcompile.backend(strategy="thd", comm="all_gather", inner="aot_eager", group=group)
    compiled = torch.compile(copy.deepcopy(model), backend=be, fullgraph=True)
    ids = torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(1))
    valid = torch.tensor([0, 5, 13, 24], dtype=torch.int32)
    local = cpcompile.shard(ids, strategy="thd", seq_dim=0, group=group, cu_seqlens=valid)
    cases = {
        "valid": [0, 5, 13, 24],
        "decreasing": [0, 13, 9, 24],
        "short of the global length": [0, 5, 13, 12],
        "differs between ranks": [0, 5, 13, 24] if rank == 0 else [0, 6, 13, 24],
    }
    out = {}
    for name, cu in cases.items():
        cu = torch.tensor(cu, dtype=torch.int32)
        try:
            got = compiled(local, cu)
        except RuntimeError as e:
            out[name] = str(e)
            continue
        with torch.no_grad():
            full = cpcompile.unshard(got.detach(), strategy="thd", seq_dim=0, group=group, cu_seqlens=valid)
            out[name] = f"ok, error {rel_err(full, model(ids, cu)):.2g}"
    return out


def test_packed_mixers_without_attention_check_the_offsets(ranks4):
    """A graph of packed mixers alone checks the offsets the regions read, on every rank, before they run: bad or
    rank-divergent offsets fail every rank with the packed check's message instead of being clamped (decreasing
    offsets gave an error of 0.015, silently)."""
    for rank, out in enumerate(ranks4.run(_offsets_outcomes, timeout=600)[:2]):
        assert out["valid"].startswith("ok") and float(out["valid"].split()[-1]) <= TOL, (rank, out)
        for case in ("decreasing", "short of the global length"):
            assert "cpcompile: bad cu_seqlens, need cu[0]=0, non-decreasing, cu[-1]=24" in out[case], (rank, out)
        assert "cpcompile: cu_seqlens differs between CP ranks" in out["differs between ranks"], (rank, out)
