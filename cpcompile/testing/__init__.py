"""Helpers for tests and demos: a small Llama-style model and a bounded multi-process launcher."""
