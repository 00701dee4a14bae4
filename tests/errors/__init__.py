"""Refusals: every unsupported input raises one CPCompileError (node, rule, fix) before any communication."""
