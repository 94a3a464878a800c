"""Bring-up as named steps, each with its undo: the driver's ``ivpu_dev_init``.

A Linux driver writes its initialisation as calls with goto-unwind labels
(``ivpu_dev_init``: ``ivpu_hw_init``, ``ivpu_fw_init``, ``ivpu_ipc_init``, ... ``ivpu_boot``;
a failure jumps to ``err_fw_fini``, which falls through ``err_...`` to the start), and its
remove path calls the same undos. Here that is a table of :class:`Step` run by
:func:`bring_up`:

- Steps run in order. On success it returns a :class:`Bringup` that remembers what was
  done; its ``teardown`` runs the undos in reverse. A device's stop and reset call it, so
  the error path and the teardown path are one path, not two.
- On a failure at step k it runs the undos of steps k-1..0, then re-raises the original
  error with the step's name attached (:func:`failed_step`, and a note in its traceback).
  Each undo releases exactly what its step made; a ``do`` that fails half-way releases its
  own half, since its undo does not run.
- An undo that raises is logged, and noted on the original error, and the chain goes on:
  it never replaces the error that caused the unwind nor stops the other undos.
- ``do`` and ``undo`` may be plain functions or coroutine functions (trio). Undos run
  shielded from cancellation: a daemon told to stop in the middle of a boot still reaps
  what the boot started.
- A step can be made to fail on purpose (``fail_at``, the driver's debugfs ``fail_step``):
  it fails before its ``do`` runs, with :data:`INJECTED_ERRNO` and a message naming it.

Why a table and not ``contextlib.AsyncExitStack``: a stack is built by the code as it
runs, so its steps have no names until then; here the names are data. The failure
injection picks a step by name, the test iterates over the table (a new step is covered
without touching it) and docs/driver.md lists it. Also, an exit stack lets a callback's
exception replace the one being unwound (chained onto it), and bring-up must report the
original error: the first thing that went wrong is what the user has to fix.
"""

from __future__ import annotations

import errno
import inspect
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import trio

from kmod_emul.errors import DriverError

log = logging.getLogger(__name__)

T = TypeVar("T")
Action = Callable[[T], "Awaitable[None] | None"]

#: The errno of an injected failure: no real failure uses it, so it cannot be mistaken for one.
INJECTED_ERRNO = errno.ECANCELED
_STEP_ATTR = "bringup_step"


@dataclass(frozen=True)
class Step(Generic[T]):
    """One step of a bring-up: ``do(target)`` makes something, ``undo(target)`` releases
    exactly that (None: the step holds nothing once done)."""

    name: str
    do: Action[T]
    undo: Action[T] | None = None


def injected_message(name: str) -> str:
    return (f"injected failure at bring-up step {name} (debugfs fail_step); "
            f"write none to fail_step and reset the device")


def failed_step(exc: BaseException) -> str | None:
    """The name of the bring-up step ``exc`` failed, if it came out of :func:`bring_up`."""
    return getattr(exc, _STEP_ATTR, None)


async def _call(action: Action[T], target: T) -> None:
    result = action(target)
    if inspect.isawaitable(result):
        await result


@dataclass(eq=False)
class Bringup(Generic[T]):
    """What a successful bring-up did, for its teardown (the same undos, in reverse)."""

    label: str
    target: T
    done: list[Step[T]] = field(default_factory=list)

    async def teardown(self) -> list[BaseException]:
        """Undo every step done, last first; idempotent. Returns the undos' errors (each
        logged): teardown always runs to the end, and whatever an undo could not release
        is reported, not raised over the rest."""
        errors: list[BaseException] = []
        with trio.CancelScope(shield=True):
            while self.done:
                step = self.done.pop()
                if step.undo is None:
                    continue
                try:
                    await _call(step.undo, self.target)
                except Exception as exc:  # collected and logged, see the docstring
                    log.error("%s: undo of bring-up step %s failed", self.label, step.name,
                              exc_info=exc)
                    exc.add_note(f"while undoing bring-up step {step.name} of {self.label}")
                    errors.append(exc)
        return errors


async def bring_up(steps: Sequence[Step[T]], target: T, label: str,
                   fail_at: str | None = None) -> Bringup[T]:
    """Run ``steps`` over ``target`` in order; see the module doc. ``fail_at`` names a step
    to fail on purpose (None or "" for none)."""
    names = [s.name for s in steps]
    assert len(set(names)) == len(names), f"bring-up steps named twice: {names}"
    if fail_at and fail_at not in names:
        raise ValueError(f"no bring-up step {fail_at!r}; the steps are {', '.join(names)}")
    up = Bringup(label, target)
    for step in steps:
        try:
            if step.name == fail_at:
                raise DriverError(INJECTED_ERRNO, injected_message(step.name))
            await _call(step.do, target)
        except BaseException as exc:
            if isinstance(exc, Exception):
                setattr(exc, _STEP_ATTR, step.name)
                exc.add_note(f"at bring-up step {step.name} of {label}")
                log.warning("%s: bring-up step %s failed (%s); undoing %s", label, step.name,
                            exc, ", ".join(s.name for s in reversed(up.done)) or "nothing")
            for err in await up.teardown():
                exc.add_note(f"undo failed too: {err!r}")
            raise
        up.done.append(step)
    return up
