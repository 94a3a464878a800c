"""What the fuzzers share: a client subprocess under a watchdog, and the containment check
of a round, collected into a :class:`~stress.report.Report` instead of raised.

A fuzzer's attacking client is a separate process (``python -m stress.<fuzzer> --client``)
that does one *round* (``ROUND`` transactions or so) and exits; the parent watches it.
The client steps a counter in a small shared file before every transaction and while it
waits (:class:`Progress`); a counter that stops moving for ``hang_s`` while the process
lives is a hang: the parent records what the client was doing (the step's description),
kills the client and goes on. Between rounds -- the attacker gone, its contexts torn down
-- the parent checks what every containment test checks (:mod:`testkit.contained`), with a
deadline on every read of the mount (a hung daemon must not hang the fuzzer too).
"""

from __future__ import annotations

import atexit
import json
import mmap
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from stress.report import Report
from testkit import REPO
from testkit.bystander import Bystander
from testkit.contained import Snapshot, assert_contained, snapshot
from testkit.procs import alive

#: The kernels the fuzzers load (their signatures are annotated: launches need no front end).
FUZZ_KERNELS = '''
def fill(out: "float32", v: "float32"):
    i = global_id(0)
    if i < out.size:
        out[i] = v

def inc(x: "int32", y: "int32"):
    i = global_id(0)
    if i < x.size:
        y[i] = x[i] + 1
'''


PROGRESS_SIZE = 4096
_DESC_OFF = 16
T = TypeVar("T")


# --- the client's side -----------------------------------------------------------------
class Progress:
    """The client's step counter and what it is doing, in a file the parent reads."""

    def __init__(self, path: str) -> None:
        fd = os.open(path, os.O_RDWR)
        try:
            self._mem = mmap.mmap(fd, PROGRESS_SIZE)
        finally:
            os.close(fd)
        self._words = memoryview(self._mem).cast("Q")
        self.n = 0

    def step(self, desc: str) -> None:
        """Say what comes next (before a transaction that might hang)."""
        raw = desc.encode(errors="replace")[: PROGRESS_SIZE - _DESC_OFF - 1]
        self._mem[_DESC_OFF : _DESC_OFF + len(raw) + 1] = raw + b"\0"
        self.beat()

    def beat(self) -> None:
        """Still alive (while polling a ring: the parent's watchdog is for blocked calls)."""
        self.n += 1
        self._words[0] = self.n


