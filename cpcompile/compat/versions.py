"""Which torch release is installed, as the compat modules' TORCH_VERSIONS name them ("2.13")."""

from __future__ import annotations

import torch


def torch_minor(version: str | None = None) -> str:
    """ "major.minor" of a torch version string (the installed torch's by default): "2.14.1+cu130" -> "2.14"."""
    major, minor = (version or torch.__version__).split("+")[0].split(".")[:2]
    return f"{major}.{minor}"


def serves(versions: tuple[str, ...], version: str | None = None) -> bool:
    """Whether a patch that states `versions` is meant for this torch."""
    return torch_minor(version) in versions
