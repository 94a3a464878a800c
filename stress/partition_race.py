"""Partition mode changes raced by tenants that open, allocate and hold on
(docs/partitions.md, "Removal"; issue 29, findings 1 and 3).

The last physical device of a daemon is split and made whole again, ``count`` mode changes
in all, each to a mode its seed picks; about half of them with debugfs
``partition_fail_step`` set so that one new partition fails late in its bring-up and the
change is rolled back (EIO) while the others have booted. Throughout every change a racer
(uid 65534 where the daemon's root is world-reachable, else root) hammers opens of every
partition node the device can have, and on each that opens creates a context and
allocates (most of a partition's memory on the first, a page on the rest), up to
``MAX_HELD`` contexts. After each change the racer stops and says, for every context it
holds, what MEM_INFO answers and what its doorbell page's lost word reads; then the round
checks:

* **no context left on a removed partition**: a partition's contexts that still answer
  are all on a partition that exists now, and that partition counts each of them (sysfs
  ``contexts``); every other one answers ENODEV and reads ENODEV in its lost word;
* **the busy check counts contexts made during the change**: while the racer holds
  contexts on the new partitions, the next mode change is refused with EBUSY;
* **no escape**: the contexts on removed partitions are held into later mode changes (the
  original attack: the driver had closed their VRAM, and its descriptor number named a
  new partition's VRAM by then); once partitions exist again, a victim fills a buffer on
  each, the racer frees (ENODEV) and closes its dead contexts, and the victim checks
  every element;
* **nothing leaked**: every ``CHECK_EVERY`` rounds and at the end, with the racer's
  contexts closed and the device whole, the daemon, its firmwares and books are back to
  the snapshot taken before the first round (``assert_contained``), the daemon runs one
  firmware per device and no more, and a bystander on device 0 still has its data.

Every errno the racer's opens, context creations and allocations got is counted (EIO is a
bug). The racer and the victim are snippets (``RACER``, ``VICTIM``) that the regression
tests (tests/contain/test_contain_partitions.py) run as another user too.
"""

from __future__ import annotations

import errno
import json
import os
import random
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from stress.report import Report
from testkit.bystander import Bystander
from testkit.contained import assert_contained, fd_count, snapshot
from testkit.daemon import Daemon
from testkit.procs import close_child, firmware_children
from testkit.tenants import as_user, tenant_code, world_reachable

#: mode changes in a full stress run (``python -m stress``)
STRESS_COUNT = 150
#: rounds between the containment checks (the device made whole, the racer's files closed)
CHECK_EVERY = 10
#: contexts the racer makes at most per mode change (under its per-process limit of 16
#: per device); those on removed partitions it holds on besides
MAX_HELD = 12
#: the modes (kmod_emul/partition.py MODES) and the late bring-up steps a change's
#: injected failure picks from: the later the step, the longer its siblings are up before
#: the rollback removes them
MODES = (1, 2, 4)
LATE_STEPS = ("handshake", "config", "attach")
#: elements of the victim's buffer on each partition (float32: 1 MiB)
VICTIM_ELEMENTS = 1 << 18

