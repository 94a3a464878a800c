"""What docs/partitions.md says one partition's tenants cannot do to another's: an IPC
handle exported on one partition is refused in a process that sees only the other
(``InvalidValueError``) while it imports where the exporter's partition is seen, and the
exporter goes on working; an exclusive context holds one partition, not the package:
another process computes on the sibling, while a second process opening the held
partition is refused with EBUSY (``DeviceBusyError``)."""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from scenario import IDLE

from testkit.daemon import Daemon

#: Exports an array of its one visible device, prints the handle, then on a line of stdin
#: checks the array and runs a kernel on that device.
EXPORTER = """
import pickle, sys, numpy as np, runtime
from runtime.kernel_lib import SOURCE
x = np.arange(1 << 16, dtype=np.int32)
a = runtime.to_device(x)
runtime.synchronize()
print(pickle.dumps(a.ipc_handle()).hex(), flush=True)
sys.stdin.readline()
lib = runtime.compile(SOURCE, 0)
f = runtime.to_device(np.arange(4096, dtype=np.float32))
out = runtime.to_device(np.zeros(4096, np.float32))
lib.saxpy[4096 // 64, 64](np.float32(2.0), f, f, out)
print("wrong", np.count_nonzero(a.copy_to_host() != x), float(out.copy_to_host().sum()), flush=True)
"""

IMPORTER = """
import os, pickle, numpy as np, runtime
h = pickle.loads(bytes.fromhex(os.environ["HANDLE"]))
try:
    b = runtime.open_ipc_handle(h)
    print("imported wrong", np.count_nonzero(b.copy_to_host() != np.arange(1 << 16, dtype=np.int32)))
except runtime.AccelError as exc:
    print(f"{type(exc).__name__}: {exc}")
"""

#: Holds its one visible device exclusively until told to go on, then computes there.
EXCLUSIVE = """
import numpy as np, runtime
with runtime.new_context(0, exclusive=True):
    x = runtime.to_device(np.arange(4096, dtype=np.float32))
    runtime.synchronize()
    print("held", flush=True)
    input()
    print("still", float(x.copy_to_host().sum()), flush=True)
"""

#: Uses its one visible device: what happened.
USE = """
import errno, numpy as np, runtime
try:
    x = runtime.to_device(np.arange(4096, dtype=np.float32))
    print("ran", float(x.copy_to_host().sum()))
except runtime.AccelError as exc:
    print(type(exc).__name__, errno.errorcode.get(exc.errno, exc.errno))
"""


@contextmanager
def started(d: Daemon, code: str, dev: int) -> Iterator[subprocess.Popen[str]]:
    """``code`` in a process that sees only partition ``dev``; killed at the end if it
    is still there."""
    proc = d.popen_py(code, ACCEL_VISIBLE_DEVICES=str(dev))
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def split(make_daemon) -> Daemon:
    d = make_daemon(devices=1)
    (d.root / "sys/class/accel/accel0/partition_mode").write_text("2")
    return d


def visible_only(d: Daemon, code: str, dev: int, **env: str) -> str:
    """What ``code`` prints in a process that sees only partition ``dev``."""
    out = d.run_py(code, ACCEL_VISIBLE_DEVICES=str(dev), **env)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.timeout(120)
def test_an_ipc_handle_stays_on_its_partition(make_daemon):
    d = split(make_daemon)
    with started(d, EXPORTER, 1) as exporter:
        handle = exporter.stdout.readline().strip()
        assert handle, exporter.stderr.read()
        refused = visible_only(d, IMPORTER, 2, HANDLE=handle)
        assert refused.startswith("InvalidValueError: ") and "not visible here" in refused, refused
        assert visible_only(d, IMPORTER, 1, HANDLE=handle) == "imported wrong 0"
        out, err = exporter.communicate("\n", timeout=60)
        assert exporter.returncode == 0, err
        assert out.strip() == "wrong 0 25159680.0"
    for dev in (1, 2):
        d.wait_attrs(dev, IDLE)


@pytest.mark.timeout(120)
def test_an_exclusive_context_holds_one_partition(make_daemon):
    d = split(make_daemon)
    with started(d, EXCLUSIVE, 1) as owner:
        assert owner.stdout.readline() == "held\n", owner.stderr.read()
        assert d.attr(1, "exclusive_owner") == str(owner.pid)
        assert d.attr(2, "exclusive_owner") == ""
        assert visible_only(d, USE, 2) == "ran 8386560.0"  # the sibling is free
        assert visible_only(d, USE, 1) == "DeviceBusyError EBUSY"

        with pytest.raises(OSError) as exc:  # the driver's answer under the runtime's
            os.open(d.node(1), os.O_RDWR)
        assert exc.value.errno == errno.EBUSY
        out, err = owner.communicate("\n", timeout=60)
        assert owner.returncode == 0, err
        assert out.strip() == "still 8386560.0"
    for dev in (1, 2):
        d.wait_attrs(dev, IDLE)
    assert visible_only(d, USE, 1) == "ran 8386560.0"  # released with its context
