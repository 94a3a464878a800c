"""A SIGKILL storm: clients doing real work on both devices, killed at random points.

Every victim is a fresh interpreter (as root, and as uid 65534 when the daemon's root is
world-reachable) that opens both devices and, in an order its seed picks, does what a
training job does: device, pinned and managed allocations; copies queued and left in
flight; peer access enabled both ways with peer copies queued; memory freed (and the cache
emptied) with work still queued on it here and on the peer; a high-priority stream given
back with work queued; a kernel in flight on each (on device 0 now and then a grid of
2**21 blocks, minutes of work, that only the kill may end)
device (one small kernel, compiled once: the firmware caches it); device-side waits of one
device's stream on the other's event; imports of the IPC exports a long-lived exporter
holds open, and of the exports earlier victims made (those may be gone: ENOENT is an
answer, not a failure); exports of its own, which later victims import. Then it loops,
keeping work in flight. The storm SIGKILLs it either at a random time after its start
(mid-open, mid-command, mid-module-load) or a random moment after one of its markers (mid
copy, mid kernel, holding queues, imports and exports), ``concurrency`` victims at a time.

Bystanders (two on device 0, one on device 1) and the exporter live through the storm
(but once: half-way, the exporter is SIGKILLed too while victims hold its memory, and a
new one takes its place); every
``check_every`` kills the storm lets the victims in flight die, checks the bystanders and
the exporter's read-only buffers, and checks containment against the snapshot taken once
they were up (``snapshot``/``assert_contained``: same daemon and firmware processes,
devices operational, sysfs books, descriptors and /dev/shm back). At the end, with the
bystanders and the exporter gone too, everything must be back to the daemon's state
before the storm: memory_used and pinned_bytes as they were (0 on an idle daemon) on both
devices -- peer memory included: an earlier bug leaked 2 MiB of the peer device per process
killed with peer work queued.

Failures are collected into the Report (kills done, leaks, crashes, hangs, escapes),
never raised.
"""

from __future__ import annotations

import json
import os
import random
import selectors
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, field

from stress.report import Report
from testkit import REPO
from testkit.bystander import Bystander
from testkit.contained import Snapshot, assert_contained, snapshot
from testkit.daemon import Daemon
from testkit.tenants import as_user, world_reachable

#: kills in a full stress run (``python -m stress``)
STRESS_COUNT = 1000

#: the kernels victims launch: a bounded loop per thread (a few tens of ms), and the same
#: writing one element (for grids far larger than any buffer)
KERNEL_SOURCE = """
def spin(x, n):
    i = global_id(0)
    acc = 0.0
    for j in range(n):
        acc = acc + 1.0
    x[i] = acc

def hold(x, n):
    acc = 0.0
    for j in range(n):
        acc = acc + 1.0
    x[0] = acc
"""

#: bytes of each victim buffer, and of the exporter's
NBYTES = 4 << 20
#: a victim that is not killed gives up on its own after this long (never an orphan)
VICTIM_TTL_S = 120
#: a victim that prints nothing for this long is hung
HANG_S = 45.0
#: ... unless it launched a giant grid: then its host waits are behind it, and it is
#: killed once it has been waiting this long
BLOCKED_S = 2.0

_STEPS = ("copy", "peer", "kernel", "xwait", "import", "vimport", "export", "free", "close")

_EXPORTER = r"""
import sys, json, dataclasses, numpy as np, runtime
N, SRC = int(sys.argv[1]), sys.argv[2]
out = []
keep = []
for dev in (0, 1):
    s = runtime.Stream(dev)
    pattern = (np.arange(N, dtype=np.uint32) * (2654435761 + dev)).astype(np.uint8)
    ro = runtime.to_device(pattern, device=dev, stream=s)
    rw = runtime.empty(N, np.uint8, device=dev, stream=s)
    rw.memset(0, stream=s)
    # warm the JIT: the firmware compiles the kernel once and caches it
    mod = runtime.compile(SRC, device=dev)
    x = runtime.empty(512, np.float32, device=dev, stream=s)
    mod.spin[2, 256](x, np.int64(10), stream=s)
    mod.hold[2, 32](x, np.int64(10), stream=s)
    s.synchronize(timeout=120)
    keep.append((s, pattern, ro, rw, mod, x))
    for name, arr in (("ro", ro), ("rw", rw)):
        h = dataclasses.asdict(arr.ipc_handle())
        out.append({"dev": dev, "name": name, "h": h})
print(json.dumps(out), flush=True)
for line in sys.stdin:
    bad = []
    for s, pattern, ro, rw, mod, x in keep:
        back = ro.copy_to_host(stream=s)
        s.synchronize(timeout=30)
        if not np.array_equal(back, pattern):
            bad.append(s.device)
    print("ok" if not bad else f"corrupt {bad}", flush=True)
"""

