"""The c10d backend ``accl``: torch.distributed collectives on accel tensors.

``import torch_accel`` registers it (``install``) for the device types ``accel`` and
``cpu``, so ``init_process_group("accl")`` works, and ``init_process_group()`` with no
backend picks it where the accelerator is ``accel``, as cuda picks nccl.

The transport is gloo, which torch ships: the emulated devices have no network of their
own, and gloo already carries bytes between hosts. An all_reduce whose ranks are all on
this host goes through shared memory instead (:mod:`torch_accel.intrahost`). A collective
on accel tensors is three stages (docs/distributed.md, "The accl backend"):

1. *Staging*, on the calling thread: a communication stream per device waits for the
   current stream, copies each input into a pinned host buffer and records an event; then
   it waits, on the device, for the collective's ticket in the device's pinned release word
   (``Stream.wait_value64``) and copies the results back from the host buffers behind
   that. Everything the device does is queued here; the host waits for nothing.
2. *Transport*, on the group's issuing thread: it waits for the event, then hands the host
   buffers to gloo. One thread issues in call order, so every rank's gloo sees the same
   sequence of collectives.
3. *Return*, on the group's completing thread: it waits for gloo (watching the store for
   another rank's device fault meanwhile), then stores the ticket in the release word, so
   the queued copies back run, waits for them and completes the Work's future.

A synchronous collective (``async_op=False``) with nothing of the group queued runs all
three on the calling thread and the current stream instead (``_inline``).

``Work.wait()`` does not block the host, as NCCL's: it makes the current stream wait (on
the device) for the copies back, so later work there is ordered after the collective. A
collective that fails still stores its ticket, so no stream waits for it forever; its
error is the Work's (``wait()`` raises it once known, the future raises it, and the
group's next collective raises it). CPU tensors go to gloo as they are, and waiting for
their Work blocks the host, as gloo's.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d
from torch.futures import Future

import runtime
from torch_accel import _hooks, funcol
from torch_accel.intrahost import IntraHost
from torch_accel.ops._tensors import block_of

#: the backend's name, as ``init_process_group`` and ``dist.get_backend`` spell it
NAME = "accl"
#: how often a waiting collective looks in the store for another rank's fault (seconds)
FAULT_POLL_S = 0.2
_FAULTS = "accl/faults"
#: what gloo's Work.wait(timeout) raises when the timeout passes first
_GLOO_POLL_TIMEOUT = "Operation timed out!"
#: gloo groups left alone after a fault: destroying or aborting one with a collective still
#: waiting for the lost rank crashed the process at exit (SIGSEGV), so they live on
_ABANDONED: list[dist.ProcessGroupGloo] = []


class _PinnedPool:
    """Pinned host buffers by device and size, reused across collectives: pinning is a
    sealed memfd the copy engines map (3.3 ms for 4 KiB on this machine, against 1 us
    pageable), which would be most of a small collective's time. A few free buffers of
    each size are kept.

    A buffer may come back while a copy out of it is still queued (``give(..., stream,
    seqno)``: the synchronous path does not wait for its copy back to the device). It is
    handed out again at once to work on that same stream, which runs after that copy, and
    to work on any other stream only once the stream's fence passed the copy (no event per
    call: recording one is one more packet for the device to run)."""

    KEEP = 4

    def __init__(self) -> None:
        #: (device index, bytes) -> free buffers, each with the runtime stream and seqno
        #: of the last copy out of it still possibly queued (None, 0: none)
        self._free: dict[tuple[int, int],
                         list[tuple[torch.Tensor, runtime.Stream | None, int]]] = {}
        self._lock = threading.Lock()

    def take(self, like: torch.Tensor, dev: torch.device,
             stream: runtime.Stream | None = None) -> torch.Tensor:
        """A contiguous pinned CPU tensor of ``like``'s shape and dtype, pinned for device
        ``dev`` (a pinned allocation is mapped into its device's context only) and free
        for work queued on ``stream`` from now on."""
        nbytes = like.numel() * like.element_size()
        raw = None
        with self._lock:
            free = self._free.get((dev.index, nbytes), [])
            for i, (buf, on, seqno) in enumerate(free):
                if on is None or on is stream or on.completed >= seqno:
                    raw = free.pop(i)[0]
                    break
        if raw is None:
            with torch.accel.device(dev):
                raw = torch.empty(nbytes, dtype=torch.uint8, pin_memory=nbytes > 0)
        return raw.view(like.dtype).view(like.shape)

    def give(self, dev: torch.device, bufs: Sequence[torch.Tensor],
             stream: runtime.Stream | None = None, seqno: int = 0) -> None:
        """``bufs`` (pinned for ``dev``) back, free once ``stream`` completed ``seqno``."""
        with self._lock:
            for b in bufs:
                raw = b.view(-1).view(torch.uint8)
                free = self._free.setdefault((dev.index, raw.numel()), [])
                if raw.numel() and len(free) < self.KEEP:
                    free.append((raw, stream, seqno))


def _byte_views(t: torch.Tensor, h: torch.Tensor) -> tuple[Any, Any] | None:
    """An accel tensor's bytes and its pinned host buffer ``h``'s, as runtime arrays, for
    a staging copy straight through the runtime: torch's ``copy_`` dispatch costs several
    times the transfer's own submission, and on a loaded machine a small collective's time
    is its CPU time (docs/distributed.md, "Cost"). None when ``t`` is not contiguous (or
    holds nothing): then torch's copy, on the current stream."""
    nbytes = t.numel() * t.element_size()
    if not nbytes or not t.is_contiguous() or (pinned := _hooks.pinned_at(h.data_ptr())) is None:
        return None
    block, offset = block_of(t)
    return block.view(np.uint8, nbytes, offset), pinned[:nbytes]


def _stage_out(t: torch.Tensor, h: torch.Tensor, stream: runtime.Stream) -> None:
    """Queue the copy of accel tensor ``t`` into its pinned buffer ``h`` on ``stream``
    (torch's current one)."""
    if (views := _byte_views(t, h)) is None:
        h.copy_(t, non_blocking=True)
    else:
        views[0].copy_to_host(out=views[1], stream=stream)


def _stage_in(t: torch.Tensor, h: torch.Tensor, stream: runtime.Stream) -> None:
    """Queue the copy of pinned buffer ``h`` back into accel tensor ``t`` on ``stream``
    (torch's current one)."""
    if (views := _byte_views(t, h)) is None:
        t.copy_(h, non_blocking=True)
    else:
        views[0].copy_from_host(views[1], stream=stream)


def _record_text(rec: dict[str, Any]) -> str:
    """The driver's fault record behind a device error, as one line for every rank's
    message: what it was, how far it reached and what to do (docs/faults.md)."""
    where = f", link {rec['link']}" if rec.get("link") else ""
    return (f"fault record {rec.get('seq')}: {rec.get('code')} {rec.get('name')}, scope "
            f"{rec.get('scope')}, action {rec.get('action')}{where}")


def _sync(opts: Any) -> bool:
    """Whether the caller waits at once (``async_op=False``: torch sets ``opts.asyncOp``;
    C++ callers such as DDP's reducer leave it True)."""
    return getattr(opts, "asyncOp", True) is False


def _reduce_op(op: Any) -> Any:
    """The ``RedOpType`` behind a ``ReduceOp`` argument (options hold either)."""
    return getattr(op, "op", op)


@dataclass
class _Lane:
    """A device's communication stream and its release word: one u64 of pinned memory
    the device waits on (``Stream.wait_value64``) before each collective's copies back.
    Collectives of the device take tickets 1, 2, ... in call order; the completing thread,
    alone, stores each ticket once its results are in the host buffers (or it failed), in
    the same order, so the word only grows and releases exactly the collectives done."""

    stream: torch.Stream
    word: Any  # runtime.HostArray, one uint64
    issued: int = 0


@dataclass
class _Op:
    """One accel collective in flight: its host buffers, what gloo does with them, and where
    the results go on the device."""

    #: the accel device, or None for CPU tensors (gloo's own, queued only for the order)
    device: torch.device | None
    run: Callable[[], dist.Work | None]
    #: what the Work's future holds: the result tensors, on the device
    value: list[torch.Tensor]
    staged: torch.Event | None
    keep: list[torch.Tensor]
    finish: Callable[[], None] | None = None
    future: Future = field(default_factory=Future)
    gloo: dist.Work | None = None
    #: the pinned buffers, back to the pool when the op is over
    buffers: list[torch.Tensor] = field(default_factory=list)
    #: its device's lane and ticket there, and the event after its copies back (a queued
    #: accel collective; None for the others)
    lane: _Lane | None = None
    ticket: int = 0
    landed: torch.Event | None = None
    #: what failed it before the return stage (the issuing thread's), for that stage
    error: BaseException | None = None


class AcclWork(dist.Work):
    """A collective's handle (module docstring): ``wait()`` orders the current stream after
    the collective without blocking the host (NCCL's contract), or raises its error once
    known; the future completes once the results are on the device."""

    def __init__(self, op: _Op) -> None:
        super().__init__()
        self._op = op

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Queue, on the current stream, a wait for the collective's copies back; return
        at once. A collective that already failed raises its error here. CPU tensors' (and
        a completed synchronous one's) have no copies queued: their future is waited for.
        ``timeout`` is not applied: the group's own bounds the collective."""
        op = self._op
        if op.landed is None or op.future.done():
            op.future.wait()  # raises the collective's error
        if op.landed is not None:
            try:
                with torch.accel.device(op.device):
                    torch.accel.current_stream().wait_event(op.landed)
            except runtime.AccelError:
                # the device is lost: so is the collective, whose error (the group's
                # message, which every rank's log reads alike) is the one to raise
                op.future.wait()
                raise
        return True

    def is_completed(self) -> bool:
        return self._op.future.done()

    def get_future(self) -> Future:
        return self._op.future

    def synchronize(self) -> None:
        """NCCL's: the current stream waits for the collective (``wait``)."""
        self.wait()


class AcclProcessGroup(dist.ProcessGroup):
    """A process group whose collectives take accel tensors (and CPU ones, passed to gloo).

    torch calls its Python methods by their c10d names (``allreduce``, ``all_gather_single``,
    ...), and DDP's C++ reducer reaches ``allreduce`` through torch's ProcessGroup
    trampoline."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta) -> None:
        super().__init__(rank, size)
        # torchrun restarts a job's ranks against its agent's same store: keys of an earlier
        # attempt (gloo's addresses, a fault) would meet this one's, so they are per attempt
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self._store = dist.PrefixStore(f"accl/attempt{attempt}/", store)
        self._gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", self._store), rank, size,
                                           timeout=timeout)
        #: shared memory for all_reduce when every rank is on this host, else None (gloo)
        self._intra = IntraHost.join(dist.PrefixStore("intrahost/", self._store), rank, size,
                                     timeout.total_seconds())
        self._lanes: dict[int, _Lane] = {}
        #: how long a communication stream waits for a collective's release on the device
        #: before its wait faults (seconds): the group's timeout, which bounds the
        #: collective itself, within what WAIT_VALUE accepts
        self._release_timeout_s = min(max(timeout.total_seconds(), 1.0), 86_400.0)
        self._pool = _PinnedPool()
        #: each device's name in fault messages, taken while it still answers
        self._names: dict[int, str] = {}
        self._issue: queue.Queue[_Op | None] = queue.Queue()
        #: held while a collective is handed to gloo: by the issuing thread, and by a
        #: synchronous collective that runs on its caller's thread (``_inline``)
        self._issuing_lock = threading.Lock()
        self._complete: queue.Queue[_Op | None] = queue.Queue()
        self._fault: str | None = None
        self._threads: list[threading.Thread] = []
        self._group_name = self._group_desc = ""

    # --- identity ----------------------------------------------------------------------
    def getBackendName(self) -> str:  # noqa: N802 - the trampoline's C++ name
        return NAME

    def name(self) -> str:
        return NAME

    # torch sets and reads these through the trampoline; the C++ base keeps them on its
    # backends, which a Python group has none of ("ProcessGroup name not set", DeviceMesh)
    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._group_name = name

    def getGroupName(self) -> str:  # noqa: N802
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._group_desc = desc

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._group_desc

    # --- the three stages --------------------------------------------------------------
    def _lane(self, dev: torch.device) -> _Lane:
        """The device's communication stream and release word (made on first use)."""
        if dev.index not in self._lanes:
            self._name(dev)
            word = runtime.pinned_empty(1, np.uint64, device=dev.index)
            word[0] = 0
            self._lanes[dev.index] = _Lane(torch.accel.Stream(device=dev), word)
        return self._lanes[dev.index]

    def _name(self, dev: torch.device) -> str:
        """``dev`` and its UUID, as fault messages name it (the device's properties are
        read once: they still answer after the device is lost, from the runtime's copy)."""
        if dev.index not in self._names:
            try:
                uuid = torch.accel.get_device_properties(dev).uuid
                self._names[dev.index] = f"{dev} (uuid {uuid})"
            except Exception:  # noqa: BLE001 - a device gone before its first collective
                return str(dev)
        return self._names[dev.index]

    def _start_threads(self) -> None:
        if not self._threads:
            for target in (self._issuing, self._completing):
                t = threading.Thread(target=target, name=f"accl-{target.__name__[1:]}",
                                     daemon=True)
                t.start()
                self._threads.append(t)

    def _submit(self, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor],
                run: Callable[[list[torch.Tensor], list[torch.Tensor]], dist.Work | None],
                value: Sequence[torch.Tensor] | None = None,
                finish: Callable[[list[torch.Tensor]], None] | None = None,
                sync: bool = False) -> dist.Work:
        """Stage ``inputs`` to pinned host buffers on the communication stream and queue
        ``run(host_inputs, host_outputs)`` (gloo's call); ``outputs`` get their host
        buffers' contents back. An output that is also an input shares its buffer (the
        in-place collectives). ``finish(host_outputs)`` runs on the host after gloo.

        ``sync`` (the caller waits at once: ``async_op=False``, torch's ``opts.asyncOp``)
        runs the collective on the calling thread when nothing of the group is queued
        (``_inline``)."""
        self._raise_fault(look=False)
        tensors = [*inputs, *outputs]
        dev = tensors[0].device
        if any(t.device != dev for t in tensors):
            raise ValueError(f"accl: one collective's tensors must share a device, got "
                             f"{sorted({str(t.device) for t in tensors})}")
        if sync and self._issue.unfinished_tasks == 0:
            with self._issuing_lock:
                if self._issue.unfinished_tasks == 0:
                    return self._inline(dev, inputs, outputs, run, value, finish)
        try:
            lane = self._lane(dev)
            comm = lane.stream
            with torch.accel.device(dev):
                comm.wait_stream(torch.accel.current_stream())
                with torch.accel.stream(comm):
                    host = self._stage(dev, inputs, outputs, comm)
                    for t in tensors:
                        t.record_stream(comm)
                    staged = torch.Event(device=dev)
                    staged.record(comm)
                    # the copies back, queued now, run once the return stage releases them
                    ticket = lane.issued + 1
                    comm.runtime_stream.wait_value64(lane.word, 0, ticket,
                                                     timeout=self._release_timeout_s)
                    lane.issued = ticket
                    for t in outputs:
                        _stage_in(t, host[id(t)], comm.runtime_stream)
                    landed = torch.Event(device=dev)
                    landed.record(comm)
        except runtime.AccelError as exc:
            raise self._local_fault(dev, exc) from exc
        h_in = [host[id(t)] for t in inputs]
        h_out = [host[id(t)] for t in outputs]
        op = _Op(dev, lambda: run(h_in, h_out), list(value if value is not None else outputs),
                 staged, tensors,
                 (lambda: finish(h_out)) if finish else None, buffers=list(host.values()),
                 lane=lane, ticket=ticket, landed=landed)
        return self._queue(op)

    def _stage(self, dev: torch.device, inputs: Sequence[torch.Tensor],
               outputs: Sequence[torch.Tensor], stream: torch.Stream) -> dict[int, torch.Tensor]:
        """A pinned buffer of the pool for each distinct tensor (by id), free for
        ``stream``'s work, with the copies of the inputs into theirs queued on ``stream``
        (the current stream of ``dev``)."""
        rs = stream.runtime_stream
        host: dict[int, torch.Tensor] = {}
        for t in (*inputs, *outputs):
            if id(t) not in host:
                host[id(t)] = h = self._pool.take(t, dev, rs)
                if any(t is i for i in inputs):
                    _stage_out(t, h, rs)
        return host

    def _inline(self, dev: torch.device, inputs: Sequence[torch.Tensor],
                outputs: Sequence[torch.Tensor],
                run: Callable[[list[torch.Tensor], list[torch.Tensor]], dist.Work | None],
                value: Sequence[torch.Tensor] | None,
                finish: Callable[[list[torch.Tensor]], None] | None) -> AcclWork:
        """A synchronous collective on the calling thread and the current stream, with the
        issuing lock held (nothing else of the group is queued, so gloo sees it in call
        order): copy the inputs out and wait for them, run gloo and wait for it, queue the
        copies back on the current stream and return a completed Work. The host waits for
        the device here, but a synchronous caller waits anyway; what this saves is three
        thread hand-offs and the communication stream's waits (docs/distributed.md,
        "Cost")."""
        stream = torch.accel.current_stream(dev)
        try:
            host = self._stage(dev, inputs, outputs, stream)
            stream.synchronize()
        except runtime.AccelError as exc:
            raise self._local_fault(dev, exc) from exc
        h_out = [host[id(t)] for t in outputs]
        work = run([host[id(t)] for t in inputs], h_out)
        if work is not None:
            self._wait_gloo(work)
        if finish is not None:
            finish(h_out)
        rs = stream.runtime_stream
        try:
            for t, h in zip(outputs, h_out):
                _stage_in(t, h, rs)
        except runtime.AccelError as exc:
            raise self._local_fault(dev, exc) from exc
        self._pool.give(dev, list(host.values()), rs, rs.last_seqno)
        op = _Op(dev, lambda: None, list(value if value is not None else outputs), None, [])
        op.future.set_result(op.value)
        return AcclWork(op)

    def _queue(self, op: _Op) -> AcclWork:
        self._start_threads()
        self._issue.put(op)
        return AcclWork(op)

    def _host(self, run: Callable[[], dist.Work], tensors: Sequence[torch.Tensor],
              sync: bool = False) -> AcclWork:
        """gloo's own call on CPU tensors (or none, a barrier), queued behind this group's
        accel collectives: gloo matches collectives across ranks by the order they reach
        it, so every call goes through the one issuing thread, or runs on the caller's
        with the issuing lock held when ``sync`` and nothing is queued (as ``_inline``)."""
        self._raise_fault(look=False)
        op = _Op(None, run, list(tensors), None, [])
        if sync and self._issue.unfinished_tasks == 0:
            with self._issuing_lock:
                if self._issue.unfinished_tasks == 0:
                    self._wait_gloo(run())
                    op.future.set_result(op.value)
                    return AcclWork(op)
        return self._queue(op)

    def _issuing(self) -> None:
        """Stage 2: in call order, wait for each op's staging and start its gloo call. An
        op that fails here still goes on to stage 3, which alone releases the device's
        copies back, in order (``_Lane``)."""
        while (op := self._issue.get()) is not None:
            with self._issuing_lock:
                try:
                    if op.staged is not None:
                        op.staged.synchronize()
                    op.gloo = op.run()
                except BaseException as exc:  # noqa: BLE001 - it belongs to the op's future
                    op.error = exc
                finally:
                    self._issue.task_done()
            self._complete.put(op)

    def _completing(self) -> None:
        """Stage 3: wait for gloo, release the copies back queued on the device, wait for
        them, complete the future. A failed op is released too (what its copies back
        bring is undefined, as a failed NCCL collective's output): a stream waiting for
        it must not wait out its timeout."""
        while (op := self._complete.get()) is not None:
            try:
                if op.error is not None:
                    raise op.error
                if op.gloo is not None:
                    self._wait_gloo(op.gloo)
                if op.finish is not None:
                    op.finish()
                self._release(op)
                if op.landed is not None:
                    op.landed.synchronize()  # the future's value is on the device
            except BaseException as exc:  # noqa: BLE001 - it belongs to the op's future
                self._release(op)
                op.future.set_exception(self._failure(op, exc))
                continue
            if op.device is not None:
                self._pool.give(op.device, op.buffers)
            op.keep.clear()
            op.future.set_result(op.value)

    @staticmethod
    def _release(op: _Op) -> None:
        """Let the device run ``op``'s copies back: its ticket into the release word, one
        aligned store the device's wait sees (stage 3's thread only, in ticket order)."""
        if op.lane is not None and op.lane.word[0] < op.ticket:
            op.lane.word[0] = op.ticket

    def _wait_gloo(self, work: dist.Work) -> None:
        """Wait for gloo's part, looking in the store for another rank's device fault every
        FAULT_POLL_S: a rank that lost its device never joins, and waiting for gloo's
        timeout would hang every other rank for the group's whole timeout.

        gloo's ``wait(timeout)`` raises "Operation timed out!" and leaves the collective
        running, so it serves as the poll. (A Python callback on the work's future would do
        without polling, but gloo calls it when the lost rank's connection closes, which
        can be while the interpreter exits: that crashed the process, SIGSEGV.)"""
        poll = timedelta(seconds=FAULT_POLL_S)
        while True:
            try:
                work.wait(poll)
                return
            except RuntimeError as exc:
                if str(exc) != _GLOO_POLL_TIMEOUT:
                    # gloo's own error: a peer gone, the group's timeout. A peer that lost
                    # its device published that before it exited and closed its connection:
                    # that is the cause to raise, not the closed connection
                    self._raise_fault()
                    raise
            self._raise_fault()

    # --- faults ------------------------------------------------------------------------
    def _local_fault(self, dev: torch.device, exc: BaseException) -> RuntimeError:
        """This rank's device failed: tell the other ranks through the store, and make this
        group's later collectives raise it too."""
        msg = f"accl: rank {self.rank()} lost its device {self._name(dev)}: {exc}"
        if rec := getattr(exc, "record", None):
            msg += f"; {_record_text(rec)}"
        if self._fault is None:
            self._fault = msg
            try:
                self._store.set(f"accl/fault/{self.rank()}", msg)
                self._store.add(_FAULTS, 1)
            except Exception:  # noqa: BLE001 - the store gone too: gloo reports the peer
                pass
        return RuntimeError(msg)

    def _raise_fault(self, look: bool = True) -> None:
        """Raise the first device fault any rank of the group published; ``look=False``
        only if this rank already knows one (no store round trip: a collective issued after
        another rank's fault meets it in its wait for gloo, within FAULT_POLL_S)."""
        if look and self._fault is None and self._store.add(_FAULTS, 0) > 0:
            for r in range(self.size()):
                key = f"accl/fault/{r}"
                if self._store.check([key]):
                    self._fault = self._store.get(key).decode()
                    break
        if self._fault is not None:
            raise RuntimeError(f"{self._fault} (seen by rank {self.rank()}; the group "
                               f"cannot run collectives any more)")

    def _failure(self, op: _Op, exc: BaseException) -> BaseException:
        if isinstance(exc, runtime.AccelError) and op.device is not None:
            return self._local_fault(op.device, exc)
        return exc

    # --- dispatch ----------------------------------------------------------------------
    @staticmethod
    def _on_accel(tensors: Sequence[torch.Tensor]) -> bool:
        kinds = {t.device.type for t in tensors}
        if len(kinds) > 1:
            raise ValueError(f"accl: a collective's tensors must all be on one device type, "
                             f"got {sorted(kinds)}")
        return kinds == {"accel"}

    def _host_reduce(self, op: Any) -> tuple[Any, Callable[[list[torch.Tensor]], None] | None]:
        """gloo's reduce op for ``op``, and the host step that completes it: gloo has no
        AVG, so AVG is SUM then a division (truncating for integers, as NCCL's)."""
        kind = _reduce_op(op)
        if kind == dist.ReduceOp.AVG:
            def average(outs: list[torch.Tensor]) -> None:
                for h in outs:
                    if h.is_floating_point() or h.is_complex():
                        h.div_(self.size())
                    else:
                        h.div_(self.size(), rounding_mode="trunc")
            return dist.ReduceOp.SUM, average
        if kind not in (dist.ReduceOp.SUM, dist.ReduceOp.PRODUCT, dist.ReduceOp.MIN,
                        dist.ReduceOp.MAX, dist.ReduceOp.BAND, dist.ReduceOp.BOR,
                        dist.ReduceOp.BXOR):
            raise ValueError(f"accl: reduce op {kind} is not supported")
        return kind, None

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        opts = opts or dist.AllreduceOptions()
        if not self._on_accel(tensors):
            return self._host(lambda: self._gloo.allreduce(tensors, opts), tensors,
                              sync=_sync(opts))
        gop, finish = self._host_reduce(opts.reduceOp)

        def run(h: list[torch.Tensor], _: list[torch.Tensor]) -> dist.Work | None:
            if self._intra is not None and self._intra.takes(h, gop):
                self._intra.allreduce(h, gop, self._raise_fault)
                return None
            o = dist.AllreduceOptions()
            o.reduceOp = gop
            return self._gloo.allreduce(h, o)
        return self._submit(tensors, tensors, run, finish=finish, sync=_sync(opts))

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        opts = opts or dist.BroadcastOptions()
        if not self._on_accel(tensors):
            return self._host(lambda: self._gloo.broadcast(tensors, opts), tensors,
                              sync=_sync(opts))
        return self._submit(tensors, tensors, lambda h, _: self._gloo.broadcast(h, opts),
                            sync=_sync(opts))

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        opts = opts or dist.ReduceOptions()
        if not self._on_accel(tensors):
            return self._host(lambda: self._gloo.reduce(tensors, opts), tensors, sync=_sync(opts))
        gop, finish = self._host_reduce(opts.reduceOp)
        root = opts.rootRank

        def run(h: list[torch.Tensor], _: list[torch.Tensor]) -> dist.Work:
            o = dist.ReduceOptions()
            o.reduceOp, o.rootRank, o.rootTensor = gop, root, opts.rootTensor
            return self._gloo.reduce(h, o)
        # only the root's tensor changes, as with NCCL and gloo
        return self._submit(tensors, tensors if self.rank() == root else [], run,
                            value=tensors, finish=finish if self.rank() == root else None,
                            sync=_sync(opts))

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                  opts: Any = None) -> dist.Work:
        opts = opts or c10d.AllgatherOptions()
        if not self._on_accel([*inputs, *outputs[0]]):
            return self._host(lambda: self._gloo.allgather(outputs, inputs, opts),
                              outputs[0], sync=_sync(opts))
        return self._submit(inputs, outputs[0],
                            lambda hi, ho: self._gloo.allgather([ho], hi, opts),
                            value=outputs[0], sync=_sync(opts))

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,  # noqa: A002
                          opts: Any = None) -> dist.Work:
        opts = opts or c10d.AllgatherOptions()
        if not self._on_accel([output, input]):
            return self._host(lambda: self._gloo._allgather_base(output, input, opts), [output],
                              sync=_sync(opts))
        return self._submit([input], [output],
                            lambda hi, ho: self._gloo._allgather_base(ho[0], hi[0], opts),
                            sync=_sync(opts))

    _allgather_base = all_gather_single

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,  # noqa: A002
                              opts: Any = None) -> dist.Work:
        opts = opts or dist.ReduceScatterOptions()
        if not self._on_accel([output, input]):
            return self._host(lambda: self._gloo._reduce_scatter_base(output, input, opts),
                              [output], sync=_sync(opts))
        gop, finish = self._host_reduce(opts.reduceOp)

        def run(hi: list[torch.Tensor], ho: list[torch.Tensor]) -> dist.Work:
            o = dist.ReduceScatterOptions()
            o.reduceOp = gop
            return self._gloo._reduce_scatter_base(ho[0], hi[0], o)
        return self._submit([input], [output], run, finish=finish, sync=_sync(opts))

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]],
                       opts: Any = None) -> dist.Work:
        opts = opts or dist.ReduceScatterOptions()
        if not self._on_accel([*outputs, *inputs[0]]):
            return self._host(lambda: self._gloo.reduce_scatter(outputs, inputs, opts), outputs,
                              sync=_sync(opts))
        gop, finish = self._host_reduce(opts.reduceOp)

        def run(hi: list[torch.Tensor], ho: list[torch.Tensor]) -> dist.Work:
            o = dist.ReduceScatterOptions()
            o.reduceOp = gop
            return self._gloo.reduce_scatter(ho, [hi], o)
        return self._submit(inputs[0], outputs, run, finish=finish, sync=_sync(opts))

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,  # noqa: A002
                          output_splits: list[int], input_splits: list[int],
                          opts: Any = None) -> dist.Work:
        opts = opts or dist.AllToAllOptions()
        if not self._on_accel([output, input]):
            return self._host(lambda: self._gloo.alltoall_base(
                output, input, output_splits, input_splits, opts), [output], sync=_sync(opts))
        return self._submit([input], [output], lambda hi, ho: self._gloo.alltoall_base(
            ho[0], hi[0], output_splits, input_splits, opts), sync=_sync(opts))

    alltoall_base = all_to_all_single

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                 opts: Any = None) -> dist.Work:
        opts = opts or dist.AllToAllOptions()
        if not self._on_accel([*outputs, *inputs]):
            return self._host(lambda: self._gloo.alltoall(outputs, inputs, opts), outputs,
                              sync=_sync(opts))
        return self._submit(inputs, outputs, lambda hi, ho: self._gloo.alltoall(ho, hi, opts),
                            sync=_sync(opts))

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor],
               opts: Any = None) -> dist.Work:
        opts = opts or dist.GatherOptions()
        outs = outputs[0] if outputs else []
        if not self._on_accel([*inputs, *outs]):
            return self._host(lambda: self._gloo.gather(outputs, inputs, opts), outs,
                              sync=_sync(opts))
        return self._submit(inputs, outs, lambda hi, ho: self._gloo.gather(
            [ho] if ho else [], hi, opts), value=outs, sync=_sync(opts))

    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]],
                opts: Any = None) -> dist.Work:
        opts = opts or dist.ScatterOptions()
        ins = inputs[0] if inputs else []
        if not self._on_accel([*outputs, *ins]):
            return self._host(lambda: self._gloo.scatter(outputs, inputs, opts), outputs,
                              sync=_sync(opts))
        return self._submit(ins, outputs, lambda hi, ho: self._gloo.scatter(
            ho, [hi] if hi else [], opts), sync=_sync(opts))

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> dist.Work:
        if not self._on_accel(tensors):
            return self._host(lambda: self._gloo.send(tensors, dst, tag), tensors)
        return self._submit(tensors, [], lambda h, _: self._gloo.send(h, dst, tag),
                            value=tensors)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> dist.Work:
        if not self._on_accel(tensors):
            return self._host(lambda: self._gloo.recv(tensors, src, tag), tensors)
        return self._submit([], tensors, lambda _, h: self._gloo.recv(h, src, tag))

    def barrier(self, opts: Any = None) -> dist.Work:
        """gloo's barrier, behind this group's earlier collectives."""
        opts = opts or dist.BarrierOptions()
        return self._host(lambda: self._gloo.barrier(opts), [], sync=_sync(opts))

    def monitored_barrier(self, opts: Any = None, wait_all_ranks: bool = False) -> None:
        return self._gloo.monitored_barrier(opts or dist.BarrierOptions(), wait_all_ranks)

    def shutdown(self) -> None:
        """Stop the threads (after their queued work) and gloo; after a fault, abort gloo
        instead (its collective with the lost rank never completes)."""
        if self._intra is not None:
            self._intra.close()
        if self._fault is not None:
            _ABANDONED.append(self._gloo)
            return
        if self._threads:
            self._issue.put(None)
            self._threads[0].join()
            self._complete.put(None)
            self._threads[1].join()
            self._threads.clear()
        self._gloo.shutdown()

    def abort(self) -> None:
        self._gloo.abort()


def _create(opts: Any, backend_options: Any = None) -> AcclProcessGroup:
    """``register_backend``'s creator (the extended API: ``opts`` is torch's
    ``_DistributedBackendOptions``)."""
    return AcclProcessGroup(opts.store, opts.group_rank, opts.group_size, opts.timeout)


def install() -> None:
    """Register ``accl`` with torch.distributed for accel (and CPU) tensors."""
    if dist.is_available() and NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(NAME, _create, extended_api=True,
                                      devices=["accel", "cpu"])
        funcol.install()


__all__ = ["NAME", "AcclProcessGroup", "AcclWork", "install"]
