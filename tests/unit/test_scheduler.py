"""The firmware's scheduler and engines driven directly: no daemon, no FUSE mount.

The test thread plays the firmware's control loop (scan the doorbells, publish, poll, as
firmware/main.py does) over rings on memfds laid out as abi/userq.py says, written by a
producer of its own. Every packet's end is the Completion the scheduler's one completion
call received (recorded by wrapping it) and what the ring says (fence, fault record,
timestamps); the counters must move by exactly what the packets did. One scheduler serves
the module, so the JIT compiles its kernel once; each test makes its own context and takes
it down at its end.
"""

from __future__ import annotations

import errno
import itertools
import mmap
import os
import select
import threading
import time
from types import SimpleNamespace
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from abi import kernel_lang, mailbox, schedule, uapi, userq
from abi.userq import Op
from firmware import copies, image, memory
from firmware.adversary import Adversary
from firmware.engines import Deadlines, EnginePool, Job
from firmware.rings import Completion, FwContext, Ring
from firmware.scheduler import Scheduler
from firmware.telemetry import Counters, EngineTime, Tally
from kmod_emul.fw import LiveTable
from testkit.waiting import wait_until

MiB = 1 << 20
VA = 0x1000_0000  # the test context's one mapping
SIZE = 32 * MiB


def packet(op: int, *a: int, flags: int = 0) -> bytes:
    return userq.RAW_PACKET.pack(op, flags, *a, *[0] * (7 - len(a)))


def _memfd(size: int) -> int:
    fd = os.memfd_create("test-scheduler")
    os.ftruncate(fd, size)
    return fd


class Queue:
    """One ring as both sides hold it: the firmware's Ring, the producer's RingView."""

    def __init__(self, ctx: FwContext, qid: int, priority: int) -> None:
        fd = _memfd(userq.RING_FILE_SIZE)
        try:
            self.ring = Ring(ctx, qid, priority, qid, fd)
            self.prod = userq.RingView(fd)
        finally:
            os.close(fd)
        self.ctx = ctx
        ctx.queues[qid] = self.ring

    def write(self, *pkts: bytes) -> int:
        """Write packets and publish them (without ringing); returns the last seqno."""
        w = self.prod.wptr
        for p in pkts:
            self.prod.write_packet(w, p)
            w += 1
        self.prod.set(userq.RING_WPTR, w)
        return w

    def ring_doorbell(self) -> None:
        db = self.ctx.db
        db.set(userq.DB_SLOTS + 8 * self.ring.slot, self.prod.wptr)
        db.set(userq.DB_SEQ, db.get(userq.DB_SEQ) + 1)

    def submit(self, *pkts: bytes) -> int:
        w = self.write(*pkts)
        self.ring_doorbell()
        return w


