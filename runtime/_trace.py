"""The profiler's hook points: the active recorder, or None.

Every traced runtime call and ``Stream._write`` look at :data:`active` once, a module
attribute, so that with no profiler running the cost is one load and one comparison
(``runtime.profile`` sets and clears it; runtime/profiler.py records). This module imports
nothing of the runtime, so that every runtime module may import it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

F = TypeVar("F", bound=Callable[..., Any])
#: what a traced call adds to its host event's ``args`` (e.g. a kernel's name), from the
#: call's own arguments
Describe = Callable[..., dict[str, Any]]


class Recorder(Protocol):
    def call(self, name: str, describe: Describe | None, fn: Callable[..., Any],
             args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any: ...

    def submitting(self, stream: Any, wptr: int, packets: Sequence[Any]) -> None: ...


#: the running profiler, None when none runs
active: Recorder | None = None


def traced(name: str, describe: Describe | None = None) -> Callable[[F], F]:
    """Record calls of the decorated runtime API function as host events named ``name``
    while a profiler runs (only the outermost traced call of a thread: ``to_device``'s
    allocation and copy are two events, a copy's internal wait is part of the copy)."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            rec = active
            if rec is None:
                return fn(*args, **kwargs)
            return rec.call(name, describe, fn, args, kwargs)

        return call  # type: ignore[return-value]

    return wrap
