"""Register accel's Dynamo device interface (torch_accel/dynamo.py) when Dynamo loads it.

``torch._dynamo`` takes seconds to import, so ``import torch_accel`` (which every ``import
torch`` does, through backend autoloading) must not import it, yet its table of device
interfaces must hold ``accel`` before Dynamo first looks a device up. A finder on
``sys.meta_path`` sees ``torch._dynamo`` being imported and registers ours right after the
package's own code ran (not inside it: Dynamo's modules are half made until then): a
post-import hook.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType

#: Dynamo's package: once its ``__init__`` ran, its device table and ``allow_in_graph`` exist
TARGET = "torch._dynamo"


def _register() -> None:
    from torch_accel import dynamo

    dynamo.register()


class _Loader(importlib.abc.Loader):
    """The target's own loader, then our registration."""

    def __init__(self, inner: importlib.abc.Loader) -> None:
        self.inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        _register()


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path, target=None):  # noqa: ANN001, ANN201
        if name != TARGET:
            return None
        sys.meta_path.remove(self)  # once: the real spec comes from the other finders
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def install() -> None:
    """Register now if Dynamo is loaded, else when it is."""
    if TARGET in sys.modules:
        _register()
    else:
        sys.meta_path.insert(0, _Finder())
