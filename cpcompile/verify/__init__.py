"""cpcompile.verify(model, batch, backend=...): the user's own model, sharded through the compiled model and whole
in one process, compared tensor by tensor. The second line of defence, after the token guard: what no static
check can see (a token-mixing op marked token-local, a custom kernel, a loss that is not a sum over tokens)
shows up here as a FAIL naming the tensor.

Every rank of the CP group calls it with the same GLOBAL batch. Every rank also runs the one-process reference
itself (no gather of the model's results to one rank, and every rank returns the same Report: the errors are
max-reduced over the group). Run it once before training, on a short batch: the whole batch must fit one device.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from ..backend import CPBackend
from ..errors import CPCompileError
from ..layouts import THD_LAYOUTS
from ..mesh import resolve_group
from ..sharding import plan_documents, shard_batch
from .report import Report, Row, allowed_error, relative_error
from .runs import Forward, Layout, LossFn, Outcome, cast_floats, fresh_copy, run_sharded, run_whole

__all__ = ["Report", "Row", "verify"]


def _call(model: torch.nn.Module, batch: Mapping[str, Any]) -> Any:
    return model(**batch)


def _model_dtype(model: torch.nn.Module) -> torch.dtype:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def _named(outcome: Outcome) -> dict[str, torch.Tensor | None]:
    named: dict[str, torch.Tensor | None] = {}
    if outcome.logits is not None:
        named["logits"] = outcome.logits
    named["loss"] = outcome.loss
    named.update({f"grad {n}": g for n, g in outcome.grads.items()})
    return named


def _errors(got: Outcome, want: Outcome) -> dict[str, float]:
    """Relative error per tensor; inf where one side has the tensor (a grad, the logits) and the other not, or
    the shapes differ."""
    have, ref = _named(got), _named(want)
    out = {}
    for name in sorted(set(have) | set(ref), key=lambda n: (not n.startswith(("logits", "loss")), n)):
        a, b = have.get(name), ref.get(name)
        if a is None and b is None:
            continue
        ok_shapes = a is not None and b is not None and a.shape == b.shape
        out[name] = relative_error(a, b) if ok_shapes else float("inf")
    return out


def _max_over_ranks(errors: dict[str, float], group: dist.ProcessGroup) -> dict[str, float]:
    values = torch.tensor([e if e == e else float("inf") for e in errors.values()], dtype=torch.float64)
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
    return dict(zip(errors, values.tolist()))


def verify(
    model: torch.nn.Module,
    batch: Mapping[str, Any],
    *,
    backend: CPBackend,
    forward: Forward | None = None,
    loss_fn: LossFn | None = None,
    hf_loss: str | None = None,
    seq_dim: int = 1,
    logits_seq_dim: int | None = None,
    seq_keys: Iterable[str] = (),
    passthrough_keys: Iterable[str] = (),
    cu_seqlens: torch.Tensor | None = None,
    ignore_index: int = -100,
    fullgraph: bool = True,
    compile_kwargs: Mapping[str, Any] | None = None,
    seed: int = 0,
    show: bool = True,
) -> Report:
    """Run `batch` (the GLOBAL batch, the same on every rank) through `model` both ways and compare.

    CP: a deep copy compiled with `backend` (a cpcompile.backend(...): its strategy, comm, kernel, inner and
    group), fed `shard_batch(batch, ...)` (seq_dim, seq_keys, passthrough_keys, cu_seqlens, hf_loss,
    ignore_index as there; packed documents: cu_seqlens= or batch["cu_seqlens"], the plain global offsets).
    One process: another deep copy, eager, fed `batch` as given.
    forward(model, batch) -> output (default model(**batch)); the logits are the output if it is a tensor, else
    output.logits, cut along `logits_seq_dim` (default seq_dim). The loss: loss_fn(output, batch), else
    output.loss (HF; with hf_loss= each rank's is its share of the global mean), else a fixed random weighting
    of the logits. loss_fn must add up over tokens (a sum, or a sum over a GLOBAL count): the CP loss is the
    sum of the ranks' losses, the gradients the sum of the ranks' gradients.
    Compared: the logits, the loss and every parameter gradient, by report.py's dtype-aware rule (a bf16 /
    fp16 model costs one more one-process run, in fp64). Dropout makes the runs differ: use a dropout of 0.
    Returns the Report (printed on the group's rank 0 when `show`); a mismatch is report.passed == False,
    not an exception, so the caller decides (raise, log, stop). A refusal while compiling (CPCompileError, the
    first line of defence) is raised as in training.
    """
    if not isinstance(backend, CPBackend):
        raise CPCompileError(
            f"verify(backend={type(backend).__name__}): needs the backend object itself. "
            "Fix: pass backend=cpcompile.backend(strategy=..., mesh=...), the one you compile the model with."
        )
    cfg = backend.config
    cp = resolve_group(cfg.mesh, cfg.group)
    forward = forward or _call
    batch = dict(batch)
    packed = cfg.strategy in THD_LAYOUTS
    cu = (cu_seqlens if cu_seqlens is not None else batch.get("cu_seqlens")) if packed else None
    if packed and cu is not None:
        cu = plan_documents(cu, strategy=cfg.strategy, mesh=cfg.mesh, group=cfg.group)  # once: shard and unshard
    local = shard_batch(
        batch, strategy=cfg.strategy, mesh=cfg.mesh, group=cfg.group, seq_dim=seq_dim, seq_keys=seq_keys,
        passthrough_keys=passthrough_keys, cu_seqlens=cu, hf_loss=hf_loss, ignore_index=ignore_index,
    )  # fmt: skip
    layout = Layout(cfg.strategy, cfg.mesh, cfg.group, cp, seq_dim if logits_seq_dim is None else logits_seq_dim, cu)

    dtype = _model_dtype(model)
    ref = run_whole(fresh_copy(model), batch, forward, loss_fn, None, seed)
    probe = ref.probe

    twin = fresh_copy(model)
    inner = CPBackend(cfg, inner=backend.inner)
    compiled = torch.compile(twin, backend=inner, fullgraph=fullgraph, **dict(compile_kwargs or {}))
    got = run_sharded(compiled, twin, local, forward, loss_fn, probe, layout, seed)

    low: dict[str, float] | None = None
    if dtype not in (torch.float32, torch.float64):
        exact = run_whole(fresh_copy(model, torch.float64), cast_floats(batch, torch.float64), forward, loss_fn,
                          probe, seed)  # fmt: skip
        low, ref = _errors(ref, exact), exact
    errors = _max_over_ranks(_errors(got, ref), cp.group)
    low = low or {}
    rows = [Row(name, err, allowed_error(dtype, low.get(name))) for name, err in errors.items()]
    setup = (
        f"strategy={cfg.strategy} comm={cfg.comm} kernel={cfg.kernel} inner={_inner_name(backend.inner)}, "
        f"{cp.size} ranks, {len(inner.plans)} attention sites rewritten"
    )
    report = Report(setup, dtype, rows)
    if show and cp.rank == 0:
        print(report, flush=True)
    return report


def _inner_name(inner: Any) -> str:
    return inner if isinstance(inner, str) else getattr(inner, "__name__", type(inner).__name__)
