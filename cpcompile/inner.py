"""The compiler after the pass: Inductor, aot_eager, eager or a callable, with torch.compile's mode= / options=.

torch.compile hands a callable backend `mode=` and `options=` as keyword arguments (only when given); the
backend passes them on to Inductor as its config patches, like torch.compile's own Inductor path does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .errors import CPCompileError

INNER = ("inductor", "aot_eager", "eager")


def inductor_patches(mode: str | None, options: dict[str, Any] | None) -> dict[str, Any]:
    """Inductor config patches for torch.compile's mode= and options= (options win over the mode's)."""
    from torch._inductor import config, list_mode_options

    patches: dict[str, Any] = {}
    if mode and mode != "default":
        try:
            patches.update(list_mode_options(mode))
        except RuntimeError as e:
            raise CPCompileError(f"torch.compile(mode={mode!r}): {e}. Fix: use one of those modes.") from None
    known = config.get_config_copy()
    for key, value in (options or {}).items():
        name = key.replace("-", "_")
        if name not in known:
            raise CPCompileError(
                f"torch.compile(options={{{key!r}: ...}}): not an Inductor option. "
                "Fix: use a name from torch._inductor.list_options()."
            )
        patches[name] = value
    return patches


def inner_compiler(
    inner: str | Callable, mode: str | None, options: dict[str, Any] | None, overlap: dict[str, Any]
) -> Callable:
    """compiler(gm, example_inputs) for `inner`. mode/options go to Inductor (with `overlap`, the patches
    the CP regions need, unless the user's options set the same names) or to a callable inner as torch.compile
    would pass them; aot_eager and eager have no use for them, which is one CPCompileError."""
    given = bool(mode and mode != "default") or bool(options)
    if callable(inner):
        kwargs = {k: v for k, v in (("mode", mode), ("options", options)) if v}
        return lambda gm, example_inputs: inner(gm, example_inputs, **kwargs)
    if inner == "inductor":
        from torch._inductor.compile_fx import compile_fx

        patches = {**overlap, **inductor_patches(mode, options)}
        if not patches:
            return compile_fx
        return lambda gm, example_inputs: compile_fx(gm, example_inputs, config_patches=patches)
    if given:
        raise CPCompileError(
            f"torch.compile(mode={mode!r}, options={options!r}) with cpcompile.backend(inner={inner!r}): mode and "
            f"options configure Inductor, and {inner!r} takes none. Fix: drop mode=/options=, or use "
            "inner='inductor'."
        )
    if inner == "aot_eager":
        from torch._dynamo.backends.debugging import aot_eager

        return aot_eager
    return lambda gm, example_inputs: gm.forward