_VICTIM = r"""
import sys, json, time, errno as _E, numpy as np, runtime
P = json.loads(sys.argv[1])
N = P["nbytes"]
T0 = time.monotonic()
def out(*a):
    print(*a, flush=True)
def err(where, exc):
    code = getattr(exc, "errno", None)
    out("E", _E.errorcode.get(code, "none") if code else "none", where, type(exc).__name__,
        str(exc)[:200].replace("\n", " "))
def handle(h):
    h = dict(h)
    h["shape"] = tuple(h["shape"])
    return runtime.IpcHandle(**h)
keep = []
s = [runtime.Stream(0), runtime.Stream(1)]
out("M up")
host = np.full(N, P["seed"] & 0xFF, np.uint8)
a0 = runtime.to_device(host, device=0, stream=s[0])
c0 = runtime.empty(N, np.uint8, device=0, stream=s[0])
b1 = runtime.empty(N, np.uint8, device=1, stream=s[1])
pin0 = runtime.pinned_empty(N, np.uint8, device=0)
man1 = runtime.managed_empty(N, np.uint8, device=1)
out("M alloc")
mods = {}
xs = {dev: runtime.empty(512, np.float32, device=dev, stream=s[dev]) for dev in (0, 1)}
peer = False

def copies():
    for _ in range(P["copies"]):
        a0.copy_to_host(pin0, stream=s[0])
        c0.copy_(a0, stream=s[0])
        b1.copy_from_host(man1, stream=s[1])
        man1.prefetch(True, stream=s[1])

def peers():
    global peer
    if not peer:
        runtime.enable_peer_access(1, device=0)
        runtime.enable_peer_access(0, device=1)
        peer = True
    for _ in range(P["copies"]):
        b1.copy_(a0, stream=s[1])
        c0.copy_(b1, stream=s[0])

def kernels():
    for dev in (0, 1):
        if dev not in mods:
            mods[dev] = runtime.compile(P["src"], device=dev)
        if P["giant"] and dev == 0:  # minutes of blocks: only the kill ends it
            mods[dev].hold[(1 << 21) - 1, 32](xs[dev], np.int64(1000), stream=s[dev])
        else:
            mods[dev].spin[2, 256](xs[dev], np.int64(P["spin"]), stream=s[dev])

def xwait():
    ev = s[0].record_event()
    s[1].wait_event(ev)
    if peer:
        b1.copy_(a0, stream=s[1])
    ev1 = s[1].record_event()
    s[0].wait_event(ev1)
    c0.copy_(a0, stream=s[0])

def imports(which):
    for item in P[which]:
        try:
            arr = runtime.open_ipc_handle(handle(item["h"]))
        except runtime.AccelError as exc:
            err(which, exc)
            continue
        keep.append(arr)
        dev = arr.device
        mine = a0 if dev == 0 else b1
        if item.get("name") == "ro" or which == "vimport":
            mine.copy_(arr, stream=s[dev])   # read it, never write it
        else:
            arr.copy_(mine, stream=s[dev])   # the exporter's scratch buffer

def export():
    for arr in (a0, b1):
        h = arr.ipc_handle()
        d = {k: getattr(h, k) for k in ("device_uuid", "export_handle", "token", "offset",
                                        "shape", "dtype")}
        d["shape"] = list(d["shape"])
        out("X", json.dumps({"h": d}))

def free():
    # memory freed with work still queued on it (here and, through peer access, on the
    # other device): the driver defers the unmaps until that work is done
    tmp = runtime.empty(N, np.uint8, device=0, stream=s[0])
    tmp.copy_(a0, stream=s[0])
    if peer:
        b1.copy_(tmp, stream=s[1])
        tmp.record_stream(s[1])
    del tmp
    runtime.empty_cache(0)

def close():
    # a stream of high priority given back with work still queued on it
    extra = runtime.Stream(P["seed"] % 2, priority=-1)
    for _ in range(P["copies"]):
        (c0 if extra.device == 0 else b1).copy_(a0 if extra.device == 0 else b1, stream=extra)
    extra.close()

STEPS = {"copy": copies, "peer": peers, "kernel": kernels, "xwait": xwait,
         "import": lambda: imports("exports"), "vimport": lambda: imports("vexports"),
         "export": export, "free": free, "close": close}
for step in P["steps"]:
    try:
        STEPS[step]()
    except runtime.AccelError as exc:
        err(step, exc)
    out("M", step)
it = 0
prev = None
while time.monotonic() - T0 < P["ttl"]:
    try:
        copies()
        if peer:
            peers()
        if "kernel" in P["steps"]:
            kernels()
        ev = s[0].record_event(), s[1].record_event()
        if prev is not None:
            for e in prev:
                e.synchronize(timeout=60)
        prev = ev
    except runtime.AccelError as exc:
        err("loop", exc)
        time.sleep(0.05)
    if it == 0:
        out("M loop")
    it += 1
out("TTL")
"""


