"""Finding cpcompile's error where Dynamo wrapped it (BackendCompilerFailed and friends)."""

from __future__ import annotations

from cpcompile import CPCompileError


def cp_error(excinfo) -> CPCompileError:
    """The CPCompileError in the cause/context chain of a pytest.raises result (assert there is one)."""
    err = excinfo.value
    while err is not None and not isinstance(err, CPCompileError):
        err = err.__cause__ or err.__context__
    assert err is not None, f"no CPCompileError in {excinfo.value!r}"
    return err
