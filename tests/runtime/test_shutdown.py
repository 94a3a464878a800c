"""Safe shutdown: a process that exits with work in flight leaves nothing behind.

Each case runs a program in a fresh interpreter against a daemon of this module's own,
next to a bystander tenant on device 0, and then checks what docs/driver.md ("Shutdown")
promises: the exit status is the one Python defines for how the program ended, nothing is
printed at exit (no "Exception ignored" from a finalizer), the driver's books, the
daemon's and the firmwares' descriptors and /dev/shm are back to what they were
(``assert_contained``), and the bystander's data and work are intact. The runtime registers
no ``atexit`` hook: closing the device node (the kernel does it at exit, however the
process ends) is what destroys a context, so a user's ``atexit`` handler may still use the
device, as under ``torch.cuda``.
"""

from __future__ import annotations

import signal
import time
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from firmware.image import IMAGE_DIR
from testkit.bystander import Bystander
from testkit.contained import assert_contained, snapshot
from testkit.daemon import Daemon

PRELUDE = """
import atexit, os, sys, threading, time, numpy as np, runtime
from runtime import kernel_lib
SPIN = kernel_lib.SOURCE  # its spin kernel runs for seconds with a large grid
x = np.arange(1 << 18, dtype=np.float32)
"""
#: work on every device, several streams each: copies, memsets, host reads into pinned
#: memory, graph replays, an IPC export, and a long kernel still running
IN_FLIGHT = """
keep = []
for dev in (0, 1):
    with runtime.device(dev):
        lib = runtime.compile(kernel_lib.SOURCE)
        for _ in range(3):
            s = runtime.Stream()
            a = runtime.to_device(x, stream=s)
            b = runtime.empty(x.shape, np.float32, stream=s)
            pin = runtime.pinned_empty(x.shape, np.float32)
            for _ in range(20):
                b.copy_(a, stream=s)
                b.memset(3, stream=s)
                a.copy_to_host(pin, stream=s)
            lib.saxpy[64, 256](np.float32(2), a, a, b, stream=s)
            keep += [s, a, b, pin]
        g, gs = runtime.Graph(), runtime.Stream()
        with runtime.graph(g, gs):
            t = runtime.empty(x.shape, np.float32)
            t.copy_(a, stream=gs)
        for _ in range(20):
            g.replay(gs)
        keep += [g, gs, a.ipc_handle(), runtime.managed_empty(4096, np.uint8)]
spin_out = runtime.empty(1 << 14, np.float32, device=1)
spin_stream = runtime.Stream(1)
runtime.compile(SPIN, device=1).spin[64, 256](spin_out, 100000, stream=spin_stream)
"""


@pytest.fixture(scope="module")
def tenant(tmp_path_factory: pytest.TempPathFactory,
           jit_cache_dir: Path) -> Iterator[tuple[Daemon, Bystander]]:
    """A 2-device daemon of this module's own with a bystander on device 0 (the shared
    daemon's tests expect idle devices, which a bystander's context is not)."""
    tmp = Path(tmp_path_factory.mktemp("shutdown"))
    d = Daemon(tmp / "root", tmp / "state", IMAGE_DIR, 2, jit_cache=jit_cache_dir)
    d.start()
    try:
        with Bystander(d, 0) as by:
            yield d, by
        for dev in range(d.devices):  # and once the bystander is gone, idle
            d.wait_attrs(dev, {"contexts": "0", "memory_used": "0", "queues": "0",
                               "pinned_bytes": "0", "open_files": "0"})
    finally:
        d.stop()


def exits_clean(tenant: tuple[Daemon, Bystander], code: str, rc: int = 0,
                out: str | None = None) -> None:
    """Run ``code`` after PRELUDE; it must exit with ``rc``, print nothing on stderr,
    print ``out`` (when given) and leave everything as it found it."""
    d, by = tenant
    before = snapshot(d)
    proc = d.run_py(PRELUDE + textwrap.dedent(code), timeout=120)
    assert (proc.returncode, proc.stderr) == (rc, ""), proc.stderr
    if out is not None:
        assert proc.stdout.strip() == out
    assert_contained(d, before)
    by.check()


def test_exit_with_work_in_flight_on_every_device(tenant):
    """Queued copies, memsets, kernels, graph replays, pinned and managed memory, an IPC
    export and a kernel that runs for seconds, on several streams of both devices: the
    program returns at once and the driver tears every context down."""
    exits_clean(tenant, IN_FLIGHT + "print('queued')", out="queued")


def test_exit_holding_an_import_of_a_live_export(tenant):
    """An IPC import whose exporter outlives the importer: the import goes with the
    importer's context, the export stays the exporter's (it reads its data back)."""
    d, _ = tenant
    exporter = d.popen_py(PRELUDE + """
import pickle
a = runtime.to_device(x, device=1)
print(pickle.dumps(a.ipc_handle()).hex(), flush=True)
sys.stdin.readline()
print("wrong", np.count_nonzero(a.copy_to_host() != x), flush=True)
""")
    try:
        handle = exporter.stdout.readline().strip()
        exits_clean(tenant, f"""
import pickle
b = runtime.open_ipc_handle(pickle.loads(bytes.fromhex({handle!r})))
c = runtime.empty(x.shape, np.float32, device=1)
s = runtime.Stream(1)
for _ in range(20):
    c.copy_(b, stream=s)
""")
        exporter.stdin.write("go\n")
        exporter.stdin.flush()
        assert exporter.stdout.readline().strip() == "wrong 0"
    finally:
        exporter.stdin.close()
        assert exporter.wait(timeout=60) == 0, exporter.stderr.read()


