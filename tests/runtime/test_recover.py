"""Recovery without a process restart: after a reset loses this process's primary context,
everything of that device raises the loss (never a raw OSError, never stale memory from
the cache) until ``runtime.recover(device)`` builds a fresh hold on it; handles from
before keep naming the loss; the other device never notices; nothing prints at exit."""

from __future__ import annotations

import pytest

from stress.harness import Bystander

IDLE = {"contexts": "0", "memory_used": "0", "queues": "0", "pinned_bytes": "0"}

RESET_THEN_RECOVER = """
import os, subprocess, sys
import numpy as np, runtime
from runtime.kernel_lib import SOURCE

lib = runtime.compile(SOURCE, 0)
x = runtime.to_device(np.arange(1 << 16, dtype=np.float32))
s = runtime.Stream(0)
cached = runtime.empty(1024, np.float32)
del cached                      # a block in the caching allocator: gone with the context
other = runtime.to_device(np.arange(4096, dtype=np.float32), device=1)
runtime.synchronize(0)
smi = subprocess.run([sys.executable, "-m", "tools.accel_smi", "--root",
                      os.environ["ACCEL_EMU_ROOT"], "-r", "-i", "0", "--force"],
                     capture_output=True, text=True)
print("reset", smi.returncode, smi.stdout.strip())

def attempt(what, fn):
    try:
        fn()
        print(what, "ran")
    except runtime.AccelError as exc:
        print(what, type(exc).__name__, "reset" in str(exc))
    except Exception as exc:  # a raw OSError or an AttributeError is the bug this catches
        print(what, "RAW", type(exc).__name__, exc)

attempt("copy", lambda: x.copy_to_host())
attempt("empty", lambda: runtime.empty(1024, np.float32))
attempt("stream", lambda: runtime.Stream(0))
attempt("to_device", lambda: runtime.to_device(np.ones(4)))
attempt("synchronize", lambda: runtime.synchronize(0))
print("other device", np.array_equal(other.copy_to_host(), np.arange(4096, dtype=np.float32)))
runtime.recover(0)
print("recovered")
y = runtime.to_device(np.zeros(256, np.float32))
runtime.compile(SOURCE, 0).fill[1, 256](y, np.float32(2))
print("works", float(y.copy_to_host().sum()))
attempt("old array", lambda: x.copy_to_host())
attempt("old stream", lambda: s.submit_nop())
attempt("old module", lambda: lib.fill[1, 256](y, np.float32(1)))
attempt("synchronize after", lambda: runtime.synchronize(0))
"""


@pytest.mark.timeout(120)
def test_a_reset_is_recovered_in_process_and_old_handles_name_it(make_daemon):
    d = make_daemon(devices=2)
    with Bystander(d, 1) as other_tenant:
        out = d.run_py(RESET_THEN_RECOVER, timeout=90)
        other_tenant.check()  # another process's data and work on the other device
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "reset 0 accel 0: reset complete, operational (reset_count 1)"
    assert lines[1:6] == ["copy DeviceLostError True", "empty DeviceLostError True",
                          "stream DeviceLostError True", "to_device DeviceLostError True",
                          "synchronize DeviceLostError True"]
    assert lines[6:9] == ["other device True", "recovered", "works 512.0"]
    assert lines[9:] == ["old array DeviceLostError True", "old stream DeviceLostError True",
                         "old module DeviceLostError True", "synchronize after ran"]
    assert out.stderr == ""  # nothing printed at interpreter exit, either
    # what the old and the new context held is back (the process has exited)
    d.wait_attrs(0, IDLE)
