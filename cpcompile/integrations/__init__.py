"""Adapters for training frameworks, one module each; a module imports its framework only when it is used."""