def test_atexit_handlers_use_the_device(tenant):
    """The runtime has no atexit hook to run before the user's: handlers registered before
    and after the first device use both compute correctly at exit, with work of the
    program's own still in flight."""
    exits_clean(tenant, """
def check(tag, dev):
    b = runtime.to_device(x, device=dev)
    c = runtime.empty(x.shape, np.float32, device=dev)
    runtime.compile(kernel_lib.SOURCE, device=dev).saxpy[1024, 256](np.float32(1), b, b, c)
    print(tag, "wrong", np.count_nonzero(c.copy_to_host() != 2 * x), flush=True)
atexit.register(check, "registered first", 0)
""" + IN_FLIGHT + """
atexit.register(check, "registered last", 1)
""", out="registered last wrong 0\nregistered first wrong 0")


@pytest.mark.parametrize("daemon_threads", [True, False], ids=["daemon", "non-daemon"])
def test_threads_still_submitting_when_main_returns(tenant, daemon_threads):
    """Threads that allocate, copy, launch and wait on shared and own streams while the
    main thread returns (a free recorded on a stream another thread waits on, too): daemon threads are frozen by the interpreter mid-call, non-daemon
    ones are joined first (they stop on an event the main thread sets on its way out)."""
    exits_clean(tenant, f"""
libs = [runtime.compile(kernel_lib.SOURCE, device=dev) for dev in (0, 1)]
shared = [runtime.Stream(dev) for dev in (0, 1)]
stop = threading.Event()
def work(dev):
    own = runtime.Stream(dev)
    with runtime.device(dev):
        mine = runtime.to_device(x, stream=own)
        while not stop.is_set():
            b = runtime.empty(x.shape, np.float32, stream=own)
            b.copy_(mine, stream=own)
            libs[dev].saxpy[64, 256](np.float32(1), mine, mine, b, stream=shared[dev])
            b.record_stream(shared[dev])
            runtime.pinned_empty(1024, np.uint8)
            shared[dev].synchronize()
            runtime.Event().record(own)
for i in range(4):
    threading.Thread(target=work, args=(i % 2,), daemon={daemon_threads}).start()
time.sleep(0.5)
if not {daemon_threads}:
    threading.Timer(0.3, stop.set).start()
""")


def test_sys_exit_in_a_thread_ends_only_the_thread(tenant):
    """``sys.exit`` in a thread raises SystemExit there, which ends that thread silently;
    the program carries on and exits 0."""
    exits_clean(tenant, IN_FLIGHT + """
def leave():
    runtime.pinned_empty(1 << 16, np.uint8, device=1)
    keep[1].copy_to_host()
    sys.exit(3)
t = threading.Thread(target=leave)
t.start(); t.join()
print("main goes on")
""", out="main goes on")


def test_os_exit_from_a_thread(tenant):
    """``os._exit`` runs no finalizer and no atexit handler: the kernel closes the device
    files and the driver tears the contexts down."""
    exits_clean(tenant, IN_FLIGHT + """
atexit.register(print, "atexit ran")
threading.Thread(target=os._exit, args=(5,)).start()
time.sleep(30)
""", rc=5, out="")


def test_keyboard_interrupt_during_synchronize(tenant):
    """SIGINT while ``runtime.synchronize`` waits for a long kernel: KeyboardInterrupt comes
    out of the wait at once. Caught, the runtime is intact (the next synchronize finishes
    the work and its results are right); uncaught, Python prints that traceback alone and
    ends by SIGINT."""
    d, by = tenant
    wait = """
SPIN_N = 3_000_000  # seconds of work: the vectorised spin counts 100,000 in ~0.1 s
s = runtime.Stream(1)
out = runtime.empty(1 << 14, np.float32, device=1)
runtime.compile(SPIN, device=1).spin[64, 256](out, SPIN_N, stream=s)
print("waiting", flush=True)
t0 = time.monotonic()
"""
    for caught, body in ((True, """
try:
    runtime.synchronize(1)
except KeyboardInterrupt:
    print("interrupted", time.monotonic() - t0, flush=True)
runtime.synchronize(1)
print(np.unique(out.copy_to_host()).tolist())
"""), (False, "runtime.synchronize(1)\n")):
        before = snapshot(d)
        proc = d.popen_py(PRELUDE + wait + body)
        assert proc.stdout.readline().strip() == "waiting"
        time.sleep(0.3)  # into the wait
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=120)
        if caught:
            said = stdout.split()
            assert (proc.returncode, stderr, len(said)) == (0, "", 3), (stdout, stderr)
            assert said[0] == "interrupted" and float(said[1]) < 5, stdout
            assert said[2] == "[3000000.0]", stdout  # every element counted to SPIN_N

        else:
            assert proc.returncode == -signal.SIGINT
            assert stderr.endswith("\nKeyboardInterrupt\n") and "Exception ignored" not in stderr
        assert_contained(d, before)
        by.check()