class Device:
    """A scheduler with its engines; the test thread is its control loop."""

    def __init__(self, jit_dir: str) -> None:
        self.counters = Counters(mailbox.STAT_NAMES)
        self.residency = memory.Residency(self.counters, 64 * MiB)
        self.sched = Scheduler(dict(image.DEFAULT_PAYLOAD), self.residency, self.counters,
                               jit_dir)
        #: (ring, seqno, Completion, from an engine) of every call, in call order
        self.completions: list[tuple[Ring, int, Completion, bool]] = []
        self._lock = threading.Lock()
        real = self.sched.complete

        def complete(ring: Ring, seqno: int, c: Completion, from_engine: bool = False) -> None:
            with self._lock:
                self.completions.append((ring, seqno, c, from_engine))
            real(ring, seqno, c, from_engine)
        self.sched.complete = complete  # type: ignore[method-assign]

    def ended(self, q: Queue) -> dict[int, Completion]:
        """Each packet's end by seqno. A turn's run of packets that ended inline is one
        completion with no time of its own (``Ring.stamp``): each of its packets is told
        here by its timestamp in the ring, as its start and end."""
        with self._lock:
            calls = [(s, c) for r, s, c, _ in self.completions if r is q.ring]
        out: dict[int, Completion] = {}
        fence = 0
        for seqno, c in calls:
            if c.end_ns == 0 and c.status == 0:  # a run: every packet it passed
                for k in range(fence + 1, seqno + 1):
                    ts = q.prod.timestamp(k)
                    out[k] = Completion(0, ts, ts)
            else:
                out[seqno] = c
            fence = max(fence, seqno)
        return out

    def engine_done(self, q: Queue) -> set[int]:
        with self._lock:
            return {s for r, s, _, eng in self.completions if r is q.ring and eng}

    def step(self) -> None:
        self.sched.scan_doorbells()
        self.sched.publish()
        self.sched.poll()

    def run_until(self, done: Callable[[], bool], timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self.step()
            if done():
                return
            assert time.monotonic() < deadline, "the scheduler did not get there"
            select.select([self.sched.wake_fd], [], [], 0.001)  # an engine finished?
            self.sched.drain_wakeups()


@pytest.fixture(scope="module")
def device(tmp_path_factory: pytest.TempPathFactory) -> Device:
    return Device(str(tmp_path_factory.mktemp("jit")))


class Context:
    """A context of the device: its doorbell page, pipes, one host mapping, its queues."""

    def __init__(self, dev: Device, ctx_id: int) -> None:
        self.dev = dev
        fd = _memfd(userq.ACCEL_DB_PAGE_SIZE)
        try:
            db = userq.SharedWords(fd, userq.ACCEL_DB_PAGE_SIZE)
        finally:
            os.close(fd)
        self.event_r, event_w = os.pipe()
        doorbell_r, self.doorbell_w = os.pipe()
        for p in (self.event_r, event_w):
            os.set_blocking(p, False)
        self.ctx = FwContext(ctx_id, doorbell_r, event_w, db)
        self.ctx.seen_seq = db.get(userq.DB_SEQ)
        self.mem = np.frombuffer(mmap.mmap(-1, SIZE), np.uint8)
        self.ctx.space.add(memory.Mapping(VA, SIZE, uapi.MemKind.HOST_PINNED, 0, self.mem))
        self.queues: list[Queue] = []
        dev.sched.contexts[ctx_id] = self.ctx

    def queue(self, qid: int, priority: int = 0) -> Queue:
        q = Queue(self.ctx, qid, priority)
        self.dev.sched.add(q.ring)
        self.queues.append(q)
        return q

    def close(self) -> None:
        sched = self.dev.sched
        for ring in self.ctx.queues.values():
            sched.remove(ring)
        del sched.contexts[self.ctx.id]
        self.ctx.close()
        for q in self.queues:
            q.prod.close()
        os.close(self.event_r)
        os.close(self.doorbell_w)


_ctx_ids = itertools.count(1)


@pytest.fixture
def ctx(device: Device) -> Iterator[Context]:
    c = Context(device, next(_ctx_ids))
    try:
        yield c
    finally:
        c.close()


def moved(dev: Device, before: dict[str, int]) -> dict[str, int]:
    """The counters that moved since ``before``, by how much (the engines' busy peak, a
    high-water mark, and the engine times, which are durations, left out)."""
    after = dev.counters.snapshot()
    return {k: after[k] - before[k] for k in after
            if after[k] != before[k] and k != "copy_engines_busy_peak"
            and not k.endswith("_busy_ns")}


def check_written_back(q: Queue, ended: dict[int, Completion]) -> None:
    """What the ring says is what each Completion said: timestamps are the end times,
    each packet's start no later than its end, ends in seqno order."""
    last_end = 0
    for seqno in sorted(ended):
        c = ended[seqno]
        assert 0 < c.start_ns <= c.end_ns, (seqno, c)
        assert c.end_ns >= last_end, (seqno, c)
        assert q.prod.timestamp(seqno) == c.end_ns
        last_end = c.end_ns


@pytest.mark.timeout(60)
def test_inline_packets_complete_in_order_and_count_once(device, ctx):
    q = ctx.queue(1)
    ctx.mem[:4096] = np.arange(4096) % 251
    before = device.counters.snapshot()
    w = q.submit(packet(Op.NOP),
                 packet(Op.COPY, VA + MiB, VA, 4096),
                 packet(Op.MEMSET, VA + 2 * MiB, 100, 0xAB))
    device.step()  # inline: one pass runs them all
    assert (q.prod.completed, q.prod.rptr, q.ring.fence) == (w, w, w) == (3, 3, 3)
    ended = device.ended(q)
    assert sorted(ended) == [1, 2, 3] and not device.engine_done(q)
    assert all(c.status == 0 and c.fault is None for c in ended.values())
    check_written_back(q, ended)
    assert q.prod.read_fault() == (0, 0, 0, 0)
    assert np.array_equal(ctx.mem[MiB : MiB + 4096], ctx.mem[:4096])
    assert (ctx.mem[2 * MiB : 2 * MiB + 100] == 0xAB).all() and ctx.mem[2 * MiB + 100] == 0
    assert moved(device, before) == {"packets": 3, "copies": 1, "copy_bytes": 4096}
    # the copy and the memset took the copy engines' time, run on the control loop; the
    # context's own time counts them too (its DRM fdinfo)
    after = device.counters.snapshot()
    assert after["copy_busy_ns"] > before["copy_busy_ns"]
    assert after["compute_busy_ns"] == before["compute_busy_ns"]
    compute_ns, copy_ns = q.ring.ctx.engine_time.snapshot()
    assert copy_ns > 0 and compute_ns == 0


@pytest.mark.timeout(60)
def test_large_copies_and_memsets_run_on_the_copy_engines(device, ctx):
    q = ctx.queue(1)
    n = 2 * copies.COPY_CHUNK + 12345  # three chunks
    ctx.mem[:n] = np.random.default_rng(1).integers(0, 256, n, np.uint8)
    before = device.counters.snapshot()
    w = q.submit(packet(Op.COPY, VA + 16 * MiB, VA, n),
                 packet(Op.MEMSET, VA + n, copies.INLINE_BYTES + 1, 7))
    device.run_until(lambda: q.ring.fence == w)
    assert device.engine_done(q) == {1, 2}
    ended = device.ended(q)
    assert all(c.status == 0 and c.fault is None for c in ended.values())
    check_written_back(q, ended)
    assert ended[2].start_ns >= ended[1].end_ns  # one queue: in order, one at a time
    assert np.array_equal(ctx.mem[16 * MiB : 16 * MiB + n], ctx.mem[:n])
    assert (ctx.mem[n : n + copies.INLINE_BYTES + 1] == 7).all()
    assert moved(device, before) == {"packets": 2, "copies": 1, "copy_bytes": n}
    assert not q.ring.busy



@pytest.mark.timeout(60)
def test_a_ring_says_while_an_engine_runs_its_packet(device, ctx):
    """``RING_ON_ENGINE``, the waiters' hint (runtime/stream.py naps only while it is 1):
    set from the scheduler handing the packet to an engine until the engine ends it, and
    never for work the control loop runs itself."""
    q = ctx.queue(1)
    gate, log = threading.Event(), []
    for i in range(image.DEFAULT_PAYLOAD["copy_engines"]):  # every copy engine held
        device.sched.copy.submit(0, _Gate(f"holder{i}", log, gate, ctx=ctx.ctx.id))
    try:
        w = q.submit(packet(Op.NOP), packet(Op.MEMSET, VA, copies.INLINE_BYTES + 1, 3))
        device.step()
        assert q.ring.fence == 1 and q.ring.busy  # the no-op inline, the memset queued
        assert q.prod.get(userq.RING_ON_ENGINE) == 1
    finally:
        gate.set()
    device.run_until(lambda: q.ring.fence == w)
    assert q.prod.get(userq.RING_ON_ENGINE) == 0 and not q.ring.busy
    assert (ctx.mem[: copies.INLINE_BYTES + 1] == 3).all()
    w = q.submit(packet(Op.MEMSET, VA, 16, 4))  # small: the control loop runs it
    device.step()
    assert q.ring.fence == w and q.prod.get(userq.RING_ON_ENGINE) == 0


@pytest.mark.timeout(60)
def test_rings_waiting_on_engines_cost_the_loop_no_look_and_come_back_when_done(device, ctx):
    """A ring whose packet an engine runs leaves the loop's scan until its job ends: left
    in it, 64 rings waiting on copies cost every pass of the loop a look at each, and
    another tenant's no-op took 2.4 times as long (docs/containment.md, "Figures").
    Another ring's knocks do not bring it back early; its job's end does, and then the
    packets written behind the job run."""
    waiting = [ctx.queue(qid) for qid in range(1, 9)]
    bystander = ctx.queue(9)
    gate, log = threading.Event(), []
    for i in range(image.DEFAULT_PAYLOAD["copy_engines"]):  # every copy engine held
        device.sched.copy.submit(0, _Gate(f"holder{i}", log, gate, ctx=ctx.ctx.id))
    try:
        for q in waiting:
            q.submit(packet(Op.MEMSET, VA, copies.INLINE_BYTES + 1, 5))
        device.step()
        assert all(q.ring.busy for q in waiting)
        assert not any(q.ring in device.sched.active for q in waiting)
        for q in waiting:  # written behind the job: news only once the job ends
            q.submit(packet(Op.NOP))
        for _ in range(3):
            w = bystander.submit(packet(Op.NOP))
            device.step()
            assert bystander.ring.fence == w
            assert not any(q.ring in device.sched.active for q in waiting)
    finally:
        gate.set()
    device.run_until(lambda: all(q.ring.fence == 2 for q in waiting))
    assert all(device.engine_done(q) == {1} for q in waiting)
    assert not any(q.ring.busy for q in waiting)
    device.step()
    assert not any(q.ring in device.sched.active for q in waiting)  # idle: out again

BAD_PACKETS = {
    # name: (packet, errno, faulting address in the record)
    "copy past the mapping": (packet(Op.COPY, VA + SIZE - 8, VA, 16), errno.EFAULT, VA + SIZE),
    "copy from unmapped memory": (packet(Op.COPY, VA, 0x10, 16), errno.EFAULT, 0x10),
    "large copy past the mapping": (packet(Op.COPY, VA, VA + MiB, SIZE), errno.EFAULT, VA + SIZE),
    "memset of a value that is not a byte": (packet(Op.MEMSET, VA, 16, 256), errno.EINVAL, 0),
    "unknown opcode": (packet(77), errno.EINVAL, 0),
    "flags set": (packet(Op.NOP, flags=1), errno.EINVAL, 0),
    "wait for its own queue": (packet(Op.WAIT_QUEUE, 1, 1), errno.EINVAL, 0),
    "launch of no module": (packet(Op.LAUNCH, 5 << 16), errno.EINVAL, 0),
    "prefetch of unmanaged memory": (packet(Op.PREFETCH, VA, 16, 1), errno.EINVAL, VA),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", BAD_PACKETS)
def test_a_bad_packet_faults_its_own_queue_only(device, ctx, name):
    bad, code, addr = BAD_PACKETS[name]
    q, other = ctx.queue(1), ctx.queue(2)
    before = device.counters.snapshot()
    w = q.submit(packet(Op.NOP), bad, packet(Op.NOP), packet(Op.COPY, VA, VA + 64, 64))
    other.submit(packet(Op.NOP))
    device.run_until(lambda: q.ring.fence == w and other.ring.fence == 1)
    opcode = userq.RAW_PACKET.unpack(bad)[0]
    ended = device.ended(q)
    assert ended[1].status == 0 and ended[1].fault is None
    assert ended[2].status == code and ended[2].fault == (2, code, opcode, addr)
    assert q.prod.read_fault() == ended[2].fault  # the ring's record is the completion's
    for later in (3, 4):  # never ran
        assert ended[later].status == errno.ECANCELED and ended[later].fault is None
    check_written_back(q, ended)
    assert device.ended(other)[1].status == 0 and other.prod.read_fault()[0] == 0
    # the packets all count; the fault once; the cancelled copy moved nothing
    assert moved(device, before) == {"packets": 5, "faults": 1}


@pytest.mark.timeout(60)
def test_a_lost_contexts_rings_start_nothing(device, ctx):
    """The driver sends a context's loss on the mailbox (CTX_LOST, CTX_DESTROY) before it
    writes the doorbell page's "lost" word and answers ENODEV; the control loop drains
    the mailbox after publishing, so packets rung after the loss may be published in the
    pass that takes the message: they never start (nor those rung later)."""
    q = ctx.queue(1)
    ran = q.submit(packet(Op.NOP))
    device.run_until(lambda: q.ring.fence == ran)
    q.submit(packet(Op.NOP), packet(Op.NOP))
    device.sched.scan_doorbells()
    device.sched.publish()
    ctx.ctx.lost = True  # what the loss's message does, drained here in the pass
    device.sched.poll()
    q.submit(packet(Op.NOP))
    for _ in range(5):
        device.step()
    assert q.ring.fence == ran and q.ring.taken == ran
    assert q.ring not in device.sched.active


@pytest.mark.timeout(60)
def test_a_loss_in_the_live_table_stops_the_context_before_its_message_arrives(device, ctx):
    """The driver clears a lost context's live-table entry before the process can learn of
    the loss; its CTX_LOST / CTX_DESTROY may wait behind hundreds of other control
    messages (the mailbox is drained 256 at a time), and packets the process rings
    meanwhile must not start. The two sides share one mailbox here, as driver and
    firmware share its memfd; no message is sent at all."""
    mem = mmap.mmap(-1, mailbox.MAILBOX_SIZE)
    driver_side, firmware_side = mailbox.Mailbox(memoryview(mem)), mailbox.Mailbox(memoryview(mem))
    try:
        table = LiveTable(driver_side.live)
        entry = table.claim(ctx.ctx.id)
        ctx.ctx.live_table, ctx.ctx.live_slot = firmware_side.live, entry.slot
        q = ctx.queue(1)
        ran = q.submit(packet(Op.NOP))
        device.run_until(lambda: q.ring.fence == ran)
        other = table.claim(ctx.ctx.id + 1000)  # a neighbour's entry changes nothing
        w = q.submit(packet(Op.NOP))
        device.run_until(lambda: q.ring.fence == w)
        other.clear()
        q.submit(packet(Op.NOP), packet(Op.NOP))
        device.sched.scan_doorbells()
        device.sched.publish()  # rung before the loss and published: may start or not
        entry.clear()           # the loss, in the driver's table only
        q.submit(packet(Op.NOP))
        for _ in range(5):
            device.step()
        assert q.ring.fence == w and q.ring.taken == w
        assert q.ring not in device.sched.active and ctx.ctx.lost
        assert table.claim(ctx.ctx.id + 2000).slot in (entry.slot, other.slot)  # reused
    finally:
        ctx.ctx.live_table = None
        driver_side.release()
        firmware_side.release()
        mem.close()


@pytest.mark.timeout(60)
def test_the_doorbell_pages_lost_word_is_the_processes_and_stops_nothing(device, ctx):
    """The page's "lost" word tells the process its context was lost; the process can
    write it too, and a firmware that read it stopped the context's work for good (its
    own rings and the driver's default queue: SUBMIT_NOOP accepted, WAIT answering ETIME
    for ever). The firmware goes by the driver's messages alone."""
    q = ctx.queue(1)
    ran = q.submit(packet(Op.NOP))
    device.run_until(lambda: q.ring.fence == ran)  # idle: only its doorbell wakes it now
    ctx.ctx.db.set(userq.DB_LOST, errno.ENODEV)
    w = q.submit(packet(Op.NOP), packet(Op.NOP))
    device.run_until(lambda: q.ring.fence == w, timeout=5)
    assert device.ended(q)[w].status == 0


@pytest.mark.timeout(60)
def test_a_write_pointer_jump_faults_the_ring_in_one_step(device, ctx):
    q = ctx.queue(1)
    q.submit(packet(Op.NOP))
    device.step()
    before = device.counters.snapshot()
    jump = 1 + (1 << 40)
    q.prod.set(userq.RING_WPTR, jump)
    q.ring_doorbell()
    device.step()
    assert q.prod.read_fault() == (2, errno.EINVAL, 0, 0)
    assert (q.prod.completed, q.prod.rptr) == (jump, jump)
    (ring, seqno, c, _), = device.completions[-1:]
    assert ring is q.ring
    assert (seqno, c.status, c.fault, c.start_ns, c.end_ns) == \
        (jump, errno.EINVAL, (2, errno.EINVAL, 0, 0), 0, 0)  # cancelled unread: no timestamps
    assert moved(device, before) == {"packets": userq.RING_SLOTS, "faults": 1}
    q.submit(packet(Op.NOP))  # a faulted ring's new packets are cancelled too
    device.step()
    assert q.prod.completed == jump + 1 and device.ended(q)[jump + 1].status == errno.ECANCELED


@pytest.mark.timeout(60)
def test_the_higher_priority_ring_is_taken_first(device, ctx):
    low, high = ctx.queue(1, priority=0), ctx.queue(2, priority=1)
    low.submit(*[packet(Op.NOP)] * 10)  # rung first
    high.submit(*[packet(Op.NOP)] * 10)
    start = len(device.completions)
    device.step()
    order = [r.id for r, *_ in device.completions[start:]]  # a run per turn, or per
    assert order == sorted(order, reverse=True) and set(order) == {1, 2}  # TURN_NS of it
    assert high.prod.timestamp(10) <= low.prod.timestamp(1)  # the high ring's ran first


class _Gate(Job):
    """A job of context ``ctx`` that holds its engine until released, then records that
    it ran."""

    def __init__(self, name: str, log: list[str], gate: threading.Event | None = None,
                 ctx: int = 1) -> None:
        self.name, self.log, self.gate = name, log, gate
        self.started = threading.Event()
        # whose turn it takes, and whose engine time it is
        self.ring = SimpleNamespace(ctx=SimpleNamespace(id=ctx, engine_time=EngineTime()))

    def run(self) -> bool:
        self.started.set()
        if self.gate is not None:
            assert self.gate.wait(30)
        self.log.append(self.name)
        return True


def _held_pool() -> tuple[EnginePool, threading.Event, list[str]]:
    """A one-engine pool whose engine runs a job held until the event is set."""
    counters = Counters(mailbox.STAT_NAMES)
    pool = EnginePool("compute", 1, counters)
    log: list[str] = []
    gate = threading.Event()
    holder = _Gate("holder", log, gate, ctx=9)
    pool.submit(0, holder)
    assert holder.started.wait(30)
    assert counters.snapshot()["copy_engines_busy_peak"] == 0  # a compute engine's job
    return pool, gate, log


@pytest.mark.timeout(60)
def test_an_engine_takes_the_highest_priority_job_first():
    pool, gate, log = _held_pool()
    for name, prio in [("low1", 0), ("high1", 1), ("low2", 0), ("high2", 1)]:
        pool.submit(prio, _Gate(name, log))
    assert pool.higher_waiting(0) and pool.waiting(1) and not pool.higher_waiting(1)
    gate.set()
    wait_until(lambda: list(log), 30, "the five jobs to run", ok=lambda ran: len(ran) >= 5,
               interval=0.001)
    assert log == ["holder", "high1", "high2", "low1", "low2"]


@pytest.mark.timeout(60)
def test_contexts_of_one_priority_take_turns():
    """A context that queued four jobs first gets one turn per round: the context that
    queued one after them runs second, not fifth; a third context's two come in turn."""
    pool, gate, log = _held_pool()
    for name, ctx in [("a1", 1), ("a2", 1), ("a3", 1), ("a4", 1), ("b1", 2), ("c1", 3),
                      ("c2", 3)]:
        pool.submit(0, _Gate(name, log, ctx=ctx))
    gate.set()
    wait_until(lambda: list(log), 30, "the eight jobs to run", ok=lambda ran: len(ran) >= 8,
               interval=0.001)
    assert log == ["holder", "a1", "b1", "c1", "a2", "c2", "a3", "a4"]


def _engine_cpu_s(threads: list[threading.Thread]) -> float:
    """The CPU time ``threads`` have used so far (seconds)."""
    return sum(time.clock_gettime(time.pthread_getcpuclockid(t.ident)) for t in threads)


@pytest.mark.timeout(60)
def test_parked_engines_take_no_cpu_and_every_job_wakes_one():
    """An engine with nothing to do sleeps on its own wake-up lock: idle, the pool's
    engines use no CPU; every job submitted runs, whether an engine was parked, about to
    park or busy (a lost wake-up would leave a job queued with both engines asleep)."""
    before = set(threading.enumerate())
    pool = EnginePool("compute", 2, Counters(mailbox.STAT_NAMES))
    engines = [t for t in threading.enumerate() if t not in before]
    assert len(engines) == 2
    log: list[str] = []
    for i in range(200):  # one at a time, each waited for: a parked engine's hand-off
        job = _Gate(f"one{i}", log)
        pool.submit(0, job)
        assert job.started.wait(30)
    # from several threads at once, engines parked, parking and busy
    submitters = [threading.Thread(target=lambda k=k: [pool.submit(0, _Gate(f"{k}.{j}", log))
                                                       for j in range(100)]) for k in range(4)]
    for t in submitters:
        t.start()
    for t in submitters:
        t.join(30)
    wait_until(lambda: len(log), 30, "every job to run", ok=lambda n: n == 600,
               interval=0.001)
    wait_until(lambda: not pool.busy(), 30, "the engines to park", interval=0.001)
    idle_from = _engine_cpu_s(engines)
    time.sleep(0.3)
    assert _engine_cpu_s(engines) - idle_from < 0.005  # asleep, not polling


@pytest.mark.timeout(60)
def test_contexts_take_turns_on_the_control_loop(device, ctx, monkeypatch):
    """A context with four rings of packets queued first gets one turn, then a bystander
    context's one packet runs: second, not after the flood (start-time fair queueing of
    the control loop's time, one packet a turn here). Before, a pass gave every ring a
    turn of up to BATCH packets in ring order, and the bystander's packet came 257th."""
    from firmware import scheduler

    monkeypatch.setattr(scheduler, "TURN_NS", 0)  # a turn is one packet
    flood = [ctx.queue(q) for q in range(1, 5)]
    for q in flood:
        q.submit(*[packet(Op.NOP)] * 64)
    other = Context(device, next(_ctx_ids))
    try:
        bystander = other.queue(1)
        bystander.submit(packet(Op.NOP))
        start = len(device.completions)
        device.step()
        order = [r for r, *_ in device.completions[start:]]
        assert len(order) == 4 * 64 + 1
        assert order.index(bystander.ring) == 1, f"the bystander's packet ran " \
            f"{order.index(bystander.ring) + 1}th"
        # the flood's rings took turns too: its first four packets are one of each ring
        assert {id(r) for r in order[:1] + order[2:5]} == {id(q.ring) for q in flood}
    finally:
        other.close()


@pytest.mark.timeout(60)
def test_a_pass_counts_the_processes_own_packets_apart_from_the_drivers(device, ctx):
    """What boosts the control loop (firmware/host_cpu.py, Boost) is work from the
    processes' own rings: the driver's default queue (SUBMIT_NOOP, slot 0) is fed one
    packet per FUSE round trip through the daemon, which a boosted loop would only take
    CPU from. A pass that took only driver packets counts none; a mixed one, the ring's."""
    driver, own = ctx.queue(userq.ACCEL_DB_DEFAULT_SLOT), ctx.queue(1)
    driver.submit(packet(Op.NOP), packet(Op.NOP))
    device.step()
    assert (driver.prod.completed, device.sched.user_taken) == (2, 0)
    driver.submit(packet(Op.NOP))
    own.submit(packet(Op.NOP), packet(Op.NOP), packet(Op.NOP))
    device.step()
    assert (driver.prod.completed, own.prod.completed, device.sched.user_taken) == (3, 3, 3)
    device.step()  # nothing new: a pass without work
    assert device.sched.user_taken == 0


@pytest.mark.timeout(60)
def test_a_wait_completes_once_the_other_fence_passes(device, ctx):
    a, b = ctx.queue(1), ctx.queue(2)
    a.submit(packet(Op.NOP))
    b.submit(packet(Op.WAIT_QUEUE, 1, 2), packet(Op.NOP))
    device.step()
    device.step()
    assert b.ring.fence == 0 and b.ring.blocked is not None  # a's fence is 1
    # nothing to run until a's fence moves: the control loop may sleep (its NOP behind the
    # wait does not count), or it would spin without a timeout
    assert b.ring.ready() and not device.sched.pending()
    a.submit(packet(Op.NOP))
    device.run_until(lambda: b.ring.fence == 2)
    waited, released = device.ended(b)[1], device.ended(a)[2]
    assert waited.status == 0 and waited.start_ns < released.end_ns <= waited.end_ns
    check_written_back(b, device.ended(b))


@pytest.mark.timeout(60)
def test_a_value_wait_sleeps_with_a_bounded_poll_and_ends_at_the_store(device, ctx):
    """WAIT_VALUE: a queue waiting on a pinned word is not work the loop spins for (it
    sleeps at most the wait's backoff, 50 us to 2 ms); the host's store releases it and
    a WRITE_VALUE behind it writes in order; a bystander queue runs meanwhile."""
    a, bystander = ctx.queue(1), ctx.queue(2)
    word = ctx.mem[64:72].view(np.uint64)
    a.submit(packet(Op.WAIT_VALUE, VA + 64, 5, 8, userq.WAIT_VALUE_GEQ, 0),
             packet(Op.WRITE_VALUE, VA + 128, 0xABCD, 4))
    device.step()
    device.step()
    assert a.ring.fence == 0 and a.ring.blocked is not None
    assert not device.sched.pending()
    assert 0 < device.sched.poll_in_s() <= 0.002
    bystander.submit(packet(Op.NOP))
    device.run_until(lambda: bystander.ring.fence == 1)
    word[0] = 4
    device.step()
    assert a.ring.fence == 0
    word[0] = 5
    device.run_until(lambda: a.ring.fence == 2)
    assert int(ctx.mem[128:132].view(np.uint32)[0]) == 0xABCD
    assert device.ended(a)[1].status == 0 and device.sched.poll_in_s() == float("inf")
    check_written_back(a, device.ended(a))


@pytest.mark.timeout(60)
def test_a_value_wait_nobody_ends_faults_its_queue_at_its_timeout(device, ctx):
    q = ctx.queue(1)
    q.submit(packet(Op.WAIT_VALUE, VA + 256, 1, 4, userq.WAIT_VALUE_EQ, 50_000_000),
             packet(Op.NOP))
    device.step()
    assert q.ring.blocked is not None and device.sched.poll_in_s() <= 0.05
    device.run_until(lambda: q.ring.fence == 2)
    ended = device.ended(q)
    assert (ended[1].status, ended[2].status) == (errno.ETIMEDOUT, errno.ECANCELED)
    assert q.prod.read_fault() == (1, errno.ETIMEDOUT, Op.WAIT_VALUE, VA + 256)
    assert ended[1].end_ns - ended[1].start_ns >= 50_000_000


KERNEL = '''
def fill(x, v):
    x[global_id(0)] = v
'''


def _args(x_va: int, n: int, v: float) -> bytes:
    f32 = kernel_lang.DTYPE_CODES["float32"]
    bits = int.from_bytes(np.float32(v).tobytes().ljust(8, b"\0"), "little")
    return (userq.ARG_RECORD.pack(userq.ARG_BUFFER, f32, x_va, 4 * n)
            + userq.ARG_RECORD.pack(userq.ARG_SHAPE, 1, n, 0)
            + userq.ARG_RECORD.pack(userq.ARG_SCALAR, f32, bits, 0))


@pytest.mark.timeout(240)  # numba compiles the kernel once: seconds on a loaded machine
def test_a_kernel_launches_on_an_engine_then_inline_and_faults_out_of_bounds(device, ctx):
    from runtime.kernels import canonical_json, compile_module

    q = ctx.queue(1)
    device.sched.kernels.load_module(ctx.ctx, 3, canonical_json(compile_module(KERNEL)))
    n, x_va, args_va = 256, VA + MiB, VA
    args = _args(x_va, n, 2.5)
    ctx.mem[: len(args)] = np.frombuffer(args, np.uint8)
    x = ctx.mem[MiB : MiB + 4 * n].view(np.float32)

    def launch(grid: int) -> bytes:
        return packet(Op.LAUNCH, 3 << 16, userq.pack_dims((grid, 1, 1)),
                      userq.pack_dims((64, 1, 1)), 0, args_va, len(args))

    before = device.counters.snapshot()
    q.submit(launch(n // 64))  # waits for the module, then compiles on an engine
    device.run_until(lambda: q.ring.fence == 1, timeout=200)
    assert device.engine_done(q) == {1}
    assert (x == 2.5).all()
    # two engines share its blocks: one compiles, the other finds it compiled; the JIT
    # itself may have come up before ``before`` (the module's load creates it on a side
    # thread, at once when this process imported numba already), so its flag is read whole
    first = moved(device, before)
    first.pop("jit_ready", None)
    assert first == {"packets": 1, "launches": 1, "jit_compiles": 1, "jit_hits": 1}
    assert device.counters.snapshot()["jit_ready"] == 1

    x[:] = 0
    before = device.counters.snapshot()
    q.submit(launch(n // 64))  # compiled, small, no loops: inline
    device.step()
    assert q.ring.fence == 2 and device.engine_done(q) == {1}
    assert (x == 2.5).all()
    inline = moved(device, before)
    inline.pop("jit_hits", None)  # the JIT's own count, published by engine jobs only
    assert inline == {"packets": 1, "launches": 1}

    before = device.counters.snapshot()
    q.submit(launch(n // 64 + 1))  # one block too many: x[256] is past the buffer
    device.run_until(lambda: q.ring.fence == 3)
    c = device.ended(q)[3]
    assert c.status == errno.EFAULT and c.fault is not None
    seqno, code, opcode, addr = c.fault
    assert (seqno, code, opcode) == (3, errno.EFAULT, Op.LAUNCH)
    assert x_va + 4 * n <= addr < x_va + 4 * (n + 64)
    assert q.prod.read_fault() == c.fault
    check_written_back(q, device.ended(q))
    assert moved(device, before) == {"packets": 1, "faults": 1}



@pytest.mark.timeout(240)
def test_a_rings_inline_launches_share_one_watchdog_arming_per_turn(device, ctx, monkeypatch):
    """One arming of the inline watchdog covers a ring's turn of inline launches
    (Kernels.end_turn), disarmed once the turn ended, and after a launch the watchdog
    stopped (its ring faults) the next ring's launch runs under a fresh arming, not
    stopped by the old word."""
    from firmware import scheduler
    from runtime.kernels import canonical_json, compile_module

    monkeypatch.setattr(scheduler, "TURN_NS", 10**12)  # the ten launches: one turn
    kernels = device.sched.kernels
    kernels.load_module(ctx.ctx, 6, canonical_json(compile_module(KERNEL)))
    n, x_va, args_va = 256, VA + MiB, VA
    args = _args(x_va, n, 1.5)
    ctx.mem[: len(args)] = np.frombuffer(args, np.uint8)
    x = ctx.mem[MiB : MiB + 4 * n].view(np.float32)
    fill = packet(Op.LAUNCH, 6 << 16, userq.pack_dims((n // 64, 1, 1)),
                  userq.pack_dims((64, 1, 1)), 0, args_va, len(args))
    q1, q2 = ctx.queue(1), ctx.queue(2)
    w = q1.submit(fill)
    device.run_until(lambda: q1.ring.fence == w, timeout=200)  # compiled (on an engine)
    deadlines = kernels.deadlines
    real_arm, arms = deadlines.arm_inline, []

    def arm(abort, watchdog_s):  # noqa: ANN001, ANN202
        arms.append(watchdog_s)
        real_arm(abort, watchdog_s)
    monkeypatch.setattr(deadlines, "arm_inline", arm)
    w = q1.submit(*[fill] * 10)
    device.step()
    assert q1.ring.fence == w and len(arms) == 1 and deadlines._inline is None
    assert deadlines._entries == {}

    def expired(abort, watchdog_s):  # noqa: ANN001, ANN202 - fires at once
        arm(abort, watchdog_s)
        abort[0] = deadlines.watchdog
        monkeypatch.setattr(deadlines, "arm_inline", arm)
    monkeypatch.setattr(deadlines, "arm_inline", expired)
    x[:] = 0
    w1, w2 = q1.submit(fill), q2.submit(fill)
    device.step()
    # the first turn's launch (q2's: its ring has had less of the loop, scheduler.py)
    # is stopped, the other runs under an entry of its own
    assert device.ended(q2)[w2].status == errno.ETIMEDOUT
    assert device.ended(q1)[w1].status == 0 and (x == 1.5).all()
    assert len(arms) == 3 and deadlines._inline is None and deadlines._entries == {}


@pytest.mark.timeout(60)
def test_the_inline_watchdog_fires_past_its_arming_and_not_after_its_turn():
    """The timer thread stops an inline launch still running past the turn's arming
    (``Deadlines.arm_inline``) by its abort word; a turn disarmed in time is never
    stopped, and a new arming clears a word an old one set."""
    deadlines = Deadlines(preempt=1, watchdog=2)
    abort = np.zeros(1, np.int64)
    deadlines.arm_inline(abort, 0.05)
    wait_until(lambda: abort[0] == 2, 10, "the armed watchdog fired")
    deadlines.arm_inline(abort, 0.5)
    assert abort[0] == 0  # cleared by the arming, under the timer's lock
    deadlines.disarm_inline()
    time.sleep(1.0)  # past the disarmed turn's deadline
    assert abort[0] == 0
    deadlines.arm_inline(abort, 60)  # a later deadline than the timer's next wake-up
    deadlines.arm_inline(abort, 0.05)  # an earlier one wakes it
    wait_until(lambda: abort[0] == 2, 10, "the earlier arming fired")


def _compiled_fill(device: Device, ctx: Context, module: int, n: int, v: float
                   ) -> tuple[Queue, np.ndarray, Callable[[int], int]]:
    """A queue, the ``n`` floats ``fill`` writes ``v`` to, and a launch of it over a given
    number of threads (64 a block); compiled already, by a first launch of one block."""
    from runtime.kernels import canonical_json, compile_module

    q = ctx.queue(1)
    device.sched.kernels.load_module(ctx.ctx, module, canonical_json(compile_module(KERNEL)))
    x_va, args_va = VA + MiB, VA
    args = _args(x_va, n, v)
    ctx.mem[: len(args)] = np.frombuffer(args, np.uint8)

    def launch(threads: int) -> int:
        return q.submit(packet(Op.LAUNCH, module << 16,
                               userq.pack_dims((threads // 64, 1, 1)),
                               userq.pack_dims((64, 1, 1)), 0, args_va, len(args)))

    first = launch(64)
    device.run_until(lambda: q.ring.fence == first, timeout=200)  # compiled now
    return q, ctx.mem[MiB : MiB + 4 * n].view(np.float32), launch


@pytest.mark.timeout(240)
def test_a_loop_free_launch_runs_inline_within_the_work_budget(device, ctx, monkeypatch):
    """Inline on the control loop while threads x work per thread fits INLINE_WORK (and
    the threads INLINE_THREADS); one thread more, and it goes to the engines."""
    from firmware import launches

    n = 64 * 1024
    q, x, launch = _compiled_fill(device, ctx, 5, n, 4.5)
    kernel = next(iter(ctx.ctx.modules[5].compiled.values()))
    budget = kernel.work_per_thread * n // 2
    monkeypatch.setattr(launches, "INLINE_WORK", budget)
    x[:] = 0
    seqno = launch(n // 2)  # exactly the budget: inline, done within one pass
    device.step()
    assert q.ring.fence == seqno and seqno not in device.engine_done(q)
    assert (x[: n // 2] == 4.5).all() and (x[n // 2 :] == 0).all()
    seqno = launch(n // 2 + 64)  # one block more: on an engine
    device.run_until(lambda: q.ring.fence == seqno)
    assert seqno in device.engine_done(q) and (x[: n // 2 + 64] == 4.5).all()
    monkeypatch.setattr(launches, "INLINE_WORK", budget * 4)
    monkeypatch.setattr(launches, "INLINE_THREADS", n // 2)
    seqno = launch(n // 2 + 64)  # within the work, over the threads: on an engine
    device.run_until(lambda: q.ring.fence == seqno)
    assert seqno in device.engine_done(q)
    assert all(c.status == 0 for c in device.ended(q).values())


LOOPING = '''
def sums(x, n: 'int64'):
    i = global_id(0)
    s = 0.0
    for j in range(n):
        s += 1.0
        x[i * n + j] = s
'''


@pytest.mark.timeout(240)
def test_a_looping_launch_runs_inline_within_its_launch_bound(device, ctx, monkeypatch):
    """A kernel with a ``range`` loop runs inline when its launch's values bound its work
    within INLINE_WORK (firmware/launch_work.py), else on an engine; a value no bound
    covers (a trip count past launch_work.VALUE_LIMIT) goes to an engine whatever the
    budget; a bounds miss in the loop, run inline, faults at the exact address and the
    ring's later launch still runs."""
    from firmware import launches
    from runtime.kernels import canonical_json, compile_module

    q = ctx.queue(1)
    device.sched.kernels.load_module(ctx.ctx, 9, canonical_json(compile_module(LOOPING)))
    x_va, threads = VA + MiB, 64
    x = ctx.mem[MiB : MiB + 4 * threads * 16].view(np.float32)
    f32, i64 = kernel_lang.DTYPE_CODES["float32"], kernel_lang.DTYPE_CODES["int64"]

    def launch(n: int, elements: int, at: int) -> int:
        args = (userq.ARG_RECORD.pack(userq.ARG_BUFFER, f32, x_va, 4 * elements)
                + userq.ARG_RECORD.pack(userq.ARG_SHAPE, 1, elements, 0)
                + userq.ARG_RECORD.pack(userq.ARG_SCALAR, i64, n & (1 << 64) - 1, 0))
        ctx.mem[at : at + len(args)] = np.frombuffer(args, np.uint8)
        return q.submit(packet(Op.LAUNCH, 9 << 16, userq.pack_dims((1, 1, 1)),
                               userq.pack_dims((threads, 1, 1)), 0, VA + at, len(args)))

    first = launch(4, threads * 4, 0)  # compiles on an engine
    device.run_until(lambda: q.ring.fence == first, timeout=200)
    first = launch(4, threads * 4, 0)  # finds it compiled (the module keeps it)
    device.run_until(lambda: q.ring.fence == first)
    kernel = next(iter(ctx.ctx.modules[9].compiled.values()))
    per_thread = kernel.loop_work.per_thread((1, 1, 1), (threads, 1, 1),
                                             [x, np.int64(8)])
    monkeypatch.setattr(launches, "INLINE_WORK",
                        threads * per_thread * launches.LOOP_WORK_WEIGHT)
    x[:] = 0
    seqno = launch(8, threads * 8, 256)  # exactly the budget: inline, within one pass
    device.step()
    assert q.ring.fence == seqno and seqno not in device.engine_done(q)
    assert (x[: threads * 8].reshape(threads, 8) == np.arange(1, 9)).all()
    seqno = launch(9, threads * 9, 512)  # a trip more: on an engine
    device.run_until(lambda: q.ring.fence == seqno)
    assert seqno in device.engine_done(q)
    assert (x[: threads * 9].reshape(threads, 9) == np.arange(1, 10)).all()

    monkeypatch.setattr(launches, "INLINE_WORK", 1 << 62)
    seqno = launch(-(1 << 62), threads, 768)  # no trip, but past any bound: an engine
    device.run_until(lambda: q.ring.fence == seqno)
    assert seqno in device.engine_done(q) and device.ended(q)[seqno].status == 0

    x[:] = 0
    before = device.counters.snapshot()
    bad = launch(8, threads * 8 - 1, 1024)  # the last thread's last store misses
    good = launch(2, threads * 2, 1280)
    device.run_until(lambda: q.ring.fence == good)
    assert bad not in device.engine_done(q)  # the miss was inline
    c = device.ended(q)[bad]
    assert c.fault == (bad, errno.EFAULT, Op.LAUNCH, x_va + 4 * (threads * 8 - 1))
    assert q.prod.read_fault() == c.fault
    assert device.ended(q)[good].status == errno.ECANCELED  # the faulted ring cancels
    assert moved(device, before) == {"packets": 2, "faults": 1}


@pytest.mark.timeout(240)
def test_a_launchs_blocks_go_to_whichever_engine_gets_to_them(device, ctx, monkeypatch):
    """An engine launch's blocks are claimed in chunks (Launch.claim), not cut in one half
    per engine: while the engine with the first chunk is held up in it (its CPU taken,
    say), the other runs every other block; the packet completes with the held chunk."""
    from firmware import launches

    n = 64 * 1024
    q, x, launch = _compiled_fill(device, ctx, 8, n, 6.5)
    monkeypatch.setattr(launches, "INLINE_THREADS", 64)  # the whole grid on the engines
    claims: list[tuple[int, int]] = []
    gate = threading.Event()
    real_claim = launches.Launch.claim

    def claim(self: launches.Launch) -> tuple[int, int] | None:
        chunk = real_claim(self)
        if chunk is not None:
            claims.append(chunk)
            if chunk[0] == 0:  # the first chunk's engine is held up before running it
                assert gate.wait(30)
        return chunk
    monkeypatch.setattr(launches.Launch, "claim", claim)
    blocks = n // 64
    x[:] = 0
    try:
        seqno = launch(n)
        device.run_until(lambda: bool((x[n // 4 :] == 6.5).all()))
        assert q.ring.fence < seqno and (x[: n // 4] == 0).all()
    finally:
        gate.set()
    device.run_until(lambda: q.ring.fence == seqno)
    assert device.ended(q)[seqno].status == 0 and (x == 6.5).all()
    # the chunks tile the grid: a quarter of what was left each (two engines), never less
    # than a 64th of the grid
    assert claims[0] == (0, blocks // 4)
    assert [lo for lo, _ in claims] == [0] + [hi for _, hi in claims[:-1]]
    assert claims[-1][1] == blocks
    assert all(hi - lo >= blocks // 64 or hi == blocks for lo, hi in claims)


@pytest.mark.timeout(240)
def test_a_rings_turn_ends_after_its_inline_works_worth(device, ctx, monkeypatch):
    """Large inline launches queued on one ring take one turn each: one of them runs,
    then the next ring's (small) launch, not the whole batch first."""
    from firmware import launches
    from runtime.kernels import canonical_json, compile_module

    warm = ctx.queue(3)
    device.sched.kernels.load_module(ctx.ctx, 6, canonical_json(compile_module(KERNEL)))
    n, x_va, args_va = 16 * 1024, VA + MiB, VA
    args = _args(x_va, n, 5.5)
    ctx.mem[: len(args)] = np.frombuffer(args, np.uint8)

    def launch(threads: int) -> bytes:
        return packet(Op.LAUNCH, 6 << 16, userq.pack_dims((threads // 64, 1, 1)),
                      userq.pack_dims((64, 1, 1)), 0, args_va, len(args))

    first = warm.submit(launch(64))
    device.run_until(lambda: warm.ring.fence == first, timeout=200)  # compiled now
    kernel = next(iter(ctx.ctx.modules[6].compiled.values()))
    big, small = ctx.queue(1), ctx.queue(2)  # no turns yet: neither has had more time
    monkeypatch.setattr(launches, "INLINE_WORK", kernel.work_per_thread * n)
    big.submit(launch(n), launch(n), launch(n))
    last = small.submit(launch(64))
    device.run_until(lambda: (big.ring.fence, small.ring.fence) == (3, last))
    ran = device.ended(big)
    assert device.ended(small)[last].start_ns < ran[2].start_ns  # not after the batch
    assert not device.engine_done(big)  # all three inline, one turn each
    assert all(c.status == 0 for q in (big, small) for c in device.ended(q).values())


@pytest.mark.timeout(240)
def test_a_repeated_engine_launch_is_bound_once_while_the_memory_stays(device, ctx,
                                                                       monkeypatch):
    """A launch for the engines is kept checked and bound (firmware/launches.py
    ``EngineBound``) as an inline one is: the same launch again binds nothing, and runs;
    once the context's mappings changed it is bound again, against memory as it is now."""
    from firmware import launches

    n = 64 * 64
    q, x, launch = _compiled_fill(device, ctx, 11, n, 7.5)
    monkeypatch.setattr(launches, "INLINE_THREADS", 64)  # the whole grid on the engines
    binds: list[int] = []
    real_bind = launches.bind_args

    def bind_args(space, steps):  # noqa: ANN001, ANN202 - the wrapped function's own
        binds.append(space.generation)
        return real_bind(space, steps)
    monkeypatch.setattr(launches, "bind_args", bind_args)

    for i in range(3):
        x[:] = 0
        seqno = launch(n)
        device.run_until(lambda: q.ring.fence == seqno)
        assert seqno in device.engine_done(q) and device.ended(q)[seqno].status == 0
        assert (x == 7.5).all()
    assert len(binds) == 1  # bound by the first, reused by the other two
    bound = [b for b in ctx.ctx.modules[11].bound.values()
             if type(b) is launches.EngineBound]
    assert len(bound) == 1 and bound[0].nblocks == n // 64

    other_va = VA + SIZE  # a mapping added: every binding of the context is stale
    ctx.ctx.space.add(memory.Mapping(other_va, MiB, uapi.MemKind.HOST_PINNED, 0,
                                     np.frombuffer(mmap.mmap(-1, MiB), np.uint8)))
    x[:] = 0
    seqno = launch(n)
    device.run_until(lambda: q.ring.fence == seqno)
    assert device.ended(q)[seqno].status == 0 and (x == 7.5).all()
    assert len(binds) == 2 and binds[1] != binds[0]  # bound again, at the new generation


@pytest.mark.timeout(240)
def test_a_repeated_inline_launch_reads_its_block_and_memory_as_they_are_now(device, ctx):
    """An inline launch bound once runs again unbound (firmware/launches.py ``Bound``),
    but only while its argument block says the same and the context's mappings did not
    change: a rewritten block runs with its new values, and a buffer unmapped since then
    faults at its address instead of being written through the old view."""
    from runtime.kernels import canonical_json, compile_module

    q = ctx.queue(1)
    device.sched.kernels.load_module(ctx.ctx, 4, canonical_json(compile_module(KERNEL)))
    n, args_va, x_va = 256, VA, VA + SIZE  # x in a mapping of its own, after the first
    x_mem = np.frombuffer(mmap.mmap(-1, MiB), np.uint8)
    ctx.ctx.space.add(memory.Mapping(x_va, MiB, uapi.MemKind.HOST_PINNED, 0, x_mem))
    x = x_mem[: 4 * n].view(np.float32)
    pkt = packet(Op.LAUNCH, 4 << 16, userq.pack_dims((n // 64, 1, 1)),
                 userq.pack_dims((64, 1, 1)), 0, args_va, len(_args(x_va, n, 0)))

    def launch(v: float) -> Completion:
        ctx.mem[: len(pkt)] = 0
        args = _args(x_va, n, v)
        ctx.mem[: len(args)] = np.frombuffer(args, np.uint8)
        seqno = q.submit(pkt)
        device.run_until(lambda: q.ring.fence == seqno, timeout=200)
        return device.ended(q)[seqno]

    assert launch(1.5).status == 0 and (x == 1.5).all()  # on an engine, if not compiled yet
    for v in (2.5, 2.5, 3.5):  # inline: bound, then bound again, then a new block
        before = device.counters.snapshot()
        assert launch(v).status == 0 and (x == v).all()
        inline = moved(device, before)
        inline.pop("jit_hits", None)  # the first inline run may find it in the JIT
        assert inline == {"packets": 1, "launches": 1}
    # one binding per block: 2.5's was reused, 3.5's is new (1.5's if it ran inline)
    bound = [float(b.values[1]) for b in ctx.ctx.modules[4].bound.values()]
    assert sorted(bound) in ([2.5, 3.5], [1.5, 2.5, 3.5])
    ctx.ctx.space.remove(x_va)
    x[:] = 0
    before = device.counters.snapshot()
    c = launch(3.5)
    assert c.status == errno.EFAULT and c.fault == (q.ring.fence, errno.EFAULT, Op.LAUNCH, x_va)
    assert (x == 0).all()  # nothing written through the unmapped buffer's old view
    assert moved(device, before) == {"packets": 1, "faults": 1}
    check_written_back(q, device.ended(q))


@pytest.mark.timeout(60)
def test_counters_lose_no_update_across_threads_and_a_tally_merges_once():
    counters = Counters(["n", "peak"])

    def work(i: int) -> None:
        for k in range(20_000):
            counters.add("n")
            counters.peak("peak", i * 20_000 + k)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert counters.snapshot() == {"n": 80_000, "peak": 79_999}
    tally = Tally()  # the control loop's: merged in one step, then empty
    tally.add("n", 5)
    tally.add("n")
    tally.flush(counters)
    tally.flush(counters)
    assert counters.snapshot() == {"n": 80_006, "peak": 79_999}


@pytest.mark.timeout(240)
def test_a_launch_naming_no_address_reads_its_queues_arena_slot(device, ctx):
    """A LAUNCH whose argument address is 0 takes its block from its seqno's slot of the
    arena its producer named in the ring (``RING_ARGS_VA``/``RING_ARGS_SLOTS``, abi/userq.py):
    the same packet bytes launch with each slot's values. With no arena named, address 0
    faults (EFAULT at 0); an arena outside the context's memory faults at the slot's
    address; and a faulted queue leaves the next queue's launches as they were."""
    from runtime.kernels import canonical_json, compile_module

    device.sched.kernels.load_module(ctx.ctx, 5, canonical_json(compile_module(KERNEL)))
    n, x_va, slots = 256, VA + MiB, 3
    x = ctx.mem[MiB : MiB + 4 * n].view(np.float32)
    length = len(_args(x_va, n, 0))
    pkt = packet(Op.LAUNCH, 5 << 16, userq.pack_dims((n // 64, 1, 1)),
                 userq.pack_dims((64, 1, 1)), 0, 0, length)

    def launch(q: Queue) -> Completion:
        seqno = q.submit(pkt)
        device.run_until(lambda: q.ring.fence == seqno, timeout=200)
        return device.ended(q)[seqno]

    bare = ctx.queue(1)  # names no arena
    c = launch(bare)
    assert c.status == errno.EFAULT and c.fault == (1, errno.EFAULT, Op.LAUNCH, 0)

    hostile = ctx.queue(2)  # an arena past the end of the context's one mapping
    hostile.prod.set(userq.RING_ARGS_VA, VA + SIZE)
    hostile.prod.set(userq.RING_ARGS_SLOTS, (1 << 64) - 1)
    c = launch(hostile)
    assert c.status == errno.EFAULT
    assert c.fault == (1, errno.EFAULT, Op.LAUNCH, VA + SIZE + userq.RING_ARGS_SLOT_BYTES)

    q = ctx.queue(3)
    q.prod.set(userq.RING_ARGS_VA, VA)
    q.prod.set(userq.RING_ARGS_SLOTS, slots)
    for seqno, v in enumerate((1.5, 2.5, 3.5, 4.5), 1):  # slots 1, 2, 0, then 1 again
        off = seqno % slots * userq.RING_ARGS_SLOT_BYTES
        ctx.mem[off : off + length] = np.frombuffer(_args(x_va, n, v), np.uint8)
        assert launch(q).status == 0 and (x == v).all()
    check_written_back(q, device.ended(q))


@pytest.mark.timeout(60)
def test_a_replayed_fault_comes_at_its_packet_and_holds_the_context_until_answered(
        device, ctx):
    """A replay's FAULT entry at packet 2 of queue 0 (docs/schedule.md, "Injected
    faults") is due once queue 0 started packet 1 and the context is about to start
    another packet -- here queue 1's first: the firmware asks the driver for it (``fire``)
    and starts nothing of the context's until the answer; another context runs meanwhile."""
    value, address = schedule.parse_fault_text("compute ue 0x7")
    fd = _memfd(schedule.SCHED_FILE_SIZE)
    try:
        fault = schedule.Entry(0, 2, schedule.Decision.FAULT, value, address)
        os.pwrite(fd, b"".join(w.to_bytes(8, "little") for w in schedule.entry_words(fault)),
                  schedule.SCHED_ENTRIES)
        os.pwrite(fd, (1).to_bytes(8, "little"), schedule.SCHED_COUNT)
        fired: list[schedule.Entry] = []
        adv = ctx.ctx.adversary = Adversary(schedule.Mode.REPLAY, 0, fd, fired.append)
    finally:
        os.close(fd)
    q0, q1 = ctx.queue(1), ctx.queue(2)
    adv.queue_added(q0.ring)
    adv.queue_added(q1.ring)
    q0.submit(packet(Op.NOP))
    device.run_until(lambda: 1 in device.ended(q0))
    assert fired == []  # packet 1 came before the fault
    q1.submit(packet(Op.NOP))
    other = Context(device, next(_ctx_ids))
    try:
        bystander = other.queue(1)
        bystander.submit(packet(Op.NOP))
        device.run_until(lambda: 1 in device.ended(bystander))
    finally:
        other.close()
    assert fired == [fault]
    assert 1 not in device.ended(q1)  # held until the driver answers
    adv.fault_answered()
    device.run_until(lambda: 1 in device.ended(q1))
    assert fired == [fault]  # once


# --- a turn's run of inline ends, published once ---------------------------------------

def _calls(device: Device, q: Queue, since: int) -> list[tuple[int, int, int | None]]:
    """The completion calls of ``q`` since index ``since``: (seqno, status, faulting seqno)."""
    return [(s, c.status, c.fault and c.fault[0])
            for r, s, c, _ in device.completions[since:] if r is q.ring]


@pytest.mark.timeout(240)
def test_a_fault_mid_run_publishes_the_run_first_then_faults_and_cancels_the_rest(device, ctx):
    """Launches before a faulting packet end well, published as one run before the
    fault's own completion (a waiter never sees the fault record ahead of the fence over
    the packets before it); the packets after it are cancelled, unrun."""
    q, x, _ = _compiled_fill(device, ctx, 7, 64, 2.5)
    x[:] = 0
    good = userq.RAW_PACKET.pack(*q.prod.read_packet(1))  # the compiling launch's packet
    since, before = len(device.completions), device.counters.snapshot()
    w = q.submit(good, good, packet(Op.NOP, flags=1), good, packet(Op.NOP))
    device.step()
    assert q.ring.fence == w == 6 and (x == 2.5).all()
    calls = _calls(device, q, since)  # a run per TURN_NS: one or more before the fault
    assert calls[-3:] == [(4, errno.EINVAL, 4), (5, errno.ECANCELED, None),
                          (6, errno.ECANCELED, None)]
    assert calls[-4] == (3, 0, None) and all(c[1:] == (0, None) for c in calls[:-3])
    assert q.prod.read_fault() == (4, errno.EINVAL, Op.NOP, 0)
    ended = device.ended(q)
    assert [ended[s].status for s in (2, 3)] == [0, 0]
    assert 0 < q.prod.timestamp(2) <= q.prod.timestamp(3) <= ended[4].end_ns
    counts = moved(device, before)
    assert {k: counts.get(k) for k in ("packets", "faults", "launches")} == \
        {"packets": 5, "faults": 1, "launches": 2}


@pytest.mark.timeout(60)
def test_a_wait_in_a_run_publishes_the_packets_before_it_and_a_written_value_follows_them(
        device, ctx, monkeypatch):
    """The packets before a WAIT_VALUE are published when the ring blocks, not when the
    wait ends; a WRITE_VALUE's word is written only once the fence passed every packet
    before it (the host may read the word instead of the fence)."""
    from firmware import waits

    q = ctx.queue(1)
    word = ctx.mem[64:72].view(np.uint64)
    word[0] = 0
    fence_at_write: list[int] = []
    real_write = waits.write_value

    def write_value(ring: Ring, pkt: userq.WriteValue) -> None:
        fence_at_write.append(q.prod.completed)
        real_write(ring, pkt)
    monkeypatch.setattr(waits, "write_value", write_value)
    w = q.submit(packet(Op.NOP), packet(Op.NOP),
                 packet(Op.WAIT_VALUE, VA + 64, 1, 8, userq.WAIT_VALUE_GEQ, 0),
                 packet(Op.NOP), packet(Op.NOP),
                 packet(Op.WRITE_VALUE, VA + 128, 0x5EED, 4), packet(Op.NOP))
    device.step()
    assert (q.ring.fence, q.prod.completed) == (2, 2) and q.ring.blocked is not None
    word[0] = 1
    device.run_until(lambda: q.ring.fence == w)
    assert fence_at_write == [5]
    assert int(ctx.mem[128:132].view(np.uint32)[0]) == 0x5EED
    ended = device.ended(q)
    assert all(ended[s].status == 0 for s in range(1, w + 1))
    check_written_back(q, ended)


@pytest.mark.timeout(60)
def test_a_lone_rings_turn_goes_on_publishing_its_run_every_turns_time(device, ctx,
                                                                       monkeypatch):
    """A ring alone on the loop keeps its turn past TURN_NS, its run published each time
    the turn's time is up (here every packet: TURN_NS 0); with a second ring active the
    turns alternate as before."""
    from firmware import scheduler

    monkeypatch.setattr(scheduler, "TURN_NS", 0)
    q = ctx.queue(1)
    since = len(device.completions)
    q.submit(*[packet(Op.NOP)] * 5)
    turns = 0
    real = device.sched._poll_ring

    def poll_ring(*a: object) -> int:
        nonlocal turns
        turns += 1
        return real(*a)
    monkeypatch.setattr(device.sched, "_poll_ring", poll_ring)
    device.step()
    assert q.ring.fence == 5 and turns == 1
    assert [s for s, _, _ in _calls(device, q, since)] == [1, 2, 3, 4, 5]
    a, b = ctx.queue(2), ctx.queue(3)
    turns = 0
    a.submit(*[packet(Op.NOP)] * 3)
    b.submit(*[packet(Op.NOP)] * 3)
    device.step()
    assert (a.ring.fence, b.ring.fence) == (3, 3)
    assert turns > 2  # not each ring's three in a turn of its own: the turns alternated


@pytest.mark.timeout(60)
def test_news_ends_a_lone_rings_turn_and_a_higher_priority_ring_goes_next(device, ctx,
                                                                         monkeypatch):
    """A higher-priority ring rung while a low one runs alone: the pass's news ends the
    low ring's turn (its run so far published), and the next pass runs the high ring's
    packets before the rest of the low one's."""
    from firmware import scheduler

    monkeypatch.setattr(scheduler, "TURN_NS", 0)
    low, high = ctx.queue(1, priority=0), ctx.queue(2, priority=1)
    low.submit(*[packet(Op.NOP)] * 20)
    news = []

    def interrupted() -> bool:  # the doorbell rings after the low ring's first packet
        if not news:
            news.append(high.submit(*[packet(Op.NOP)] * 3))
        return True
    device.sched.scan_doorbells()
    device.sched.publish()
    device.sched.poll(interrupted)
    assert low.ring.fence == low.prod.completed == 1 and high.ring.fence == 0
    device.step()
    device.run_until(lambda: low.ring.fence == 20)
    assert high.ring.fence == 3
    assert high.prod.timestamp(3) <= low.prod.timestamp(2)


@pytest.mark.timeout(60)
def test_a_held_scheduler_takes_nothing_and_its_release_publishes_each_run(device, ctx):
    """sched_hold: nothing is taken or published while held; released, the queue's
    packets end in order, their fence moving once per run, each packet timestamped."""
    q = ctx.queue(1)
    since = len(device.completions)
    device.sched.held = True
    try:
        w = q.submit(*[packet(Op.NOP)] * 10)
        device.step()
        device.step()
        assert (q.ring.taken, q.ring.fence, q.prod.completed) == (0, 0, 0)
    finally:
        device.sched.held = False
    device.step()
    assert q.ring.fence == q.prod.completed == w
    calls = _calls(device, q, since)  # one run, or one per TURN_NS on a loaded machine
    assert calls[-1] == (w, 0, None) and len(calls) <= w
    assert all(c[1:] == (0, None) for c in calls) and calls == sorted(calls)
    stamps = [q.prod.timestamp(s) for s in range(1, w + 1)]
    assert 0 < stamps[0] and stamps == sorted(stamps)
