"""IPC of device memory between processes: an import outlives its exporter, and a wrong
token, a foreign export or another context's handle is refused."""

from __future__ import annotations

import signal

import pytest

from scenario import IDLE
from scenario import MEMORY_PRELUDE as PRELUDE
from scenario import run_scenario


def run(d, body: str, **env) -> list[str]:
    return run_scenario(d, PRELUDE, body, **env)


IPC_EXPORTER = """
import pickle, sys, numpy as np, runtime
x = np.arange(1 << 16, dtype=np.int32)
a = runtime.to_device(x)
runtime.synchronize()
sys.stdout.buffer.write(pickle.dumps(a.ipc_handle()).hex().encode() + b"\\n")
sys.stdout.flush()
cmd = sys.stdin.readline().strip()
if cmd == "free":
    del a
    runtime.empty_cache()
    print("freed", flush=True)
    sys.stdin.readline()
"""


IPC_IMPORTER = """
import pickle, sys, numpy as np, runtime
h = pickle.loads(bytes.fromhex(sys.argv[1]))
b = runtime.open_ipc_handle(h)
print("wrong", np.count_nonzero(b.copy_to_host() != np.arange(1 << 16, dtype=np.int32)), flush=True)
sys.stdin.readline()
print("wrong", np.count_nonzero(b.copy_to_host() != np.arange(1 << 16, dtype=np.int32)), flush=True)
"""


@pytest.mark.parametrize("exporter_fate", ["frees", "dies"])
def test_ipc_lifetime_outlives_the_exporter(daemon, exporter_fate):
    daemon.wait_attrs(0, IDLE)
    exp = daemon.popen_py(IPC_EXPORTER)
    imp = None
    try:
        handle = exp.stdout.readline().strip()
        imp = daemon.popen_py(IPC_IMPORTER, handle)
        assert imp.stdout.readline().strip() == "wrong 0"
        if exporter_fate == "frees":
            exp.stdin.write("free\n")
            exp.stdin.flush()
            assert exp.stdout.readline().strip() == "freed"
        else:
            exp.send_signal(signal.SIGKILL)
            exp.wait()
        imp.stdin.write("\n")
        imp.stdin.flush()
        assert imp.stdout.readline().strip() == "wrong 0"  # still readable after the exporter
        imp.stdin.close()
        assert imp.wait(timeout=30) == 0
    finally:
        for p in (exp, imp):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    daemon.wait_attrs(0, IDLE)  # the last holder gone: bytes released


def test_foreign_handles_and_tokens_are_refused(daemon):
    lines = run(daemon, """
        import dataclasses
        a = runtime.to_device(np.zeros(16, np.uint8))
        h = a.ipc_handle()
        for bad in (dataclasses.replace(h, token=h.token ^ 1), dataclasses.replace(h, export_handle=1)):
            try:
                runtime.open_ipc_handle(bad)
            except runtime.InvalidValueError as e:
                print(e.errno)
        other = runtime.new_context(0)
        try:
            other.channel.call(uapi.ACCEL_CMD_MEM_FREE, uapi.accel_mem_free(ctx_id=other.id, handle=1))
        except runtime.InvalidValueError as e:
            print(e.errno)
        print("nonzero", np.count_nonzero(a.copy_to_host()))
    """)
    assert lines == ["13", "2", "2", "nonzero 0"]  # EACCES: a wrong token; ENOENT: no such export


def test_what_is_not_a_handle_is_refused_naming_what_a_handle_is(daemon):
    """Bytes (a pickle not loaded, or cut short), None, a number or a handle with a field
    of the wrong type is InvalidValueError that says a handle is ``ipc_handle()``'s
    result, not an AttributeError from deep inside the import; nothing reaches the
    driver."""
    lines = run(daemon, """
        import dataclasses, pickle
        h = runtime.to_device(np.zeros(16, np.uint8)).ipc_handle()
        raw = pickle.dumps(h)
        for bad in (raw, raw[: len(raw) // 2], b"garbage", "str", None, 5,
                    dataclasses.replace(h, shape=None), dataclasses.replace(h, dtype="nope"),
                    dataclasses.replace(h, token="1"), dataclasses.replace(h, offset=-1)):
            try:
                runtime.open_ipc_handle(bad)
                print("opened")
            except runtime.InvalidValueError as e:
                print("refused:", e)
    """)
    assert len(lines) == 10, lines
    assert all(l.startswith("refused:") and "ipc_handle()" in l and "IpcHandle" in l
               for l in lines), lines

