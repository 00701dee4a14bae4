"""The GPU check's parity rows, on 2 gloo ranks sharing the GPU (collectives through host memory:
cpcompile/comm/route.py): the compiled layer (every comm x layout, kernel="auto", bf16; aot_eager, as the speed
rows run it under Inductor) and an HF Llama with attn_implementation="cpcompile" (Inductor); each rank's output
and every gradient against one GPU.

The rule, per tensor: the CP error (max |cp - fp64 reference|) must be at most 4x the single-GPU bf16 error plus a
floor of 1e-3 x the reference's largest magnitude. CP rounds each bf16 partial the kernels return and sums them
in fp32 (up to 3 partials an element at cp=2: tests/support/roundings.py counts them), so its error may exceed one
GPU's by (1 + sqrt(3)) < 4; a wrong block, mask or merge is off by the values themselves.
"""

from __future__ import annotations

import copy
import traceback

import torch
import torch.distributed as dist

import cpcompile
from bench.gpu_layer import PACKED, SMALL, build, cu_of, documents, layer_inputs, unshard_out
from cpcompile.testing.distributed import run_ranks, share_one_gpu

WORLD, SEQ = 2, 512
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the script itself, debugged without a GPU


def _verdict(name: str, got: torch.Tensor, ref64: torch.Tensor, ref16: torch.Tensor) -> tuple[bool, str, float]:
    err = (got.double() - ref64).abs().max().item()
    base = (ref16.double() - ref64).abs().max().item()
    allowed = 4 * base + 1e-3 * ref64.abs().max().item()
    return err <= allowed, f"{name} {err:.2e}/{allowed:.2e}", err / allowed if allowed else float("inf")


def _summed_grads(model) -> list[torch.Tensor]:
    grads = []
    for p in model.parameters():
        g = p.grad.float().cpu()
        dist.all_reduce(g)
        grads.append(g)
    return grads


def _single(layer, dtype, x, dout, cu, longest):
    m = copy.deepcopy(layer).to(dtype)
    m.per_document = dtype == torch.float64 or DEVICE == "cpu"  # varlen_attn: CUDA fp16/bf16 only
    xx = x.detach().to(dtype).clone().requires_grad_()  # a leaf of its own (x may already be in `dtype`)
    extra = () if cu is None else (cu.to(DEVICE), longest)
    out = m(xx, *extra)
    out.backward(dout.to(dtype))
    return [out.detach(), xx.grad, *(p.grad for p in m.parameters())]


def _layer_rank(rank, world, cases):
    if DEVICE == "cuda":
        share_one_gpu()
    rows = []
    for comm, layout in cases:
        try:
            rows.append((comm, layout, *_layer_case(comm, layout, world)))
        except Exception as e:  # noqa: BLE001  (a crash of the check itself: this row fails, the others run)
            traceback.print_exc()
            rows.append((comm, layout, False, f"crashed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"))
    return rows


def _layer_case(comm: str, layout: str, world: int) -> tuple[bool | None, str]:
    """(True/False: parity held or not, None: refused with one CPCompileError; a detail)."""
    torch._dynamo.reset()
    layer = build(SMALL, torch.float64, seed=1, device=DEVICE)
    g = torch.Generator(device=DEVICE).manual_seed(5)
    packed = layout in PACKED
    shape = (SEQ, SMALL.hidden) if packed else (1, SEQ, SMALL.hidden)
    x = torch.randn(shape, device=DEVICE, dtype=torch.float64, generator=g)
    dout = torch.randn(shape, device=DEVICE, dtype=torch.float64, generator=g)
    cu = cu_of(documents(SEQ, seed=4, unit=2 * world)) if packed else None
    longest = int((cu[1:] - cu[:-1]).max()) if packed else 0
    ref64 = _single(layer, torch.float64, x, dout, cu, longest)
    ref16 = _single(layer, torch.bfloat16, x, dout, cu, longest)
    model = copy.deepcopy(layer).to(torch.bfloat16)
    be = cpcompile.backend(strategy=layout, comm=comm, kernel="auto", inner="aot_eager")
    # the compiled rank; a refusal is reported, not raised
    try:
        local, model_cu, _ = layer_inputs(layout, x.to(torch.bfloat16), cu)
        local_dout, _, _ = layer_inputs(layout, dout.to(torch.bfloat16), cu)
        local = local.detach().requires_grad_()
        extra = () if model_cu is None else (model_cu, longest)
        out = torch.compile(model, backend=be, fullgraph=True)(local, *extra)
        out.backward(local_dout)
    except Exception as e:  # a refusal (Dynamo wraps the backend's CPCompileError) or a crash
        refused = isinstance(e, cpcompile.CPCompileError) or "CPCompileError: " in str(e)
        if not refused:
            traceback.print_exc()
        return None if refused else False, f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    got = [unshard_out(layout, out.detach(), cu), unshard_out(layout, local.grad, cu), *_summed_grads(model)]
    names = ["out", "dx"] + [f"d{n}" for n, _ in model.named_parameters()]
    results = [_verdict(n, a.to(DEVICE), b, c) for n, a, b, c in zip(names, got, ref64, ref16)]
    worst = max(results, key=lambda r: r[2])
    return all(r[0] for r in results), f"kernel {be.plans[0].kernel}; worst {worst[1]} (error/allowed)"


