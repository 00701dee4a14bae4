"""Communication overlap on one GPU (issues 25 and 31): the compiled attention layer of bench/gpu_layer.py as one
CP rank, timed with its collectives on a stand-in link (cpcompile/testing/link_group.py: each collective sleeps
bytes / bandwidth on a side stream, waited where the graph needs its result) against the same compiled graph with
the link off (compute only, as on the fake process group), side by side in one process, with the single-GPU
layer / cp as the reference.

    python -m bench.overlap --out bench/results/overlap.json [--quick] [--budget 280]
    python -m bench.overlap --device cpu --out /tmp/overlap.json     # the CPU smoke test's tiny grid

Rows: layout x comm x tokens a rank x cp x topology (nodes x ranks a node; a CP group spanning nodes runs at
the inter-node bandwidth, link_model.py), dense zigzag (all_gather, a2a, ring; hierarchical on 2-D meshes) and
packed thd_balanced (all_gather, selective). One compile serves every topology of its rows (only the link
differs). The grid runs in priority order until `--budget` seconds have passed (compiles dominate); rows not
reached are written with `skipped`. Records go to --out after every case (a timeout keeps what was measured).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import time
import traceback

import torch

import cpcompile
from bench.gpu_layer import LLAMA3_8B, PACKED, SMALL, build, cu_of, documents, layer_inputs
from cpcompile.cost.rates import inter_gbps, link_gbps
from cpcompile.testing.link_group import Link, link_group
from cpcompile.testing.link_model import Topology

REF_MAX_TOKENS = 131072
"""The single-GPU reference is timed up to this many tokens (a 256K-token step on one GPU takes seconds)."""


@dataclasses.dataclass(frozen=True)
class Case:
    """One compile: layout x comm x tokens a rank x cp (x a 2-D mesh for hierarchical), timed on `topologies`."""

    layout: str
    comm: str
    tokens: int
    cp: int
    topologies: tuple[int, ...]
    """Ranks a node of each topology timed (cp: one node)."""
    mesh: tuple[int, int] | None = None
    """(inter, intra) for comm="hierarchical"."""

    @property
    def name(self) -> str:
        mesh = f" mesh {self.mesh[0]}x{self.mesh[1]}" if self.mesh else ""
        size = f"{self.tokens // 1024}K" if self.tokens >= 1024 else str(self.tokens)
        return f"{self.layout}/{self.comm} {size} a rank cp={self.cp}{mesh}"


def _nodes(cp: int) -> tuple[int, ...]:
    """Topologies for a 1-D CP group of cp ranks: one node, and (8 and 16 ranks) the 2-D shapes of issue 31."""
    return {8: (8, 4), 16: (8, 4)}.get(cp, (cp,))


def grid(quick: bool) -> list[Case]:
    """The GPU grid in priority order, since the budget may end it: cp=8 at 8K and 4K tokens a rank (every comm,
    hierarchical on 2x4), packed at 8K, cp=8 at 32K, cp 4 and 2, packed at 32K, then 16 ranks (2x8, 4x4)."""
    dense, packed = ("all_gather", "a2a", "ring"), ("all_gather", "selective")

    def cp8(s: int) -> list[Case]:
        return [Case("zigzag", c, s, 8, _nodes(8)) for c in dense] + [
            Case("zigzag", "hierarchical", s, 8, (4,), (2, 4))
        ]

    def small_cp(sizes: tuple[int, ...]) -> list[Case]:
        return [Case("zigzag", c, s, cp, (cp,)) for s in sizes for cp in (4, 2) for c in dense]

    cases = cp8(8192)
    if quick:
        return cases + [Case("thd_balanced", c, 8192, 8, _nodes(8)) for c in packed]
    cases += cp8(4096) + [Case("thd_balanced", c, 8192, 8, _nodes(8)) for c in packed] + cp8(32768)
    cases += small_cp((8192, 4096)) + [Case("thd_balanced", c, 32768, 8, _nodes(8)) for c in packed]
    cases += small_cp((32768,))
    for s in (8192, 32768):
        cases += [Case("zigzag", c, s, 16, _nodes(16)) for c in dense]
        cases += [Case("zigzag", "hierarchical", s, 16, (m[1],), m) for m in ((2, 8), (4, 4))]
        cases += [Case("thd_balanced", c, s, 16, _nodes(16)) for c in packed]
    return cases


def cpu_grid() -> list[Case]:
    """The smoke test's grid: tiny shapes, a flat comm on two topologies, a 2x2 mesh, a packed comm."""
    return [
        Case("zigzag", "all_gather", 32, 4, (4, 2)),
        Case("zigzag", "hierarchical", 32, 4, (2,), (2, 2)),
        Case("thd_balanced", "selective", 32, 4, (4, 2)),
    ]


