"""Pieces shared by the comms' regions (comms/<name>/): partials (running merges and sums of partial results),
guards (the run-time checks the rewrite inserts), dtensor (the DTensor wrapper around any comm's dense region),
flex_call (one flex_attention call at global positions). None imports a comm package except dtensor, which
sits above them all: it reads the comm registry."""
