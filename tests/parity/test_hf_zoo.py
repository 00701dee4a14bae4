"""The HF zoo: tiny random Hugging Face models with attn_implementation="cpcompile", trained as a user would
(use_cache=False, input_ids and labels, the model's own loss), on gloo ranks against the same model on one process
with HF's own attention ("sdpa"; "eager" for Gemma 2, which HF keeps off sdpa, and GPT-OSS, whose sinks HF's sdpa
lacks): logits, the model's own loss and
every parameter gradient.

Per rank: the global batch goes through cpcompile.shard_batch(hf_loss=...) (it adds the global position_ids and,
for causal LMs, the globally shifted shift_labels and the global target count num_items_in_batch), the compiled
model returns the rank's share of the loss, the shares and the gradients are summed over the ranks. fp64 weights;
HF upcasts the logits to fp32 for its loss (and Gemma 2's eager attention its softmax), so the loss, the gradients
and Gemma 2's logits are compared at fp32's precision. Gemma 2 (sliding windows and softcap) runs on aot_eager, the
others on the eager inner compiler (the pass and its regions are the same; the zoo stays
within the suite's time budget). Each model is its own test; the ranks are spawned once per module and world size
(RankPool), so a test pays for its model only."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import cpcompile
from cpcompile.testing.distributed import RankPool

pytest.importorskip("transformers")

from tests.support.hf_zoo import CAUSAL, MASKED, MODELS, MOE, RUNS, WINDOW, batch, build  # noqa: E402

BATCH, SEQ = 2, 32
LOGITS_TOL = 1e-10  # fp64 logits, relative to the largest
FP32_TOL = 2e-5  # relative to the largest reference value: HF's loss runs in fp32 (logits.float())


def _runs(strategy: str, comm: str, world: int) -> list[str]:
    return [name for name in MODELS if (strategy, comm, world) in RUNS[name]]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest error relative to the largest reference value, floored at 1e-6: some gradients are 0 up to
    rounding (a key bias under full attention only shifts every score of a row)."""
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-6)).item()


EAGER_ONLY = ("gemma2",)
"""Models HF runs on its eager attention only (softcapped scores): fp32 softmax in the reference."""
EAGER_REFERENCE = (*EAGER_ONLY, "gpt_oss")
"""The reference runs HF's eager attention (GPT-OSS: its sdpa path takes no sinks; the eager one is fp64 here)."""
AOT = ("gemma2",)
"""On aot_eager: Gemma 2 has both new paths (sliding windows and softcapped scores on cpu_ref)."""


def _reference(name: str, full: dict) -> dict:
    model = build(name, "eager" if name in EAGER_REFERENCE else "sdpa")
    kwargs = {} if name in MASKED else {"use_cache": False}
    out = model(**full, **kwargs)
    out.loss.backward()
    return {
        "logits": out.logits.detach(),
        "loss": out.loss.detach(),
        "grads": {n: p.grad for n, p in model.named_parameters() if p.grad is not None},
    }


def _cp(name: str, full: dict, strategy: str, comm: str) -> dict:
    model = build(name, "cpcompile")
    hf_loss = "causal_lm" if name in CAUSAL else "masked_lm"
    local = cpcompile.shard_batch(full, strategy=strategy, hf_loss=hf_loss)
    be = cpcompile.backend(strategy=strategy, comm=comm, inner="aot_eager" if name in AOT else "eager")
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=be, fullgraph=True)
    out = compiled(**local, **({} if name in MASKED else {"use_cache": False}))
    loss = out.loss
    if name == "bert":  # BertForMaskedLM takes a plain mean over the rank's targets (it ignores num_items_in_batch)
        loss = loss * (local["labels"] != -100).sum() / local["num_items_in_batch"]
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    grads = {}
    for n, p in model.named_parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            grads[n] = p.grad
    return {"logits": out.logits.detach(), "loss": total, "grads": grads, "plans": be.plans}