@dataclasses.dataclass
class Env:
    """What every case of a run shares: device, dtype, layer, kernel provider, inner compiler, timing."""

    device: str
    dtype: torch.dtype
    shape: object
    inner: str
    kernel: str
    intra: float
    inter: float
    iters: int = 0
    """Timed runs per mode (0: as many as fit ~3 s a case, 3 to 10)."""
    layer: torch.nn.Module | None = None
    refs: dict = dataclasses.field(default_factory=dict)

    def time_ms(self, fns: list, iters: int, warmup: int) -> list[float]:
        if self.device == "cuda":
            from bench.common import time_many_ms

            return time_many_ms(fns, iters, warmup)
        for fn in fns * warmup:
            fn()
        times: list[list[float]] = [[] for _ in fns]
        for _ in range(iters):
            for fn, ts in zip(fns, times):
                t0 = time.perf_counter()
                fn()
                ts.append(1e3 * (time.perf_counter() - t0))
        return [statistics.median(ts) for ts in times]


def _inputs(env: Env, case: Case):
    total = case.tokens * case.cp
    x = torch.randn(1, total, env.shape.hidden, device=env.device, dtype=env.dtype)
    if case.layout not in PACKED:
        return x, None
    return x[0], cu_of(documents(total, seed=3, unit=2 * case.cp))


def _step(fn, x, extra, dout):
    x = x.detach().requires_grad_()
    return lambda: fn(x, *extra).backward(dout)


def single_ms(env: Env, case: Case) -> float | None:
    """The single-GPU layer over the whole sequence (cached per layout kind and length; None above REF_MAX)."""
    total = case.tokens * case.cp
    kind = "packed" if case.layout in PACKED else "dense"
    if env.device == "cpu" or total > REF_MAX_TOKENS:
        return None  # the CPU smoke test times no reference (and varlen_attn has no CPU kernel)
    if (kind, total) not in env.refs:
        x, cu = _inputs(env, case)
        extra = () if cu is None else (cu.to(env.device), int((cu[1:] - cu[:-1]).max()))
        fn = torch.compile(env.layer, fullgraph=True, dynamic=False, backend=_inner(env))
        step = _step(fn, x, extra, torch.randn_like(x))
        env.refs[(kind, total)] = env.time_ms([step], iters=env.iters or (3 if total > 32768 else 5), warmup=1)[0]
    return env.refs[(kind, total)]


def _inner(env: Env) -> str:
    return "inductor" if env.inner == "inductor" else "aot_eager"


def _wire(be, case: Case) -> tuple[dict, object]:
    """(the registry's bytes a rank sends, through the cost model's estimate of the planned site; the site's
    cost-model shape, None when it could not be made)."""
    from cpcompile.cost import estimate
    from cpcompile.families.registry import get_family

    out, shape = {}, None
    try:
        plan = be.plans[0]
        shape = get_family(plan.site.kind).cost_shape(plan, case.cp)
        est = estimate(shape, case.layout, case.comm, plan.kernel)
        out = dict(wire_bytes_fwd=est.sent_fwd, wire_bytes_bwd=est.sent_bwd,
                   model_compute_ms=round(max(est.compute_ms), 4))  # fmt: skip
        if est.levels:
            out["level_bytes"] = [dict(dim=lv.dim, comm=lv.comm, fwd=lv.fwd, bwd=lv.bwd) for lv in est.levels]
    except Exception as e:  # noqa: BLE001  (a record without the model's bytes says why)
        out["wire_error"] = f"{type(e).__name__}: {e}"
    return out, shape


