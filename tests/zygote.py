"""Snippets run in forks of one interpreter that has imported torch: the torch tests' fresh
processes without a torch import each.

Importing torch (which autoloads torch_accel) takes 3-4 s of a 2-core machine at load 3, and
the torch tests run a hundred-odd snippets, each in a process of its own (torch_accel's
state, like the runtime's, is per process). ``Zygote`` starts one interpreter that imports
torch, torch_accel and the runtime -- imports only: nothing initialises the runtime, opens
a device or runs an operator -- and forks it for each snippet. A fork of a process that
never initialised is a process the runtime and torch_accel see as fresh: their fork rule
refuses a child only after the parent's initialisation (runtime/devices.py,
torch_accel/_hooks.py; tests/runtime/test_fork.py proves "before init, the child may
initialise"), and a child's torch has a fresh one's thread counts (no parallel region ran
in the zygote).

The child runs the snippet as ``python -c`` would: as ``__main__``, with the snippet's
stdin, stdout and stderr (files the caller passes over the socket), its exit status that of
``SystemExit`` or 1 after an uncaught exception's traceback, then non-daemon threads
joined and ``atexit`` handlers run. A snippet whose environment differs from the one the
zygote started with runs in a fresh interpreter instead (``Daemon.run_py``): what the
difference changes may have been read at import (torch_accel/ops/fallback.py reads
``TORCH_ACCEL_FALLBACK_WARN`` so).

A zygote may import more than ``PRELOAD`` (``Zygote(daemon, preload=...)``): the
torch.compile tests fork one that has imported Inductor too, seconds of CPU a process
would spend before its first compile. Imports only, there too.

``python tests/zygote.py SOCKET PRELOAD`` is the server (started by ``Zygote``); the rest
is its client, with ``Daemon.run_py``'s signature.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from testkit.daemon import Daemon

#: what the server imports before it forks anything
PRELOAD = "import numpy, torch, torch_accel, runtime"
#: how often the server reaps children while no request comes (s)
REAP_S = 0.01
_STATUS = struct.Struct("!qq")  # pid, then the child's wait status
#: what pytest changes in its environment test by test: the child gets the caller's value
PER_TEST = ("PYTEST_CURRENT_TEST",)


def _run_child(code: str, env: dict[str, str], cwd: str) -> None:
    """In the forked child: run ``code`` as ``python -c`` would, then exit. Never returns."""
    import atexit
    import threading
    import traceback
    import types

    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.argv = ["-c"]
    sys.path[0] = ""  # python -c's first entry, where the server's script directory was
    main = types.ModuleType("__main__")
    main.__builtins__ = __builtins__
    sys.modules["__main__"] = main
    status = 0
    try:
        exec(compile(code, "<string>", "exec"), main.__dict__)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            status = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            status = 1
    except BaseException as e:  # noqa: BLE001 - what the interpreter prints, then status 1
        # the snippet's frames only (a SyntaxError has none: compile raised it here)
        tb = e.__traceback__.tb_next if e.__traceback__ else None
        traceback.print_exception(type(e), e, tb)
        status = 1
    try:
        threading._shutdown()  # type: ignore[attr-defined] - as the interpreter's exit
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(status)


def serve(path: str, preload: str) -> None:
    """Run ``preload``, then listen on ``path``; per connection, receive a request (JSON:
    code, env, cwd) and the snippet's stdin, stdout and stderr, fork, answer the child's
    pid and, once it has exited, its wait status. One thread: children are forked from it
    alone."""
    exec(preload, {})
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    print("ready", flush=True)
    waiting: dict[int, socket.socket] = {}
    while True:
        ready, _, _ = select.select([listener, sys.stdin], [], [], REAP_S)
        if sys.stdin in ready and not sys.stdin.readline():  # the client is gone: stop
            for pid in waiting:
                os.kill(pid, signal.SIGKILL)
            return
        if listener in ready:
            conn, _ = listener.accept()
            msg, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
            while chunk := conn.recv(1 << 16):  # the rest of the request, to the client's EOF
                msg += chunk
            request = json.loads(msg)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                listener.close()
                conn.close()
                for child_fd, fd in enumerate(fds):
                    os.dup2(fd, child_fd)
                    os.close(fd)
                _run_child(request["code"], request["env"], request["cwd"])
            for fd in fds:
                os.close(fd)
            _answer(conn, pid, 0)
            waiting[pid] = conn
        while waiting:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = waiting.pop(pid)
            _answer(conn, pid, status)
            conn.close()


def _answer(conn: socket.socket, pid: int, status: int) -> None:
    """Tell the client; one that gave up (a timeout: it killed the child) hears nothing."""
    try:
        conn.sendall(_STATUS.pack(pid, status))
    except OSError:
        pass


class Zygote:
    """The client: a server started with ``daemon``'s environment that has run ``preload``
    (import statements), stopped by ``close``."""

    def __init__(self, daemon: Daemon, preload: str = PRELOAD) -> None:
        from testkit import REPO  # here: the server imports nothing a snippet would not

        self.daemon = daemon
        self.cwd = str(REPO)
        self.env = _steady(daemon.env())
        self._dir = tempfile.mkdtemp(prefix="accel-zygote-")
        self.path = os.path.join(self._dir, "socket")
        self.proc = subprocess.Popen([sys.executable, __file__, self.path, preload],
                                     env=self.env,
                                     cwd=self.cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        line = self.proc.stdout.readline().strip()
        if line != "ready":
            self.close()
            raise RuntimeError(f"the zygote did not start ({self.proc.wait()}): {line!r}")

    def run_py(self, code: str, *, timeout: float = 60, **env: str
               ) -> subprocess.CompletedProcess[str]:
        """``Daemon.run_py`` in a fork of the zygote (a fresh interpreter when ``env``
        changes the environment)."""
        want = self.daemon.env(**env)
        if _steady(want) != self.env:
            return self.daemon.run_py(code, timeout=timeout, **env)
        code = textwrap.dedent(code)
        with open(os.devnull, "rb") as stdin, tempfile.TemporaryFile() as out, \
                tempfile.TemporaryFile() as err, \
                socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(self.path)
            request = json.dumps({"code": code, "env": want, "cwd": self.cwd}).encode()
            socket.send_fds(conn, [request[:1 << 16]], [stdin.fileno(), out.fileno(), err.fileno()])
            conn.sendall(request[1 << 16:])
            conn.shutdown(socket.SHUT_WR)  # the request's end
            pid, _ = _STATUS.unpack(_recv(conn, _STATUS.size, time.monotonic() + 30))
            try:
                _, status = _STATUS.unpack(_recv(conn, _STATUS.size,
                                                 time.monotonic() + timeout))
            except TimeoutError:
                os.kill(pid, signal.SIGKILL)
                raise subprocess.TimeoutExpired(["zygote", "-c", code], timeout) from None
            out.seek(0)
            err.seek(0)
            return subprocess.CompletedProcess(
                ["zygote", "-c", code], os.waitstatus_to_exitcode(status),
                out.read().decode(errors="replace"), err.read().decode(errors="replace"))

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(30)
        finally:
            Path(self.path).unlink(missing_ok=True)
            os.rmdir(self._dir)


def _steady(env: dict[str, str]) -> dict[str, str]:
    """``env`` without what pytest changes test by test."""
    return {k: v for k, v in env.items() if k not in PER_TEST}


def _recv(conn: socket.socket, size: int, deadline: float) -> bytes:
    """``size`` bytes from ``conn`` before ``deadline`` (TimeoutError after it)."""
    data = b""
    while len(data) < size:
        conn.settimeout(max(0.0, deadline - time.monotonic()))
        try:
            chunk = conn.recv(size - len(data))
        except socket.timeout:
            raise TimeoutError from None
        if not chunk:
            raise RuntimeError("the zygote closed the connection")
        data += chunk
    return data


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2])
