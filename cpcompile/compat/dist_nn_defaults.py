"""torch.distributed.nn.functional's collectives take `group=group.WORLD` as a default argument, evaluated once,
when the module is first imported. Functional collectives import it lazily, at their first call (every CP region
makes some), so its defaults pin the default process group for the life of the process: destroy_process_group
then cannot destroy it, gloo's worker threads outlive it into interpreter shutdown, and one that frees a
collective's tensor there needs the GIL, is ended by Python, and aborts the process ("terminate called without an
active exception" after a run that printed `done:`; examples/torchrun, issue 43; tests/unit/test_shutdown.py).

`unpin_default_group()` imports the module and puts None in place of any ProcessGroup among its functions'
defaults: those functions pass `group` on to torch.distributed, which reads None as the default group, so they
behave the same and keep nothing alive.
"""

from __future__ import annotations

import types

import torch.distributed as dist

TORCH_VERSIONS = ("2.11", "2.12", "2.13", "2.14")
"""Checked against the installed torch by tests/unit/test_compat.py (the defaults still pin the group there)."""


def pinning_functions() -> list[str]:
    """The names of torch.distributed.nn.functional's functions whose defaults hold a ProcessGroup now."""
    import torch.distributed.nn.functional as nn_functional

    return [
        name
        for name, fn in vars(nn_functional).items()
        if isinstance(fn, types.FunctionType)
        and fn.__module__ == nn_functional.__name__
        and any(isinstance(d, dist.ProcessGroup) for d in fn.__defaults__ or ())
    ]


def unpin_default_group() -> None:
    """Replace every ProcessGroup default of torch.distributed.nn.functional's functions by None (idempotent;
    imports the module, so a later import binds nothing either)."""
    import torch.distributed.nn.functional as nn_functional

    for name in pinning_functions():
        fn = getattr(nn_functional, name)
        fn.__defaults__ = tuple(None if isinstance(d, dist.ProcessGroup) else d for d in fn.__defaults__)