def write_result(path: str, result: dict[str, Any]) -> None:
    """Atomically (a killed client leaves its last complete result)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, path)


def client_args(argv: list[str]) -> tuple[str, str, dict[str, str]]:
    """``--client PROGRESS RESULT key=value...`` (from the parent) -> (progress, result,
    options); or ``--replay key=value...``: one round in the foreground against
    ``$ACCEL_EMU_ROOT``, its result printed at exit -- the reproduction of a round a
    Report note names (``python -m stress.ring_fuzz --replay seed=1 round=3 count=1000``)."""
    if argv[:1] == ["--replay"]:
        tmp = tempfile.mkdtemp(prefix="accel-fuzz-replay-")
        progress, result = os.path.join(tmp, "progress"), os.path.join(tmp, "result.json")
        with open(progress, "wb") as f:
            f.write(bytes(PROGRESS_SIZE))

        def report() -> None:
            try:
                with open(result) as f:
                    print(json.dumps(json.load(f), indent=1))
            except OSError:
                pass
            shutil.rmtree(tmp, ignore_errors=True)

        atexit.register(report)
        return progress, result, dict(a.split("=", 1) for a in argv[1:])
    assert argv[:1] == ["--client"], argv
    return argv[1], argv[2], dict(a.split("=", 1) for a in argv[3:])


# --- the parent's side -----------------------------------------------------------------
@dataclass
class ClientRun:
    rc: int | None
    seconds: float
    hung: bool = False
    hang_desc: str = ""
    result: dict[str, Any] = field(default_factory=dict)
    stderr: str = ""


def run_client(d, module: str, options: dict[str, Any], *, hang_s: float,
               start_s: float = 120.0, limit_s: float = 1800.0) -> ClientRun:
    """Run ``python -m module --client ...`` against daemon ``d`` under the watchdog."""
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="accel-fuzz-") as tmp:
        progress, result = Path(tmp) / "progress", Path(tmp) / "result.json"
        progress.write_bytes(bytes(PROGRESS_SIZE))
        with open(Path(tmp) / "stderr", "w+") as err:
            proc = subprocess.Popen(
                [sys.executable, "-m", module, "--client", str(progress), str(result),
                 *(f"{k}={v}" for k, v in options.items())],
                env=d.env(), cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=err, start_new_session=True)
            run = ClientRun(None, 0.0)
            try:
                with open(progress, "rb") as pf:
                    view = mmap.mmap(pf.fileno(), PROGRESS_SIZE, prot=mmap.PROT_READ)
                try:
                    last, last_change = 0, time.monotonic()
                    while proc.poll() is None:
                        time.sleep(0.05)
                        now = time.monotonic()
                        n = int.from_bytes(view[:8], "little")
                        if n != last:
                            last, last_change = n, now
                            continue
                        allowed = hang_s if n else start_s
                        if now - last_change > allowed or now - t0 > limit_s:
                            run.hung = True
                            run.hang_desc = (f"no progress for {now - last_change:.1f} s at "
                                             f"step {n}: "
                                             + view[_DESC_OFF:].split(b"\0", 1)[0].decode(
                                                 errors="replace"))
                            _kill(proc)
                            break
                finally:
                    view.close()
            finally:
                if proc.poll() is None:
                    _kill(proc)
                run.rc = proc.returncode
                err.seek(0)
                run.stderr = err.read()[-4000:]
            try:
                run.result = json.loads(result.read_text())
            except (OSError, ValueError):
                run.result = {}
    run.seconds = time.monotonic() - t0
    return run


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:  # blocked in an uninterruptible call of the mount
        pass


def merge(rep: Report, result: dict[str, Any], where: str = "") -> None:
    """Add a client's counts (done, errnos, escapes, unexpected, hangs, notes) to the
    report."""
    for k, v in result.get("done", {}).items():
        rep.done[k] = rep.done.get(k, 0) + v
    for k, v in result.get("errnos", {}).items():
        rep.errnos[k] = rep.errnos.get(k, 0) + v
    rep.escapes += result.get("escapes", 0)
    rep.unexpected += result.get("unexpected", 0)
    rep.hangs += result.get("hangs", 0)
    rep.notes += [f"{where}: {n}" if where else n for n in result.get("notes", [])[:20]]


class Deadline(Exception):
    pass


def timed(fn: Callable[[], T], seconds: float) -> T:
    """``fn()`` on a helper thread; Deadline if it has not returned in ``seconds`` (a read
    of a hung mount blocks in the kernel; the thread ends when the mount goes)."""
    box: list[Any] = []

    def call() -> None:
        try:
            box.append((True, fn()))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            box.append((False, exc))

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(seconds)
    if not box:
        raise Deadline(f"no answer from the mount in {seconds:.0f} s")
    ok, value = box[0]
    if not ok:
        raise value
    return value


@contextmanager
def bystanders_for(d, spec: Any, rep: Report, t0: float) -> Iterator[list[Bystander]]:
    """The bystanders of a run, yielded: ``spec`` True (one per device, started here and
    closed at the end), False/None (none), or a list of running bystanders (the
    caller's). At the end, ``rep.seconds`` is the time since ``t0``."""
    mine: list[Bystander] = []
    try:
        if spec is True:
            for dev in range(d.devices):
                mine.append(Bystander(d, dev))
        yield mine if spec is True else list(spec or [])
    finally:
        for b in mine:
            b.close()
        rep.seconds = time.monotonic() - t0


def check_round(d, before: Snapshot, rep: Report, bystanders: list[Bystander],
                where: str, timeout: float = 30.0) -> Snapshot | None:
    """The containment checks after a round, counted into ``rep``. Returns the baseline for
    the next round (a new one after a leak, so that one leak counts once), or None when
    the run cannot go on (the daemon or a firmware is gone, or the mount hangs)."""
    try:
        timed(lambda: assert_contained(d, before, timeout=timeout), timeout + 30)
    except Deadline as exc:
        rep.hangs += 1
        rep.notes.append(f"{where}: the mount stopped answering: {exc}")
        return None
    except (AssertionError, ValueError) as exc:  # ValueError: a device without firmware
        return _classify(d, before, rep, where, str(exc) or repr(exc))
    except OSError as exc:  # the mount is gone
        if not alive(before.daemon_pid):
            rep.daemon_crashes += 1
        rep.notes.append(f"{where}: the mount failed: {exc!r}")
        return None
    for b in list(bystanders):
        try:
            timed(b.check, 90)
        except (AssertionError, Deadline, OSError, ValueError) as exc:
            rep.escapes += 1
            rep.notes.append(f"{where}: a bystander: {exc}")
            bystanders.remove(b)  # counted once; the others are still checked
    return before


def _classify(d, before: Snapshot, rep: Report, where: str, problem: str) -> Snapshot | None:
    if not alive(before.daemon_pid):
        rep.daemon_crashes += 1
        rep.notes.append(f"{where}: the daemon died: {problem}")
        return None
    try:
        states = timed(lambda: [d.attr(i, "state") for i in range(d.devices)], 30)
        if states != ["operational"] * d.devices:
            rep.firmware_crashes += 1
            rep.notes.append(f"{where}: devices {states}: {problem}")
            return None
        now = timed(lambda: snapshot(d), 30)
    except ValueError as exc:  # fw_pid empty: no firmware runs
        rep.firmware_crashes += 1
        rep.notes.append(f"{where}: a firmware is gone ({exc}): {problem}")
        return None
    except (Deadline, OSError) as exc:
        rep.hangs += 1
        rep.notes.append(f"{where}: the mount stopped answering: {exc}")
        return None
    if now.daemon_pid != before.daemon_pid:
        rep.daemon_crashes += 1
        rep.notes.append(f"{where}: {problem}")
        return None
    if (now.fw_pids != before.fw_pids or not all(alive(p) for p in now.fw_pids)
            or states != ["operational"] * d.devices):
        rep.firmware_crashes += 1
        rep.notes.append(f"{where}: {problem}")
        return None
    rep.leaks += 1
    rep.notes.append(f"{where}: {problem}")
    return now


def fuzz_rounds(d, rep: Report, *, module: str, count: int, seed: int, round_size: int,
                unit: str, bystanders: Any, hang_s: float, options: dict[str, Any],
                check_every: int = 1) -> Report:
    """The parent's loop shared by the fuzzers: rounds of ``round_size`` units by fresh
    client processes (round ``r`` seeded from ``seed`` and ``r``), the containment check
    after every ``check_every`` rounds and after the last."""
    with bystanders_for(d, bystanders, rep, time.monotonic()) as everyone:
        before: Snapshot | None = timed(lambda: snapshot(d), 60)
        done, rnd = 0, 0
        while done < count and before is not None:
            n = min(round_size, count - done)
            run = run_client(d, module, dict(options, seed=seed, round=rnd, count=n),
                             hang_s=hang_s)
            where = f"seed {seed} round {rnd}"
            merge(rep, run.result, where)
            if run.hung:
                rep.hangs += 1
                rep.notes.append(f"{where}: client hung: {run.hang_desc}")
            elif run.rc != 0:
                rep.notes.append(f"{where}: client exited {run.rc}: {run.stderr[-1500:]}")
            if run.result.get("stop"):
                rep.notes.append(f"{where}: client stopped: {run.result['stop']}")
            done += n
            rnd += 1
            last = done >= count
            if run.hung or run.rc != 0 or run.result.get("stop") or last or rnd % check_every == 0:
                before = check_round(d, before, rep, everyone, where)
    return rep


__all__ = ["ClientRun", "Deadline", "Progress", "bystanders_for", "check_round", "client_args",
           "fuzz_rounds", "merge", "run_client", "timed", "write_result"]
