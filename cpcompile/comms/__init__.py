"""Comm packages, one a comm (all_gather, a2a, ring, selective, hierarchical): its region for each attention family
it serves, its schedule, its rank_blocks and wire bytes, and entry.py building its Comm. comm/registry.COMMS lists
the entries."""
