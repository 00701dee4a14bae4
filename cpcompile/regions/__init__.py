"""Pieces shared by the comms' regions (comms/<name>/): partials (running merges and sums of partial results),
guards (the run-time checks the rewrite inserts), flex_call (one flex_attention call at global positions). None
imports a comm package (the DTensor wrapper around any comm's dense region, which reads the comm registry, is
comms/dtensor.py)."""
