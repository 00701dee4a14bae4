"""Integrations with other libraries, one module each; a module imports its library only when it is used.

hf: Hugging Face transformers (registered when transformers is imported: below); torchtitan: a batch adapter;
rows: the row packing shared by the torchtitan adapter and the demo.

`import cpcompile` must not import transformers (seconds of import time, and no dependency): if
`transformers.modeling_utils` is loaded already the integration registers at once, else a finder on sys.meta_path
registers it right after that module first loads (whoever imports it). Where transformers is not installed
nothing is installed at all.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

_AFTER = {"transformers.modeling_utils": "hf"}
"""Module whose first import triggers the registration -> the integration module (its `register()`)."""


def _register(integration: str) -> None:
    importlib.import_module(f"{__name__}.{integration}").register()


class _Loader(importlib.abc.Loader):
    """The real loader, then the integration's register()."""

    def __init__(self, loader, integration: str) -> None:
        self.loader, self.integration = loader, integration

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        _register(self.integration)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a watched module it asks the other finders and wraps the loader they return."""

    def find_spec(self, fullname, path, target=None):
        integration = _AFTER.get(fullname)
        if integration is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _Loader(spec.loader, integration)
                return spec
        return None


def install() -> None:
    """Register now where the library is loaded, else when it is (idempotent)."""
    pending = {}
    for module, integration in _AFTER.items():
        if module in sys.modules:
            _register(integration)
        elif importlib.util.find_spec(module.split(".")[0]) is not None:
            pending[module] = integration
    if pending and not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())