def _compare(rank, world, name, strategy, comm) -> dict:
    """One model's errors and plans on this rank."""
    torch.set_default_dtype(torch.float32)
    full = batch(name, BATCH, SEQ)
    ref = _reference(name, full)
    got = _cp(name, full, strategy, comm)
    shard = lambda t: cpcompile.shard(t, strategy=strategy, seq_dim=1)  # noqa: E731
    logits = shard(ref["logits"])
    errors = {
        "logits": (_rel(got["logits"], logits), FP32_TOL if name in EAGER_ONLY + MOE else LOGITS_TOL),
        "loss": (_rel(got["loss"], ref["loss"]), FP32_TOL),
    }
    missing = set(ref["grads"]) ^ set(got["grads"])
    assert not missing, f"{name}: gradients present on one side only: {missing}"
    errors["grads"] = (max(_rel(got["grads"][n], g) for n, g in ref["grads"].items()), FP32_TOL)
    windows = sorted({p.window for p in got["plans"]}, key=str)
    sites = len({p.site.node.name for p in got["plans"]})  # (Dynamo may restart a trace: plans repeat)
    return {"errors": errors, "sites": sites, "windows": windows, "sinks": sorted({p.sinks for p in got["plans"]}),
            "kernels": sorted({p.kernel for p in got["plans"]})}  # fmt: skip


def _check(name, reports):
    failures = []
    for rank, r in enumerate(reports):
        assert r["sites"] == 2, f"rank {rank} {name}: {r['sites']} attention sites rewritten, expected 2"
        for what, (err, tol) in r["errors"].items():
            if not err <= tol:
                failures.append(f"rank {rank} {name} {what}: error {err:.3g} > {tol:.3g}")
        assert r["windows"] == WINDOWED.get(name, [None]), (name, r["windows"])
        assert r["sinks"] == [name == "gpt_oss"], (name, r["sinks"])
        assert r["kernels"] == (["cpu_ref"] if name in EAGER_ONLY else ["cpu_flash"]), (name, r["kernels"])
    assert not failures, "\n".join(failures)


WINDOWED = {
    "qwen2": [(WINDOW - 1, 0), None],
    "mistral_sw": [(WINDOW - 1, 0)],
    "gemma2": [(WINDOW - 1, 0), None],
    "gemma3": [(WINDOW - 1, 0), None],
    "gpt_oss": [(WINDOW - 1, 0), None],
    "modernbert": [(WINDOW, WINDOW), None],  # HF's mask: |q - kv| <= config.sliding_window (local_attention / 2)
}


def _runtime_error(fn) -> str:
    try:
        fn()
    except RuntimeError as e:
        return str(e)
    return "no error"


def _token_checks(rank, world) -> dict:
    """What HF's mask would have applied and CP cannot: padding, packed position ids, and position ids that do
    not match the layout. Each must fail on EVERY rank (the check all-gathers its verdict), not only on the rank
    that holds the offending tokens."""
    torch._dynamo.reset()
    full = batch("llama", BATCH, SEQ)
    model = torch.compile(build("llama", "cpcompile"), backend=cpcompile.backend(strategy="zigzag", inner="eager"))
    shard = lambda t: cpcompile.shard(t, strategy="zigzag", seq_dim=1)  # noqa: E731
    ids = shard(full["input_ids"])
    ones = torch.ones(BATCH, SEQ, dtype=torch.long)
    padded = ones.clone()
    padded[1, -3:] = 0  # right padding of row 1: only rank 0's second chunk holds it
    pos = torch.arange(SEQ).expand(BATCH, SEQ)
    packed = torch.cat([torch.arange(20), torch.arange(12)]).expand(BATCH, SEQ)  # two documents, HF-style
    out = {}
    model(input_ids=ids, attention_mask=shard(ones), position_ids=shard(pos), use_cache=False)  # all ones: fine
    out["padding"] = _runtime_error(
        lambda: model(input_ids=ids, attention_mask=shard(padded), position_ids=shard(pos), use_cache=False)
    )
    model(input_ids=ids, position_ids=shard(pos), use_cache=False)
    out["packed"] = _runtime_error(lambda: model(input_ids=ids, position_ids=shard(packed), use_cache=False))
    flat = cpcompile.shard(pos, strategy="flat", seq_dim=1)
    out["flat positions"] = _runtime_error(lambda: model(input_ids=ids, position_ids=flat, use_cache=False))
    return out


