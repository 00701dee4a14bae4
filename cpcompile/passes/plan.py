"""Plan each attention site: pick layout x comm x kernel and check every rule, failing with one clear error."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.fx

from ..errors import CPCompileError, node_origin, site_error
from ..groups import CPGroup
from ..head_split import head_split_problem
from ..kernels import resolve_kernel
from ..layouts import get_layout
from ..layouts.thd import THD_LAYOUTS
from ..regions import REGIONS
from .match import AttentionSite

COMMS = ("all_gather", "a2a")


@dataclass(frozen=True)
class CPConfig:
    """What the user asked for in cpcompile.backend(...)."""

    strategy: str
    comm: str
    kernel: str


@dataclass(frozen=True)
class CPPlan:
    """How one site becomes a CP region: everything the region call needs, as constants."""

    site: AttentionSite
    layout: str
    comm: str
    kernel: str
    causal: bool
    scale: float
    group: CPGroup

    def region_target(self):
        return REGIONS[self.comm]

    def region_args(self) -> tuple:
        return (self.site.query, self.site.key, self.site.value)

    def region_kwargs(self) -> dict:
        return dict(
            layout=self.layout,
            causal=self.causal,
            scale=self.scale,
            kernel=self.kernel,
            group_name=self.group.name,
            rank=self.group.rank,
            world=self.group.size,
        )


def _constant(site: AttentionSite, name: str, value, types):
    if isinstance(value, torch.fx.Node) or not isinstance(value, types):
        raise site_error(
            site.node,
            f"its `{name}` is {'a traced value' if isinstance(value, torch.fx.Node) else repr(value)}, "
            "cpcompile needs a Python constant there",
            f"pass `{name}` as a plain Python constant so the pass can plan the CP region",
        )
    return value


def _is_static(shape: tuple) -> bool:
    return all(isinstance(s, int) for s in shape)


def plan_site(site: AttentionSite, config: CPConfig, group: CPGroup) -> CPPlan:
    """Validate `site` against the rules of CP with this config and return its plan (or raise CPCompileError)."""
    node = site.node
    if site.kind == "varlen":
        from .plan_varlen import plan_varlen_site

        return plan_varlen_site(site, config, group)
    if config.strategy in THD_LAYOUTS:
        raise site_error(
            node,
            f"strategy={config.strategy!r} lays out packed documents for varlen_attn, but this is "
            "scaled_dot_product_attention over one unpacked sequence",
            "use strategy='flat' or 'zigzag' for SDPA models, or call torch.nn.attention.varlen.varlen_attn",
        )
    if site.attn_mask is not None:
        raise site_error(
            node,
            "an explicit attn_mask tensor cannot be sharded across CP ranks",
            "use is_causal=True (or no mask) in scaled_dot_product_attention; for padded or packed "
            "sequences use varlen attention with cu_seqlens",
        )
    dropout = _constant(site, "dropout_p", site.dropout_p, (int, float))
    if dropout != 0:
        raise site_error(
            node,
            f"dropout_p={dropout}: attention dropout is not supported in a CP region",
            "set attention dropout to 0 (e.g. attention_dropout=0.0 in the model config)",
        )
    causal = bool(_constant(site, "is_causal", site.is_causal, (bool, int)))
    for name, shape in (("query", site.q_shape), ("key", site.k_shape), ("value", site.v_shape)):
        if len(shape) != 4:
            raise site_error(
                node,
                f"its {name} has shape {shape}; cpcompile needs 4-D (batch, heads, seq, head_dim) inputs",
                "call scaled_dot_product_attention with 4-D tensors",
            )
        if not _is_static(shape):
            raise site_error(
                node,
                f"its {name} has a dynamic shape {shape}; the CP blocks are planned for static lengths",
                "compile with dynamic=False (pad batches to a fixed length with cpcompile.pad_to_multiple); "
                "without it, Dynamo makes a length dynamic by itself once a second length is compiled",
            )
    (_, _, sq, d), (_, _, sk, _), (_, _, sv, _) = site.q_shape, site.k_shape, site.v_shape
    if sq != sk or sk != sv:
        raise site_error(
            node,
            f"q has {sq} local tokens but k/v have {sk}/{sv}; CP shards q, k and v along the same sequence",
            "use CP only for self-attention whose q, k and v come from the same sharded tokens",
        )
    if site.v_shape[-1] != d or site.k_shape[-1] != d:
        raise site_error(
            node,
            f"q/k head dim {d} and v head dim {site.v_shape[-1]} differ; the CP kernels take one head dim",
            "use the same head dim for q, k and v (pad v's head dim and slice the output)",
        )
    if config.comm == "a2a" and (problem := head_split_problem(site.q_shape[1], site.k_shape[1], group.size)):
        raise site_error(node, *problem)
    layout = get_layout(config.strategy)
    if sq % layout.chunks_per_rank != 0:
        raise site_error(
            node,
            f"layout {layout.name!r} splits each rank's tokens into {layout.chunks_per_rank} equal chunks, "
            f"but this rank has {sq} tokens",
            f"pad the global sequence to a multiple of {layout.required_multiple(group.size)} tokens "
            "(cpcompile.pad_to_multiple) before cpcompile.shard",
        )
    try:
        kernel = resolve_kernel(config.kernel, site.device, site.dtype, d)
    except CPCompileError as e:
        raise CPCompileError(f"cpcompile cannot rewrite {node_origin(node)}: {e}") from None
    scale = float(_constant(site, "scale", site.scale, (int, float))) if site.scale is not None else 1 / math.sqrt(d)
    return CPPlan(
        site=site, layout=layout.name, comm=config.comm, kernel=kernel, causal=causal, scale=scale, group=group
    )