@dataclass(eq=False)
class Victim:
    proc: subprocess.Popen[bytes]
    uid: int
    params: dict
    #: kill when this marker is seen (plus ``delay``), or at ``kill_at`` (monotonic)
    marker: str | None
    delay: float
    started: float
    kill_at: float | None = None
    killed: bool = False
    last_output: float = 0.0
    buf: bytes = b""
    lines: list[str] = field(default_factory=list)
    markers: list[str] = field(default_factory=list)


class Storm:
    def __init__(self, d: Daemon, count: int, seed: int, concurrency: int,
                 check_every: int, report: Report) -> None:
        self.d, self.count, self.rng, self.report = d, count, random.Random(seed), report
        self.seed = seed
        self.concurrency, self.check_every = concurrency, check_every
        self.tenants = os.geteuid() == 0 and world_reachable(d.root)
        self.sel = selectors.DefaultSelector()
        self.live: list[Victim] = []
        self.exports: list[dict] = []  # the exporter's
        self.vexports: list[dict] = []  # recent victims'
        self.kills = 0
        self.spawned = 0
        self.gen = 0  # which exporter's handles victims get
        self.broken = False  # the daemon or a firmware died: stop

    # --- bookkeeping ----------------------------------------------------------------------
    def bump(self, key: str, n: int = 1) -> None:
        self.report.done[key] = self.report.done.get(key, 0) + n

    def errno_seen(self, name: str) -> None:
        self.report.errnos[name] = self.report.errnos.get(name, 0) + 1

    def note(self, text: str) -> None:
        if len(self.report.notes) < 200:
            self.report.notes.append(text)

    # --- victims ----------------------------------------------------------------------------
    def spawn(self) -> None:
        rng = self.rng
        steps = [s for s in _STEPS if rng.random() < 0.75]
        rng.shuffle(steps)
        exports = rng.sample(self.exports, k=min(len(self.exports), rng.randint(1, 4)))
        vexports = rng.sample(self.vexports, k=min(len(self.vexports), rng.randint(0, 2)))
        params = {"seed": rng.getrandbits(32), "nbytes": NBYTES, "steps": steps,
                  "copies": rng.randint(1, 4), "spin": rng.choice([20_000, 100_000, 300_000]),
                  "src": KERNEL_SOURCE, "exports": exports, "vexports": vexports,
                  "ttl": VICTIM_TTL_S, "gen": self.gen, "giant": rng.random() < 0.1}
        uid = 65534 if self.tenants and rng.random() < 0.4 else 0
        code = textwrap.dedent(_VICTIM)
        if uid:
            code = as_user(code, uid)
        now = time.monotonic()
        markers = ["up", "alloc", *steps, "loop"]
        if rng.random() < 0.2:
            marker, delay, kill_at = None, 0.0, now + rng.uniform(0.0, 1.0)
        else:
            marker = rng.choice(markers)
            delay = rng.uniform(0.0, 0.25 if marker == "loop" else 0.04)
            kill_at = None
        proc = subprocess.Popen([sys.executable, "-c", code, json.dumps(params)],
                                env=self.d.env(), cwd=REPO, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        v = Victim(proc, uid, params, marker, delay, now, kill_at, last_output=now)
        os.set_blocking(proc.stdout.fileno(), False)
        self.sel.register(proc.stdout, selectors.EVENT_READ, v)
        self.live.append(v)
        self.spawned += 1
        self.bump("victims")
        if uid:
            self.bump("victims_uid65534")
        if params["giant"]:
            self.bump("victims_giant")

    def on_line(self, v: Victim, line: str) -> None:
        v.lines.append(line)
        kind, _, rest = line.partition(" ")
        if kind == "M":
            v.markers.append(rest)
            if rest == v.marker and v.kill_at is None:
                v.kill_at = time.monotonic() + v.delay
        elif kind == "E":
            name, _, where = rest.partition(" ")
            where = where.split(" ", 1)[0]
            self.errno_seen(name)
            # ENOENT is the answer for an export whose every holder is gone: another
            # victim's, or the first exporter's once it was killed
            if name != "ENOENT" or not (where == "vexports" or (
                    where == "exports" and v.params["gen"] != self.gen)):
                self.bump("victim_errors")
                self.note(f"victim {v.proc.pid} (uid {v.uid}): {line[:300]}")
        elif kind == "X":
            try:
                self.vexports.append(json.loads(rest))
            except ValueError:
                self.note(f"victim {v.proc.pid}: bad export line {line[:200]!r}")
            del self.vexports[:-6]

    def read(self, timeout: float) -> None:
        for key, _ in self.sel.select(timeout):
            v: Victim = key.data
            try:
                data = os.read(key.fileobj.fileno(), 65536)
            except BlockingIOError:
                continue
            if not data:
                self.sel.unregister(key.fileobj)
                continue
            v.last_output = time.monotonic()
            v.buf += data
            *lines, v.buf = v.buf.split(b"\n")
            for raw in lines:
                self.on_line(v, raw.decode(errors="replace"))

    def kill(self, v: Victim) -> None:
        if not v.killed and v.proc.poll() is None:
            v.proc.send_signal(signal.SIGKILL)
        v.killed = True

    def reap(self) -> None:
        """Kill the victims whose moment came; reap the dead ones."""
        now = time.monotonic()
        for v in list(self.live):
            if v.kill_at is not None and now >= v.kill_at and not v.killed:
                self.kill(v)
            elif not v.killed and v.params["giant"] and now - v.last_output > BLOCKED_S:
                # its host waits (a synchronize, a prefetch, emptying the cache) are behind
                # its own minutes-long launch: that is no hang; kill it where it waits
                self.bump("kills_while_blocked")
                self.kill(v)
            elif not v.killed and now - v.last_output > HANG_S:
                self.report.hangs += 1
                self.note(f"victim {v.proc.pid} (uid {v.uid}) silent {HANG_S:.0f} s after "
                          f"{v.markers[-1:]} (steps {v.params['steps']}): hung")
                self.kill(v)
            rc = v.proc.poll()
            if rc is None:
                continue
            self.finish(v, rc)

    def finish(self, v: Victim, rc: int) -> None:
        try:
            self.sel.unregister(v.proc.stdout)
        except (KeyError, ValueError):
            pass
        try:
            rest = v.proc.stdout.read() or b""
        except (OSError, ValueError):
            rest = b""
        *lines, _partial = (v.buf + rest).split(b"\n")  # a line cut by the kill is dropped
        for raw in lines:
            self.on_line(v, raw.decode(errors="replace"))
        v.buf = b""
        v.proc.stdout.close()
        self.live.remove(v)
        if rc == -signal.SIGKILL and v.killed:
            self.kills += 1
            self.bump("kills")
            where = v.markers[-1] if v.markers else "start"
            self.bump(f"kills_after_{where}")
        else:
            self.bump("victim_exits")
            tail = " | ".join(v.lines[-6:])[-600:]
            self.note(f"victim {v.proc.pid} (uid {v.uid}) exited {rc} before its kill "
                      f"(steps {v.params['steps']}): {tail}")

    def drain(self, timeout: float = 60.0) -> None:
        """Let every live victim reach its kill (or kill it), and reap them all."""
        deadline = time.monotonic() + timeout
        while self.live:
            if time.monotonic() > deadline:
                for v in self.live:
                    if not v.killed:
                        self.report.hangs += 1
                        self.note(f"victim {v.proc.pid} never reached {v.marker!r}: "
                                  f"{v.markers}")
                    self.kill(v)
            self.read(0.01)
            self.reap()

    def abort(self) -> None:
        for v in list(self.live):
            self.kill(v)
        for v in list(self.live):
            try:
                v.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
            self.finish(v, v.proc.returncode if v.proc.returncode is not None else 0)

    # --- checks -------------------------------------------------------------------------------
    def contained(self, before: Snapshot, what: str, timeout: float = 30.0) -> bool:
        """``assert_contained``, its failure sorted into the report; False if it failed."""
        try:
            assert_contained(self.d, before, timeout=timeout)
            return True
        except AssertionError as exc:
            msg = str(exc)
        except (OSError, ValueError) as exc:  # the mount itself is gone
            msg = f"not contained: processes: daemon unreachable ({exc!r})"
        self.note(f"{what}: {msg[:1500]}")
        try:
            now = snapshot(self.d)
        except (OSError, ValueError, AssertionError):
            now = None
        if "processes" in msg or "died" in msg or now is None:
            if now is None or now.daemon_pid != before.daemon_pid:
                self.report.daemon_crashes += 1
            else:
                self.report.firmware_crashes += 1
            self.broken = True
        elif "states" in msg:
            self.report.firmware_crashes += 1
            self.broken = True
        else:
            self.report.leaks += 1
        return False

    def check_bystanders(self, bystanders: list[Bystander], exporter: subprocess.Popen[str]
                         ) -> None:
        for b in bystanders:
            try:
                b.check()
            except AssertionError as exc:
                text = str(exc)
                if "corrupt" in text or "died" in text:
                    self.report.escapes += 1
                else:
                    self.report.hangs += 1
                self.note(f"bystander: {text}")
        try:
            exporter.stdin.write("check\n")
            exporter.stdin.flush()
            answer = exporter.stdout.readline().strip()
        except OSError as exc:
            answer = f"unreachable {exc!r}"
        if answer != "ok":
            self.report.escapes += 1
            self.note(f"exporter: {answer!r}")


def _start_exporter(d: Daemon) -> tuple[subprocess.Popen[str], list[dict]]:
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(_EXPORTER), str(NBYTES),
                             KERNEL_SOURCE], env=d.env(), cwd=REPO, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    try:
        return proc, json.loads(line)
    except ValueError:
        _stop(proc)
        raise RuntimeError(f"exporter did not start: {line!r} {proc.stderr.read()[-2000:]}"
                           ) from None


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        try:
            proc.stdin.close()
            proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()


