"""Comm packages, one a comm: its region for each attention family it serves, its schedule, its wire bytes and
its registry entry (ring: comms/ring/). comm/registry.COMMS lists every comm."""