def layer_parity(cases: list[tuple[str, str]]) -> list[tuple[str, bool, str]]:
    from bench.gpu_speed import refused_by_design

    per_rank = run_ranks(_layer_rank, WORLD, cases, timeout=420)
    rows = []
    for i, (comm, layout) in enumerate(cases):
        outcomes = [r[i] for r in per_rank]
        name = f"layer parity {comm}/{layout} cp={WORLD}"
        if refused_by_design(comm, layout):
            ok = all(o[2] is None for o in outcomes)
            rows.append((name, ok, "refused as documented" if ok else "ran, but the registry refuses it"))
            continue
        ok = all(o[2] is True for o in outcomes)
        rows.append((name, ok, " | ".join(f"rank {r}: {o[3]}" for r, o in enumerate(outcomes))))
    return rows


def _hf_rank(rank, world):
    share_one_gpu()
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, attention_dropout=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="cpcompile").to("cuda")
    ids = torch.randint(0, 256, (1, SEQ), generator=torch.Generator().manual_seed(1)).to("cuda")

    def single(dtype):
        m = copy.deepcopy(base).to(dtype)
        out = m(input_ids=ids, labels=ids, use_cache=False)
        out.loss.backward()
        return [out.logits.detach(), out.loss.detach().reshape(1), *(p.grad for p in m.parameters())]

    ref64, ref16 = single(torch.float64), single(torch.bfloat16)
    model = copy.deepcopy(base).to(torch.bfloat16)
    batch = cpcompile.shard_batch({"input_ids": ids, "labels": ids}, strategy="zigzag", hf_loss="causal_lm")
    be = cpcompile.backend(strategy="zigzag", kernel="auto", inner="inductor")
    out = torch.compile(model, backend=be, fullgraph=True)(**batch, use_cache=False)
    out.loss.backward()
    loss = out.loss.detach().float().cpu().reshape(1)
    dist.all_reduce(loss)
    logits = cpcompile.unshard(out.logits.detach(), strategy="zigzag", seq_dim=1)
    got = [logits, loss.to("cuda"), *_summed_grads(model)]
    names = ["logits", "loss"] + [f"d{n}" for n, _ in model.named_parameters()]
    results = [_verdict(n, a.to("cuda"), b, c) for n, a, b, c in zip(names, got, ref64, ref16)]
    worst = max(results, key=lambda r: r[2])
    return all(r[0] for r in results), f"kernels {sorted({p.kernel for p in be.plans})}; worst {worst[1]}"


def main(argv=None) -> int:
    """Run every parity row and write them as JSON to argv[0] (bench.gpu_check runs this beside its other work)."""
    import json
    import sys

    from bench.gpu_check import CASES

    path = (argv or sys.argv[1:])[0]
    rows = []
    for name, fn in (("layer parity", lambda: layer_parity(CASES)), ("hf parity", hf_parity)):
        try:
            rows.extend(fn())
        except Exception as e:  # one failed row, the others still run
            traceback.print_exc()
            rows.append((name, False, f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"))
    with open(path, "w") as f:
        json.dump(rows, f)
    return 0


def hf_parity() -> list[tuple[str, bool, str]]:
    per_rank = run_ranks(_hf_rank, WORLD, timeout=300)
    ok = all(r[0] for r in per_rank)
    return [
        (
            f"hf llama cpcompile zigzag/all_gather cp={WORLD}",
            ok,
            " | ".join(f"rank {i}: {r[1]}" for i, r in enumerate(per_rank)),
        )
    ]


if __name__ == "__main__":
    raise SystemExit(main())