@pytest.fixture(scope="module")
def ranks2():
    pool = RankPool(2)
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def ranks4():
    pool = RankPool(4)
    yield pool
    pool.close()


@pytest.mark.parametrize("name", _runs("zigzag", "all_gather", 2))
def test_zoo_zigzag_all_gather_2_ranks(ranks2, name):
    _check(name, ranks2.run(_compare, name, "zigzag", "all_gather", timeout=600))


def test_hf_masks_cp_cannot_apply_fail_on_every_rank(ranks2):
    for rank, checks in enumerate(ranks2.run(_token_checks, timeout=600)):
        assert "attention_mask has padding" in checks["padding"], (rank, checks)
        for case in ("packed", "flat positions"):
            assert "position_ids are not every token's GLOBAL position" in checks[case], (rank, case, checks)


@pytest.mark.parametrize("name", _runs("zigzag", "a2a", 4))  # gemma3: a sliding and a full layer
def test_zoo_zigzag_a2a_4_ranks(ranks4, name):
    _check(name, ranks4.run(_compare, name, "zigzag", "a2a", timeout=600))


@pytest.mark.parametrize("name", _runs("zigzag", "ring", 2))  # windows (and GPT-OSS's sinks) under the ring
def test_zoo_zigzag_ring_2_ranks(ranks2, name):
    _check(name, ranks2.run(_compare, name, "zigzag", "ring", timeout=600))


def _aux_loss_compare(rank, world, name: str, sizes: tuple[int, ...]) -> dict:
    """A MoE model with output_router_logits=True (the aux loss in its loss, coefficient 1 so that its gradient
    counts) at each batch size of `sizes`: the ranks' summed loss and aux loss and every gradient against one process
    running transformers' own load_balancing_loss_func."""
    import sys

    from cpcompile.integrations.hf_moe import original

    config = dict(output_router_logits=True, router_aux_loss_coef=1.0)
    errors = {}
    for size in sizes:
        full = batch(name, size, SEQ)
        model = build(name, "cpcompile", **config)  # built first: its modeling module's aux loss is cpcompile's now
        modeling = sys.modules[type(model).__module__]
        ours, modeling.load_balancing_loss_func = modeling.load_balancing_loss_func, original(modeling.__name__)
        try:
            reference = build(name, "sdpa", **config)
            ref = reference(**full, use_cache=False)
            ref.loss.backward()
        finally:
            modeling.load_balancing_loss_func = ours
        local = cpcompile.shard_batch(full, strategy="zigzag", hf_loss="causal_lm")
        torch._dynamo.reset()
        be = cpcompile.backend(strategy="zigzag", inner="eager")
        out = torch.compile(model, backend=be, fullgraph=True)(**local, use_cache=False)
        out.loss.backward()
        totals = torch.stack([out.loss.detach(), out.aux_loss.detach()])
        dist.all_reduce(totals)
        grads = dict(reference.named_parameters())
        worst = 0.0
        for n, p in model.named_parameters():
            assert (p.grad is None) == (grads[n].grad is None), n
            if p.grad is not None:
                dist.all_reduce(p.grad)
                worst = max(worst, _rel(p.grad, grads[n].grad))
        errors[size] = {"loss": _rel(totals[0], ref.loss), "aux_loss": _rel(totals[1], ref.aux_loss), "grads": worst}
    return errors


@pytest.mark.parametrize("name,sizes", [("qwen3_moe", (1, 2)), ("mixtral", (2,))])  # (a batch size a compile)
def test_moe_aux_loss_matches_one_process(ranks2, name, sizes):
    """output_router_logits=True under CP (was: Dynamo's "Unsupported context manager: lock" at transformers'
    output-capturing hooks, then a refusal at the aux loss's histc): the hooks are installed when the model is
    built, and the aux loss counts the experts' load over the CP group, each rank returning its share."""
    for rank, errors in enumerate(ranks2.run(_aux_loss_compare, name, sizes, timeout=600)):
        for size, found in errors.items():
            bad = {what: e for what, e in found.items() if not e <= FP32_TOL}
            assert not bad, f"rank {rank} {name} batch {size}: {bad}"
