"""Bad inputs of one command, for the raw per-command tests of tests/driver/ (test_cmd_*.py).

A ``Bad`` names one bad input and the errno the driver must answer it with; ``build``
makes what is sent from an ``Env`` (the test's raw clients on the shared daemon and
whatever the case needs, all closed at the end): a command struct, sent with
``RawDev.call``, or the whole write as bytes, header included. ``generic`` adds what every
command must refuse the same way -- a struct one byte short or long, the other direction,
non-zero reserved and padding fields, unknown flags, no context on the file, another
context's id -- to the cases a test lists for its own command.

After its refusal each case checks, in its test, that a good call of the same command
still works and that nothing else was harmed (``rawdev.assert_unharmed``: the device
answers and a bystander context on it keeps completing work).
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rawdev import RawDev, errname, header

from abi import uapi, userq
from runtime._shm import sealed_memfd


class Env:
    """A test's raw clients: ``dev`` (its context, ``ctx``, made on first use) and the
    ``bystander`` (another context on the same device, ``other_ctx``); ``fresh`` files
    and every descriptor a case registers are closed by ``close``."""

    def __init__(self, daemon: Any, dev: RawDev, bystander: tuple[RawDev, int]) -> None:
        self.daemon, self.dev, self.bystander = daemon, dev, bystander
        self.other, self.other_ctx = bystander
        self._ctx: int | None = None
        self._close: list[Callable[[], None]] = []

    @property
    def ctx(self) -> int:
        if self._ctx is None:
            self._ctx = self.dev.ctx_create()
        return self._ctx

    def fresh(self, node: int = 0) -> RawDev:
        """Another open file of the device node (of device ``node``), with no context."""
        d = RawDev(self.daemon.node(node))
        self._close.append(d.close)
        return d

    def fd(self, fd: int) -> int:
        """Close ``fd`` at the end; returns it."""
        self._close.append(lambda: os.close(fd))
        return fd

    def memfd(self, size: int, seals: int | None = uapi.ACCEL_SEALS_PINNED,
              data: bytes | None = None) -> int:
        """A memfd of ``size`` bytes: sealed as ``runtime._shm`` seals (immutable with
        ``data``), or not sealed at all with ``seals=None``."""
        if seals is None:
            fd = os.memfd_create("unsealed", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            os.ftruncate(fd, size)
        else:
            fd = sealed_memfd("case", size, data)
        return self.fd(fd)

    def pipe(self) -> tuple[int, int]:
        r, w = os.pipe()
        return self.fd(r), self.fd(w)

    def ctx_arg(self, target: RawDev | None = None, **change: Any) -> uapi.accel_ctx_create:
        """A CTX_CREATE struct of ``target`` (``dev``) naming fresh pipes and a doorbell
        page, ``change`` applied; the descriptors it lends are closed at the end."""
        target = target or self.dev
        arg = target.ctx_args()
        for fd in target._lend:
            self.fd(fd)
        for field, value in change.items():
            setattr(arg, field, value)
        return arg

    def close(self) -> None:
        for fn in reversed(self._close):
            fn()
        self._close.clear()


@dataclass(frozen=True)
class Bad:
    """One bad input: ``build(env)`` makes what is sent (a struct, or the whole write);
    ``no_context``: sent on a fresh file that holds no context."""

    name: str
    errno: str
    build: Callable[[Env], Any]
    no_context: bool = False

    def __str__(self) -> str:  # the test id
        return f"{self.name}-{self.errno}"


#: The errnos of a refused reach for what another tenant holds: each is counted.
ISOLATION_ERRNOS = ("EPERM", "EACCES")


def isolation_refusals(daemon: Any) -> int:
    """Every device's count of refused reaches for another tenant's resources."""
    return sum(int(daemon.attr(i, "isolation/total")) for i in range(daemon.devices))


def refuse(env: Env, cmd: uapi.Command, bad: Bad) -> None:
    """Send ``bad`` and check it fails with exactly its errno, and that the driver counted
    it as an isolation refusal if (and only if) that errno says it was one."""
    target = env.fresh() if bad.no_context else env.dev
    sent = bad.build(env)
    before = isolation_refusals(env.daemon)
    if isinstance(sent, bytes):
        got = errname(lambda: target.write(sent))
    else:
        got = errname(lambda: target.call(cmd, sent))
    assert got == bad.errno, f"{cmd.name} {bad.name}: {got or 'success'}, wanted {bad.errno}"
    # the reason reaches the client: the command (or "write", refused before it was
    # known), the errno and a message, on one line
    reason = target.last_error()
    assert reason.startswith((f"{cmd.name} {bad.errno}: ", f"write {bad.errno}: ")), reason
    assert reason.endswith("\n") and reason.count("\n") == 1 and len(reason) > 20, reason
    counted = isolation_refusals(env.daemon) - before
    assert counted == (bad.errno in ISOLATION_ERRNOS), f"{cmd.name} {bad.name}: {counted} counted"


def _raw(cmd: uapi.Command, code: int, payload: bytes) -> bytes:
    return header(code, 4242) + payload


def generic(cmd: uapi.Command, good: Callable[[Env], Any], *, context: bool = True) -> list[Bad]:
    """What every command refuses alike, built from ``good`` (the struct of a valid call):
    a struct one byte short or long and the other transfer direction (EINVAL); each
    ``pad*``/``reserved*`` field non-zero (EINVAL); unknown ``flags`` (EINVAL); and, with
    ``context``, the call on a file without a context (EBADFD) and naming the bystander's
    context (EPERM: it exists, and is not this file's) and one nobody holds (ENOENT)."""
    size = ctypes.sizeof(cmd.struct)
    flipped = cmd.code ^ (uapi.IOC_WRITE << 30 if cmd.has_reply else uapi.IOC_READ << 30)
    cases = [
        Bad("short", "EINVAL", lambda env: _raw(cmd, cmd.code, bytes(good(env))[:size - 1])),
        Bad("long", "EINVAL", lambda env: _raw(cmd, cmd.code, bytes(good(env)) + b"\0")),
        Bad("direction", "EINVAL", lambda env: _raw(cmd, flipped, bytes(good(env)))),
    ]
    for lo, hi in cmd.struct.reserved_ranges():
        name = next(n for n, *_ in cmd.struct._fields_ if getattr(cmd.struct, n).offset == lo)

        def nonzero(env: Env, lo: int = lo, hi: int = hi) -> bytes:
            raw = bytearray(bytes(good(env)))
            raw[hi - 1] = 0x5A
            return _raw(cmd, cmd.code, bytes(raw))

        cases.append(Bad(name, "EINVAL", nonzero))
    if any(n == "flags" for n, *_ in cmd.struct._fields_):
        def flags(env: Env) -> Any:
            arg = good(env)
            arg.flags = 1 << 31
            return arg

        cases.append(Bad("flags", "EINVAL", flags))
    if context:
        def theirs(env: Env) -> Any:
            arg = good(env)
            arg.ctx_id = env.other_ctx
            return arg

        def stale(env: Env) -> Any:
            arg = good(env)
            arg.ctx_id = env.ctx + 1_000_000
            return arg

        cases += [Bad("no-context", "EBADFD", lambda env: good(env), no_context=True),
                  Bad("bystander-context", "EPERM", theirs),
                  Bad("unknown-context", "ENOENT", stale)]
    return cases


def ring_done(dev: RawDev, queue_id: int, seqno: int, timeout: float = 20.0) -> None:
    """Wait until queue ``queue_id``'s ring completed ``seqno``, without a fault."""
    _slot, ring = dev.rings[queue_id]
    deadline = time.monotonic() + timeout
    while ring.completed < seqno:
        assert time.monotonic() < deadline, f"queue {queue_id} completed {ring.completed}"
        dev.sleep_event(0.05)
    assert ring.read_fault() == (0, 0, 0, 0), ring.read_fault()


NOP = userq.Nop().encode()