def planner_point(shape, layout: str, topo: Topology, cp: int) -> tuple | None:
    """The measured-point key (cost/measured.py) of the site the planner sees for this row: a 1-D comm timed on
    several nodes is the same graph as on a 2-D CP mesh of that shape (it runs over the flattened group), where the
    planner knows the levels; None where no measured point could apply. The record's key must equal it."""
    from cpcompile.cost.measured import point_of_site

    if shape is None:
        return None
    nodes = -(-cp // topo.per_node)
    shape = dataclasses.replace(shape, levels=None if nodes == 1 else (nodes, topo.per_node))
    return point_of_site(shape, layout, link_gbps(), inter_gbps())


def _count(link: Link, step, topo: Topology) -> dict:
    """One recorded step on `topo`: what the link group counted (bytes, link time) and the sleeps' GPU time. On
    CUDA the sleep clock is first corrected by one measured step (the SM clock under load is not the idle one,
    and each sleep has a launch; the correction is held within 0.5-2x and recorded as `sleep_scale`)."""
    link.topology, link.enabled, link.scale = topo, True, 1.0
    link.record()
    step()
    sent, waits = link.stop(), link.waits
    measured = link.measured_ms()
    target = 1e3 * sum(s.seconds for s in sent)
    if measured > 0 and target > 0:
        link.scale = min(2.0, max(0.5, target / measured))
        link.record()
        step()
        link.stop()
        measured = link.measured_ms()
    return dict(
        link_bytes=sum(s.bytes for s in sent), link_ms=round(target, 4), link_measured_ms=round(measured, 4),
        sleep_scale=round(link.scale, 4), collectives=len(sent), waited=waits,
        bytes_by_group={g: sum(s.bytes for s in sent if s.group == g) for g in dict.fromkeys(s.group for s in sent)},
    )  # fmt: skip


def run_case(env: Env, case: Case) -> list[dict]:
    """Compile `case` once as CP rank 0 on a link group, then time it on each topology and with the link off."""
    from torch.distributed.device_mesh import init_device_mesh

    ref = single_ms(env, case)
    records = []
    with link_group(0, case.cp, Topology(case.topologies[0], env.intra, env.inter)) as link:
        mesh = None
        if case.mesh:
            mesh = init_device_mesh("cpu", case.mesh, mesh_dim_names=("cp_inter", "cp_intra"))
        x, cu = _inputs(env, case)
        local, model_cu, longest = layer_inputs(case.layout, x, cu)
        be = cpcompile.backend(strategy=case.layout, comm=case.comm, kernel=env.kernel, inner=env.inner, mesh=mesh)
        fn = torch.compile(env.layer, backend=be, fullgraph=True, dynamic=False)
        extra = () if model_cu is None else (model_cu, longest)
        step = _step(fn, local, extra, torch.randn_like(local))
        t0 = time.perf_counter()
        link.enabled = False
        step()  # compile
        compile_s = time.perf_counter() - t0
        wire, site_shape = _wire(be, case)
        kernel = ",".join(sorted({p.kernel for p in be.plans}))
        topos = [Topology(n, env.intra, env.inter) for n in case.topologies]
        counts = [_count(link, step, t) for t in topos]

        def mode(topo: Topology | None, scale: float = 1.0):
            def run():
                link.enabled, link.scale = topo is not None, scale
                if topo is not None:
                    link.topology = topo
                step()

            return run

        fns = [mode(None)] + [mode(t, c["sleep_scale"]) for t, c in zip(topos, counts)]
        iters = env.iters
        if not iters:
            probe = env.time_ms([fns[0]], iters=1, warmup=0)[0]
            iters = max(3, min(10, int(3000 / max(probe, 1e-3) / len(fns))))
        compute_ms, *link_ms = env.time_ms(fns, iters=iters, warmup=1 if env.device == "cuda" else 0)
    for topo, count, t in zip(topos, counts, link_ms):
        rec = dict(
            layout=case.layout, comm=case.comm, S=case.tokens, S_total=case.tokens * case.cp, cp=case.cp,
            levels=topo.describe(case.cp).split(" ")[0], mesh=f"{case.mesh[0]}x{case.mesh[1]}" if case.mesh else None,
            kernel=kernel, hq=env.shape.hq, hkv=env.shape.hkv, head_dim=env.shape.head_dim,
            max_doc=longest if case.layout in PACKED else None, intra_gbps=env.intra, inter_gbps=env.inter,
            **wire, **count, step_ms_link=round(t, 4), step_ms_compute=round(compute_ms, 4),
            exposed_frac=round((t - compute_ms) / t, 4), single_gpu_ms=None if ref is None else round(ref, 4),
            efficiency_link=None if ref is None else round(ref / case.cp / t, 4),
            efficiency_compute=None if ref is None else round(ref / case.cp / compute_ms, 4),
            iters=iters, compile_s=round(compile_s, 1), rank=0,
            planner_point=planner_point(site_shape, case.layout, topo, case.cp),
        )  # fmt: skip
        if rec.get("wire_bytes_fwd") is not None:  # the packed regions' metadata check: 16 bytes to each peer
            rec["unmodelled_bytes"] = rec["link_bytes"] - rec["wire_bytes_fwd"] - rec["wire_bytes_bwd"]
        records.append(rec)
    return records


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench/results/overlap.json")
    p.add_argument("--quick", action="store_true", help="cp=8 at 8K tokens a rank only")
    p.add_argument("--budget", type=float, default=280.0, help="seconds; cases not started by then are skipped")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: the smoke test's tiny grid")
    p.add_argument("--iters", type=int, default=0, help="timed runs per mode (default: ~3 s a case, 3 to 10)")
    p.add_argument("--intra-gbps", type=float, default=link_gbps(), help="GB/s a rank sends inside a node "
                   f"(default: the cost model's, {link_gbps():g}; NVLink 4 is 450 a direction)")  # fmt: skip
    p.add_argument("--inter-gbps", type=float, default=inter_gbps(), help="GB/s a rank sends across nodes "
                   f"(default: the cost model's, {inter_gbps():g}: one 400 Gb/s NIC a GPU)")  # fmt: skip
    args = p.parse_args(argv)
    start = time.perf_counter()
    cuda = args.device == "cuda"
    torch._dynamo.config.cache_size_limit = 256
    torch._dynamo.config.accumulated_cache_size_limit = 1024
    env = Env(
        device=args.device, dtype=torch.bfloat16 if cuda else torch.float32, shape=LLAMA3_8B if cuda else SMALL,
        inner="inductor" if cuda else "aot_eager", kernel="auto",
        intra=args.intra_gbps, inter=args.inter_gbps, iters=args.iters if cuda else (args.iters or 1),
    )  # fmt: skip
    env.layer = build(env.shape, env.dtype, device=args.device)
    cases = grid(args.quick) if cuda else cpu_grid()
    stamp = dict(
        device=torch.cuda.get_device_name() if cuda else "cpu", torch=torch.__version__,
        measured_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    )  # fmt: skip
    records: list[dict] = []
    for case in cases:
        left = args.budget - (time.perf_counter() - start)
        if left <= 0:
            records.append(dict(layout=case.layout, comm=case.comm, S=case.tokens, cp=case.cp, skipped="budget"))
            continue
        t0 = time.perf_counter()
        try:
            got = run_case(env, case)
        except Exception as e:  # noqa: BLE001  (one failing case is a record; the others still run)
            traceback.print_exc()
            got = [dict(layout=case.layout, comm=case.comm, S=case.tokens, cp=case.cp,
                        error=f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")]  # fmt: skip
        torch._dynamo.reset()
        for rec in got:
            rec.update(stamp)
            records.append(rec)
            if "error" in rec:
                print(f"[overlap] {case.name}: ERROR {rec['error']}", flush=True)
                continue
            print(f"[overlap] {case.name} {rec['levels']}: link {rec['step_ms_link']:.3f} ms, compute "
                  f"{rec['step_ms_compute']:.3f} ms, exposed {rec['exposed_frac']:.3f}, link time "
                  f"{rec['link_ms']:.3f} ms (measured {rec['link_measured_ms']:.3f}), bytes beyond the registry's "
                  f"{rec.get('unmodelled_bytes')}, eff {rec['efficiency_link']} ({time.perf_counter() - t0:.0f} s)",
                  flush=True)  # fmt: skip
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)
    done = sum("step_ms_link" in r for r in records)
    skipped, errors = sum("skipped" in r for r in records), sum("error" in r for r in records)
    print(
        f"[overlap] {done} rows, {skipped} skipped, {errors} errors, {time.perf_counter() - start:.0f} s -> {args.out}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
