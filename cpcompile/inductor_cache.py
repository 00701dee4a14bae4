"""Inductor's caches must know cpcompile's own code, not only the graph it is given.

Inductor's FX-graph cache and AOT autograd's cache key on the Dynamo graph they receive. After the pass that
graph calls a region function by name (`ring_attention(q, k, v, ...)`); the collectives and executor ops inside
it are traced later. So a changed cpcompile (an upgrade, an edit, another checkout on the same machine) would
load the graph compiled for the old regions: seen as "attend_blocks() expected at most 10 argument(s) but
received 11" between two checkouts; worse, an old region could run silently. The key gets a fingerprint of
cpcompile's sources through the one hook Inductor offers for it: a custom post-grad pass whose `uuid()` enters
both keys (it changes nothing in the graph; a user's own pass is kept and run first).
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

PACKAGE = Path(__file__).resolve().parent


@functools.cache
def source_fingerprint(root: Path = PACKAGE) -> str:
    """sha256 over every .py file of the package (relative path and bytes), in a stable order."""
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


class CodeKey(CustomGraphPass):
    """A post-grad pass that changes nothing and keys Inductor's caches on cpcompile's sources."""

    def __init__(self, user_pass=None) -> None:
        self.user_pass = user_pass

    def __call__(self, graph: torch.fx.Graph) -> None:
        if self.user_pass is not None:
            self.user_pass(graph)

    def uuid(self):
        inner = None if self.user_pass is None else self.user_pass.uuid()
        return ("cpcompile", source_fingerprint(), inner)


def cache_key_patches(user_pass=None) -> dict:
    """Inductor config patches for a graph holding cpcompile regions; `user_pass`: a post-grad pass the user gave
    in torch.compile's options (else the one configured), run first and keyed too."""
    user = torch._inductor.config.post_grad_custom_post_pass if user_pass is None else user_pass
    return {"post_grad_custom_post_pass": user if isinstance(user, CodeKey) else CodeKey(user)}
