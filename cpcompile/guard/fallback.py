"""The fallback for an aten op no rule covers: DTensor's sharding propagator, asked about the op with the token
dim placed `Shard(dim)` on a 2-rank mesh that has no process group. Only where the tokens sit on a whole dim (a
plain `Shard`) and only an answer that moves nothing and places the outputs on plain dims is taken; anything
else (no strategy, a redistribution, a torch whose strategy API differs) is a refusal, never a silent pass."""

from __future__ import annotations

import functools

import torch
from torch.utils import _pytree as pytree

from .rules import Verdict, refuse
from .tags import Seq, whole


@functools.cache
def _mesh(device_type: str):
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh(device_type, torch.arange(2), _init_backend=False, _rank=0)


def _placement(t: torch.Tensor, tag):
    from torch.distributed.tensor import Replicate, Shard

    if tag is None:
        return Replicate()
    if isinstance(tag, Seq) and len(tag.parts) == 1:
        p = tag.parts[0]
        if p.lo == 1 and p.hi == t.shape[p.dim]:
            return Shard(p.dim)
    return None


def ask_dtensor(func, args, kwargs, outs, tag) -> Verdict:
    """DTensor's answer for an op with no rule (see module doc)."""
    why = f"{func} has no token rule"
    try:
        from torch.distributed.tensor import DTensor, Replicate, Shard
        from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
        from torch.distributed.tensor._op_schema import OpSchema

        mesh = _mesh("cpu")
        specs = {}

        def spec(t):
            p = _placement(t, tag(t))
            if p is None:
                raise ValueError("tokens merged with another dim")
            specs[id(t)] = p
            return DTensorSpec(mesh, (p,), tensor_meta=TensorMeta(t.shape, t.stride(), t.dtype))

        prop = DTensor._op_dispatcher.sharding_propagator
        sargs, skwargs = pytree.tree_map_only(torch.Tensor, spec, (args, kwargs))
        schema = OpSchema(func, sargs, skwargs, schema_info=prop.op_to_schema_info.get(func))
        sharding = prop.propagate_op_sharding(schema)
        if sharding.redistribute_schema is not None:
            return refuse("gather", f"{why}, and DTensor would move its token-holding inputs")
        out_specs = sharding.output_spec
        out_specs = [out_specs] if out_specs is None or isinstance(out_specs, DTensorSpec) else list(out_specs)
        result = []
        for o, s in zip(outs, out_specs):
            p = s.placements[0] if isinstance(s, DTensorSpec) else Replicate()
            if isinstance(p, Replicate):
                result.append(None)
            elif type(p) is Shard:
                result.append(whole(p.dim % o.dim(), o.shape[p.dim]))
            else:
                return refuse("unknown", f"{why} (DTensor places its output {p})")
        return Verdict(tuple(result))
    except Exception as e:  # noqa: BLE001  (no strategy, or this torch's strategy API differs)
        return refuse("unknown", f"{why} ({type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]})")
