"""Attention families: one package each (sdpa, varlen, flex) with its matcher, planner, plan type and region-call
schema."""
