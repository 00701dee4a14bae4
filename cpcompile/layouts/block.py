"""One attention block of a rank's work (pure data): its own module so that the layouts and the window math
(layouts/window.py) both build on it without importing each other."""

from __future__ import annotations

from dataclasses import dataclass

LOCAL_SOURCE = 0
"""Block source 0 is the rank's own (local) K/V; source 1 + i is the all-gather of local slot i."""

NO_WINDOW = (-1, -1)
"""A window (left, right) with both sides unbounded: no sliding window (a packed block's window, a planned
site's; a dense Block says None)."""


@dataclass(frozen=True)
class Block:
    """One attention call: local q rows [q_start, q_start+q_len) against keys [kv_start, kv_start+kv_len) of a
    K/V source. `causal` means a causal square (q and keys are the same tokens), else no mask at all, unless
    `window` (left, right) is set (layouts/window.py; then causal is False): key j is visible to row i iff
    -left <= j - i - (kv_len - q_len) <= right, each side unbounded when -1 (flash-attn's window_size on the
    bottom-right diagonal)."""

    q_start: int
    q_len: int
    source: int
    kv_start: int
    kv_len: int
    causal: bool
    window: tuple[int, int] | None = None