#: The racer: a raw client (abi and a sealed memfd helper only, so another user's fresh
#: interpreter runs it too). Commands on stdin, one JSON answer line each:
#: ``hammer BIG NAME...`` opens those nodes in turn until ``stop``, making up to MAX_HELD
#: contexts (the first on a node allocates BIG bytes, later ones a page); ``stop`` answers what each held context's
#: MEM_INFO and lost word say, and the errnos met; ``drop live`` frees and closes the
#: contexts that still answer, ``drop dead`` those that answer ENODEV (saying what their
#: MEM_FREE answered). EOF closes everything.
RACER = r"""
import ctypes, select, threading
from collections import Counter
from runtime._shm import sealed_memfd

ROOT = os.environ["ACCEL_EMU_ROOT"]
MAX_HELD = int(sys.argv[1])
PAGE = 1 << 12
tags = iter(range(1, 1 << 40))


def call(fd, cmd, arg):
    tag = next(tags)
    os.pwrite(fd, uapi.CMD_HDR.pack(cmd.code, 0, tag) + bytes(arg), 0)
    if cmd.has_reply:
        return cmd.struct.from_buffer_copy(os.pread(fd, ctypes.sizeof(cmd.struct), tag))


def errname(fn):
    try:
        fn()
    except OSError as exc:
        return errno.errorcode.get(exc.errno, str(exc.errno))
    return ""


class Held:
    # one open node, its context and its allocation (handle 0: the device had no room)
    def __init__(self, name, size, met):
        self.name, self.handle, self.db, self.ends = name, 0, None, []
        self.fd = os.open(f"{ROOT}/dev/accel/{name}", os.O_RDWR | os.O_CLOEXEC)
        try:
            db_fd = sealed_memfd("doorbell-page", userq.ACCEL_DB_PAGE_SIZE)
            bell_r, bell_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
            event_r, event_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
            self.ends = [bell_w, event_r]
            self.db = userq.SharedWords(db_fd, userq.ACCEL_DB_PAGE_SIZE)
            try:
                self.ctx = call(self.fd, uapi.ACCEL_CMD_CTX_CREATE, uapi.accel_ctx_create(
                    abi_major=uapi.ACCEL_ABI_MAJOR, abi_minor=uapi.ACCEL_ABI_MINOR,
                    doorbell_fd=bell_r, event_fd=event_w, db_page_fd=db_fd)).ctx_id
            finally:
                for fd in (db_fd, bell_r, event_w):
                    os.close(fd)
        except BaseException:
            self.close()
            raise
        try:
            self.handle = call(self.fd, uapi.ACCEL_CMD_MEM_ALLOC, uapi.accel_mem_alloc(
                ctx_id=self.ctx, size=size, kind=uapi.MemKind.DEVICE, fd=-1)).handle
        except OSError as exc:
            met["alloc " + errno.errorcode.get(exc.errno, str(exc.errno))] += 1

    def mem_info(self):
        return errname(lambda: call(self.fd, uapi.ACCEL_CMD_MEM_INFO,
                                    uapi.accel_mem_info(ctx_id=self.ctx)))

    def free(self):
        return errname(lambda: call(self.fd, uapi.ACCEL_CMD_MEM_FREE, uapi.accel_mem_free(
            ctx_id=self.ctx, handle=self.handle))) if self.handle else "none"

    def close(self):
        os.close(self.fd)
        for fd in self.ends:
            os.close(fd)
        if self.db is not None:
            self.db.close()


held, met, stop = [], Counter(), threading.Event()


def hammer(big, names):
    i, big_on = 0, set()
    while not stop.is_set():
        if met["context"] >= MAX_HELD:
            stop.wait(0.01)
            continue
        name = names[i % len(names)]
        i += 1
        try:
            held.append(Held(name, PAGE if name in big_on else big, met))
            big_on.add(name)
            met["context"] += 1
        except OSError as exc:
            met[errno.errorcode.get(exc.errno, str(exc.errno))] += 1
            stop.wait(0.001)


def answer(obj):
    print(json.dumps(obj), flush=True)


def drop(keep):
    frees = Counter()
    for h in [h for h in held if not keep(h)]:
        frees[h.free()] += 1
        h.close()
        held.remove(h)
    answer({"frees": frees, "held": len(held)})


thread = None
answer("ready")
for line in sys.stdin:
    words = line.split()
    if words[0] == "hammer":
        stop.clear()
        met.clear()
        thread = threading.Thread(target=hammer, args=(int(words[1]), words[2:]))
        thread.start()
    elif words[0] == "stop":
        stop.set()
        thread.join()
        answer({"held": [[h.name, h.mem_info(), h.db.get(userq.DB_LOST)] for h in held],
                "met": met})
    elif words == ["drop", "live"]:
        drop(lambda h: h.mem_info() == "ENODEV")
    elif words == ["drop", "dead"]:
        drop(lambda h: h.mem_info() != "ENODEV")
for h in held:
    h.close()
"""

#: The victim: fills a buffer on every device it sees with its own pattern, says
#: "ready", then on each stdin line answers how many elements of each changed.
VICTIM = r"""
n = int(sys.argv[1])
keep = []
for dev in range(runtime.device_count()):
    pattern = np.arange(n, dtype=np.float32) * np.float32(dev + 2) + np.float32(1)
    keep.append((pattern, runtime.to_device(pattern, device=dev)))
runtime.synchronize()
print("ready", flush=True)
for line in sys.stdin:
    print(json.dumps([int(np.count_nonzero(x.copy_to_host() != p)) for p, x in keep]),
          flush=True)
"""


def partition_names(d: Daemon, parent: int, mode: int) -> list[str]:
    """The nodes of ``parent``'s partitions in ``mode`` (kmod_emul/partition.py)."""
    return [f"accel{d.devices + 4 * parent + k}" for k in range(mode)]


