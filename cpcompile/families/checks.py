"""Checks both planners share: constants where the plan needs them, static shapes, a kernel for the site."""

from __future__ import annotations

import torch
import torch.fx

from ..errors import CPCompileError, node_origin, site_error
from ..kernels import resolve_kernel
from .site import AttentionSite


def constant(site: AttentionSite, name: str, value, types):
    """`value` when it is a Python constant of `types`, else the site's CPCompileError."""
    if isinstance(value, torch.fx.Node) or not isinstance(value, types):
        raise site_error(
            site.node,
            f"its `{name}` is {'a traced value' if isinstance(value, torch.fx.Node) else repr(value)}, "
            "cpcompile needs a Python constant there",
            f"pass `{name}` as a plain Python constant so the pass can plan the CP region",
        )
    return value


def is_static(shape: tuple) -> bool:
    return all(isinstance(s, int) for s in shape)


def site_kernel(
    site: AttentionSite, name: str, head_dim: int, varlen: bool = False, features: tuple[str, ...] = ()
) -> str:
    """The provider for this site (kernels.resolve_kernel, for q/k's head dim and v's, and the optional block
    `features` it needs: "window", "softcap"), its refusal worded as the site's error: a v head dim that differs
    (MLA) is refused here only when no provider takes it."""
    try:
        return resolve_kernel(
            name, site.device, site.dtype, head_dim, varlen=varlen, v_head_dim=site.v_shape[-1], features=features
        )
    except CPCompileError as e:
        raise CPCompileError(f"cpcompile cannot rewrite {node_origin(site.node)}: {e}") from None