def run(d: Daemon, *, count: int, seed: int, concurrency: int = 3,
        check_every: int = 25) -> Report:
    """``count`` SIGKILLs of victims working on both devices of ``d`` (a 2-device daemon);
    containment checked every ``check_every`` kills and at the end."""
    report = Report("kill_storm")
    t0 = time.monotonic()
    if d.devices < 2:
        report.notes.append("needs a daemon with 2 devices")
        report.hangs += 1  # not ok: nothing was tested
        return report
    base = snapshot(d)
    storm = Storm(d, count, seed, concurrency, check_every, report)
    if not storm.tenants:
        report.notes.append("root not world-reachable (or not run as root): no uid 65534 "
                            "victims")
    bystanders: list[Bystander] = []
    exporter: subprocess.Popen[str] | None = None
    try:
        bystanders = [Bystander(d, 0), Bystander(d, 1), Bystander(d, 0)]
        exporter, storm.exports = _start_exporter(d)
        storm.check_bystanders(bystanders, exporter)  # staging buffers exist from here on
        mid = snapshot(d)
        since_check = 0
        restarted = False
        while storm.kills < count and not storm.broken:
            if not restarted and storm.kills >= count // 2 and storm.live:
                # the exporter dies too, while victims hold its memory: they keep it (as
                # a dma-buf) until they die; a new exporter takes its place
                restarted = True
                exporter.kill()
                exporter.wait()
                storm.bump("exporter_kills")
                exporter, storm.exports = _start_exporter(d)
                storm.gen += 1
                exporter.stdin.write("check\n")  # its staging buffers, as the first one's
                exporter.stdin.flush()
                if exporter.stdout.readline().strip() != "ok":
                    report.escapes += 1
                    storm.note("the new exporter's buffers were not intact")
            while len(storm.live) < concurrency and storm.kills + len(storm.live) < count:
                storm.spawn()
            storm.read(0.01)
            before = storm.kills
            storm.reap()
            since_check += storm.kills - before
            if since_check >= check_every or storm.kills >= count:
                storm.drain()
                since_check = 0
                storm.bump("checks")
                storm.check_bystanders(bystanders, exporter)
                if not storm.contained(mid, f"after {storm.kills} kills"):
                    if storm.broken:
                        break
                    mid = snapshot(d)  # count each leak once
            if storm.spawned > 3 * count + 20:
                storm.note("too many victims ended before their kill; stopping")
                break
        storm.drain()
    except Exception as exc:  # noqa: BLE001 - the report says what went wrong
        report.notes.append(f"storm stopped by {exc!r}")
        report.hangs += 1
    finally:
        storm.abort()
        for b in bystanders:
            b.close()
        if exporter is not None:
            _stop(exporter)
    if not storm.broken:
        storm.contained(base, "after the storm, everything closed")
        try:
            final = [{k: d.attr(i, k) for k in ("memory_used", "pinned_bytes")}
                     for i in range(d.devices)]
            was = [{k: b[k] for k in ("memory_used", "pinned_bytes")} for b in base.books]
            report.notes.append(f"final books {final} (before the storm {was})")
        except OSError:
            pass
    report.seconds = time.monotonic() - t0
    return report


__all__ = ["KERNEL_SOURCE", "STRESS_COUNT", "run"]
