"""Comm packages, one a comm (all_gather, a2a, ring, selective, hierarchical): its region for each attention family
it serves, its schedule, its rank_blocks and wire bytes, and entry.py building its Comm. Beside them: registry.py
(COMMS: the entries, by name) and dtensor.py (any comm's dense region on DTensor q/k/v)."""
