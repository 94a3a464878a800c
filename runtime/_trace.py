"""The profiler's hook points: the active recorder, or None.

A traced runtime call starts with

    if (rec := _trace.active) is not None and rec.outermost():
        return rec.call("Kernel.launch", {"kernel": self.name}, self.launch, grid, ...)

and ``Stream._write`` calls ``submitting`` the same way. With no profiler running that is
one module attribute load and one comparison, and no extra call: a decorator would cost
a wrapper frame on every launch, copy and allocation. With one, ``call`` times the call by
calling the function again, which then finds itself inside a traced call and runs its
body; only the outermost traced call of a thread is an event (``to_device``'s allocation
and copy are two events, a copy's internal wait is part of the copy).
``runtime.profile`` sets and clears :data:`active` (runtime/profiler.py records). This
module imports nothing of the runtime, so that every runtime module may import it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol


class Recorder(Protocol):
    def outermost(self) -> bool:
        """No traced call is running on this thread."""

    def call(self, name: str, args: dict[str, Any], fn: Callable[..., Any],
             *fn_args: Any) -> Any:
        """``fn(*fn_args)``, recorded as host event ``name`` with ``args``."""

    def submitting(self, stream: Any, wptr: int, packets: Sequence[Any]) -> None:
        """``stream`` is about to write ``packets`` after seqno ``wptr``."""


#: the running profiler, None when none runs
active: Recorder | None = None