class Tenant:
    """A snippet in a process of its own, answering one line per command."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc

    def say(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def ask(self, line: str | None = None) -> Any:
        """Send ``line`` (if any) and return the answer, parsed."""
        if line is not None:
            self.say(line)
        assert self.proc.stdout is not None
        answer = self.proc.stdout.readline()
        if not answer:
            raise RuntimeError(f"tenant exited {self.proc.wait()}: {self.proc.stderr.read()}")
        return json.loads(answer) if answer[0] in "[{\"" else answer.strip()

    def close(self) -> None:
        close_child(self.proc)


def wait_until(pred, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def write_errno(path: Path, text: str) -> int:
    """0 if writing ``text`` to ``path`` succeeded, else its errno."""
    try:
        path.write_text(text)
    except OSError as exc:
        return exc.errno or -1
    return 0


class Race:
    """The rounds on one daemon, and what they found, into ``report``."""

    def __init__(self, d: Daemon, seed: int, report: Report) -> None:
        self.d, self.rng, self.report = d, random.Random(seed), report
        self.parent = d.devices - 1
        self.mode_attr = d.root / "sys/class/accel" / f"accel{self.parent}" / "partition_mode"
        self.knob = d.debug(self.parent, "partition_fail_step")
        self.uid = 65534 if os.geteuid() == 0 and world_reachable(d.root) else 0
        code = tenant_code(RACER) if self.uid == 0 else as_user(RACER, self.uid)
        self.racer = Tenant(d.popen_py(code, str(MAX_HELD)))
        assert self.racer.ask() == "ready"
        self.dead = 0  # contexts the racer holds on removed partitions

    def bump(self, key: str, n: int = 1) -> None:
        self.report.done[key] = self.report.done.get(key, 0) + n

    def note(self, text: str) -> None:
        self.report.notes.append(text)

    @property
    def mode(self) -> int:
        return int(self.d.attr(self.parent, "partition_mode"))

    def change(self, rnd: int) -> None:
        """One mode change raced by the racer, and the checks that follow it."""
        mode = self.mode
        target = self.rng.choice([m for m in MODES if m != mode])
        fail = target > 1 and self.rng.random() < 0.5
        self.knob.write_text(f"{self.rng.randrange(target)}:{self.rng.choice(LATE_STEPS)}"
                             if fail else "none")
        big = int(self.d.attr(self.parent, "memory_total")) // target * 3 // 4
        # the nodes that are not there yet, from before the write; or every node, from a
        # moment after it began: then the racer's opens race the change's busy check
        # (EBUSY, when they win, is a right answer)
        now = set(partition_names(self.d, self.parent, mode)) if mode > 1 else set()
        every = partition_names(self.d, self.parent, 4)
        early = [n for n in every if n not in now] if self.rng.random() >= 0.2 else []
        if early:
            self.racer.say(f"hammer {big} {' '.join(early)}")
        answer: list[int] = []
        writer = threading.Thread(target=lambda: answer.append(
            write_errno(self.mode_attr, str(target))))
        writer.start()
        if not early:
            time.sleep(self.rng.uniform(0, 0.03))
            self.racer.say(f"hammer {big} {' '.join(every)}")
        writer.join()
        err = answer[0]
        self.knob.write_text("none")
        state = self.racer.ask("stop")
        for what, n in state["met"].items():
            if what != "context":
                self.report.errnos[what.split()[-1]] = self.report.errnos.get(
                    what.split()[-1], 0) + n
        self.bump("contexts_made", state["met"].get("context", 0))
        expected = {errno.EIO if fail else 0} | ({errno.EBUSY} if now and not early else set())
        if err not in expected:
            self.report.unexpected += 1
            self.note(f"round {rnd}: mode {mode} -> {target} (fail {fail}) answered "
                      f"{errno.errorcode.get(err, err)}")
        self.bump({errno.EIO: "rolled_back", errno.EBUSY: "refused_busy"}.get(err, "changed"))
        self.check_held(rnd, state["held"])

    def check_held(self, rnd: int, held: list[list[Any]]) -> None:
        """Every context that answers is counted by a partition that exists; every other
        answers ENODEV and reads it in its lost word. While some answer, the next mode
        change is refused (EBUSY); then those are closed."""
        now = self.mode
        names = partition_names(self.d, self.parent, now) if now > 1 else []
        live = Counter(name for name, info, _lost in held if info == "")
        for name in set(live) | set(names):
            counted = int(self.d.attr(int(name[5:]), "contexts")) if name in names else 0
            if live[name] != counted:
                self.report.escapes += 1
                self.note(f"round {rnd}: {live[name]} context(s) answer on {name}, which "
                          f"counts {counted}" + ("" if name in names else " (removed)"))
        dead = [(name, info, lost) for name, info, lost in held if info != ""]
        for name, info, lost in dead:
            if (info, lost) != ("ENODEV", errno.ENODEV):
                self.report.unexpected += 1
                self.note(f"round {rnd}: a context on {name} answers {info}, lost word {lost}")
        self.bump("contexts_removed", len(dead) - self.dead)
        self.dead = len(dead)
        if live:
            self.bump("busy_checks")
            err = write_errno(self.mode_attr, str(self.rng.choice(
                [m for m in MODES if m != now])))
            if err != errno.EBUSY:
                self.report.unexpected += 1
                self.note(f"round {rnd}: a change with {sum(live.values())} live "
                          f"context(s) answered {errno.errorcode.get(err, err)}, not EBUSY")
            self.racer.ask("drop live")
            now = self.mode  # changed, if the busy check failed
            for name in partition_names(self.d, self.parent, now) if now > 1 else []:
                if not wait_until(lambda: self.d.attr(int(name[5:]), "contexts") == "0"):
                    self.report.leaks += 1
                    self.note(f"round {rnd}: {name} kept contexts after the racer closed them")

    def victim_check(self, rnd: int) -> None:
        """With partitions up and dead contexts held: a victim fills a buffer on each
        partition, the racer frees and closes its dead contexts, the victim checks."""
        now = self.mode
        if not self.dead or now == 1:
            return
        indices = [name[5:] for name in partition_names(self.d, self.parent, now)]
        victim = Tenant(self.d.popen_py(tenant_code(VICTIM), str(VICTIM_ELEMENTS),
                                        ACCEL_VISIBLE_DEVICES=",".join(indices)))
        try:
            assert victim.ask() == "ready"
            fds = fd_count(self.d.pid)
            result = self.racer.ask("drop dead")
            if set(result["frees"]) - {"ENODEV", "none"}:
                self.report.unexpected += 1
                self.note(f"round {rnd}: frees on removed partitions answered {result}")
            # each context gave back a descriptor at least (its event pipe), after its memory
            if not wait_until(lambda: fd_count(self.d.pid) <= fds - self.dead):
                self.report.leaks += 1
                self.note(f"round {rnd}: the daemon kept the closed contexts' descriptors")
            self.bump("victim_checks")
            self.bump("dead_contexts_freed", self.dead)
            self.dead = 0
            bad = victim.ask("check")
            if any(bad):
                self.report.escapes += 1
                self.note(f"round {rnd}: the victim's buffers on {indices} lost {bad} of "
                          f"{VICTIM_ELEMENTS} elements each")
        finally:
            victim.close()

    def contained(self, base: Any, bystander: Bystander, where: str) -> None:
        """Back to whole with nothing held: the snapshot's state, one firmware per device."""
        self.racer.ask("drop live")
        self.racer.ask("drop dead")
        self.dead = 0
        if self.mode != 1:
            self.mode_attr.write_text("1")
        self.bump("checks")
        try:
            assert_contained(self.d, base)
            assert wait_until(lambda: firmware_children(self.d) == self.d.devices), (
                f"{firmware_children(self.d)} firmware processes for {self.d.devices} devices")
            bystander.check()
        except AssertionError as exc:
            self.report.leaks += 1
            self.note(f"{where}: {exc}")


def run(d: Daemon, *, count: int, seed: int) -> Report:
    """``count`` mode changes of ``d``'s last device raced by a tenant; see the module
    doc."""
    report = Report("partition_race")
    t0 = time.monotonic()
    with Bystander(d, 0, alone=True) as bystander:
        base = snapshot(d)
        race = Race(d, seed, report)
        if race.uid == 0:
            report.notes.append("root not world-reachable (or not run as root): the racer "
                                "runs as root")
        try:
            for rnd in range(count):
                race.change(rnd)
                race.victim_check(rnd)
                if (rnd + 1) % CHECK_EVERY == 0 or rnd + 1 == count:
                    race.contained(base, bystander, f"after round {rnd}")
        except Exception as exc:  # noqa: BLE001 - the report says what went wrong
            report.notes.append(f"race stopped by {exc!r}")
            report.hangs += 1
        finally:
            race.racer.close()
            race.knob.write_text("none")
    report.seconds = time.monotonic() - t0
    return report


__all__ = ["MAX_HELD", "RACER", "STRESS_COUNT", "VICTIM", "VICTIM_ELEMENTS", "Tenant",
           "partition_names", "run", "wait_until", "write_errno"]
