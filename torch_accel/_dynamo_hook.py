"""Register accel with torch.compile's pieces when they load: Dynamo's device interface
(torch_accel/dynamo.py) and Inductor's code generator (torch_accel/inductor/).

``torch._dynamo`` and ``torch._inductor`` take seconds to import, so ``import torch_accel``
(which every ``import torch`` does, through backend autoloading) must import neither, yet
their tables (device interfaces; device code generators) must hold ``accel`` before they
first look a device up. A finder on ``sys.meta_path`` sees each target being imported and
registers ours right after the module's own code ran (not inside it: its package is half
made until then): a post-import hook.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable
from types import ModuleType


def _register_dynamo() -> None:
    from torch_accel import dynamo

    dynamo.register()


def _register_inductor() -> None:
    from torch_accel import inductor

    inductor.register()


#: module -> what registers accel with it, once it ran: Dynamo's package (its device table
#: and ``allow_in_graph`` exist), and Inductor's entry point ``compile_fx`` (every module
#: of Inductor's code generation is loaded by then)
TARGETS: dict[str, Callable[[], None]] = {
    "torch._dynamo": _register_dynamo,
    "torch._inductor.compile_fx": _register_inductor,
}


class _Loader(importlib.abc.Loader):
    """The target's own loader, then our registration."""

    def __init__(self, inner: importlib.abc.Loader, then: Callable[[], None]) -> None:
        self.inner = inner
        self.then = then

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        self.then()


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, name: str, then: Callable[[], None]) -> None:
        self.name = name
        self.then = then

    def find_spec(self, name: str, path, target=None):  # noqa: ANN001, ANN201
        if name != self.name:
            return None
        sys.meta_path.remove(self)  # once: the real spec comes from the other finders
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader, self.then)
        return spec


def install() -> None:
    """Register now with each target already loaded, else when it is."""
    for name, then in TARGETS.items():
        if name in sys.modules:
            then()
        else:
            sys.meta_path.insert(0, _Finder(name, then))
