"""The sdpa family's region call: the positional inputs every comm's sdpa region takes, in order."""

from __future__ import annotations

from typing import Any, NamedTuple


class DenseCall(NamedTuple):
    """An SDPA site's region: (q, k, v) of this rank's tokens, (B, H, L, D)."""

    q: Any
    k: Any
    v: Any
