"""The benchmarks. Each is ``fn(env) -> list[Row]``; add one to ``BENCHMARKS`` to extend.

Every row's baseline is measured in the same run, interleaved with what it is compared to.
The baseline of the command path is the echo filesystem (``bench/echo_fs.py``): the same
pwrite + pread at a tag through a minimal pyfuse3 filesystem in another process, i.e. the
cost of a FUSE round trip with nothing behind it.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import statistics
from collections.abc import Callable

from abi import uapi
from bench.core import Benchmark, Env, Row, interleave, middle_half, timed_row
from bench.distributed import distributed
from bench.faults import fault_recovery
from bench.partitions import partition_isolation
from bench.first_use import first_use
from bench.floods import bystander_launches_under_floods, bystander_under_floods
from bench.elementwise import elementwise
from bench.kernels import kernels, tiny_launches
from bench.memory import allocator_and_copies, daemon_memory_per_context, managed_kernels
from bench.procs import AccelDaemon, EchoServer
from bench.sanitizer import sanitizer_overhead
from bench.submission import idle_cpu, submission
from bench.torch_backend import torch_backend
from bench.torch_compile import torch_compile

ECHO_TXN = "echo-fs pwrite+pread"


def command_round_trips(env: Env) -> list[Row]:
    """Device query (raw and through the runtime) and no-op submit+wait vs the echo floor.

    All four cases run interleaved in one measurement, so the three driver figures share one
    baseline. The raw device query and the echo transaction run the same client code (build
    header + struct, pwrite, pread the struct's size at the tag) with raw ``os`` calls, which
    are lighter than ``runtime._channel.Channel`` (no pid check, no ctypes round trip, no
    exception mapping): their ratio is the driver's cost alone.
    """
    from runtime.context import (
        Context,  # the runtime reads ACCEL_EMU_ROOT when it opens
    )

    cmd = uapi.ACCEL_CMD_DEVICE_QUERY
    payload = bytes(uapi.accel_device_info())
    size = ctypes.sizeof(uapi.accel_device_info)
    pack = uapi.CMD_HDR.pack
    tags = itertools.count(1)
    dev_fd = echo_fd = -1
    ctx = None
    try:
        dev_fd = os.open(env.accel.node(0), os.O_RDWR | os.O_CLOEXEC)
        echo_fd = os.open(env.echo.file, os.O_RDWR | os.O_CLOEXEC)
        with env.accel_root_env():
            ctx = Context("accel0")

        def device_query() -> bytes:
            tag = next(tags)
            os.pwrite(dev_fd, pack(cmd.code, 0, tag) + payload, 0)
            return os.pread(dev_fd, size, tag)

        def echo() -> bytes:
            tag = next(tags)
            os.pwrite(echo_fd, pack(cmd.code, 0, tag) + payload, tag)
            return os.pread(echo_fd, size, tag)

        query_via_runtime = ctx.query_device

        def noop_round_trip() -> None:
            ctx.submit_noop().wait()

        # The replies must be what they claim before their timing means anything.
        info = uapi.accel_device_info.from_buffer_copy(device_query())
        if info.index != 0 or info.state != uapi.DeviceState.OPERATIONAL:
            raise RuntimeError(f"unexpected DEVICE_QUERY reply: index {info.index}, "
                               f"state {info.state}")
        os.pwrite(echo_fd, b"check" + payload, 7)
        if os.pread(echo_fd, size, 7) != (b"check" + payload)[:size]:
            raise RuntimeError("echo fs did not echo the write")
        if query_via_runtime().index != 0:
            raise RuntimeError("runtime device query answered for the wrong device")

        s = env.sizes
        got = interleave({"echo": echo, "query": device_query, "runtime": query_via_runtime,
                          "noop": noop_round_trip},
                         block=s.block, rounds=s.rounds, warmup=s.warmup,
                         pin=env.pinned(env.accel, env.echo))
    finally:
        if ctx is not None:
            ctx.close()
        for fd in (dev_fd, echo_fd):
            if fd >= 0:
                os.close(fd)
    base = got["echo"]
    how = f"median per call over {s.rounds} interleaved rounds of {s.block} calls per case"
    return [
        timed_row("device-query round trip", got["query"], ECHO_TXN, base, goal=1.3,
                  note=f"raw os.pwrite+os.pread of header+accel_device_info on accel0; {how}",
                  client="raw os calls (same client code as the echo case)"),
        timed_row("device-query via runtime (Context.query_device)", got["runtime"],
                  ECHO_TXN, base, goal=None,
                  note="runtime._channel.Channel.call: the figure above plus the runtime's "
                       "own client cost"),
        timed_row("no-op submit+wait round trip (driver-mediated)", got["noop"], ECHO_TXN,
                  base, goal=None,
                  note="Context.submit_noop().wait(): SUBMIT_NOOP and WAIT transactions plus "
                       "the firmware doorbell/interrupt; the ratio is its cost in FUSE round "
                       "trips. The firmware processes are not pinned: rounds where one shares "
                       "the daemon's CPU (its post-activity spin then delays the daemon) take "
                       "about twice as long as rounds where it runs on the other CPU"),
    ]


def daemon_start(env: Env) -> list[Row]:
    """``accel-emud`` (2 devices) start to ready vs the echo fs process start to mount ready.

    Each sample starts a server on a fresh root and stops it again (stopping is not timed);
    accel daemon and echo fs alternate, which goes first alternating too.
    """
    n = env.sizes.starts
    accel_s: list[float] = []
    echo_s: list[float] = []

    def timed_start(new: Callable[[], AccelDaemon | EchoServer], out: list[float]
                    ) -> Callable[[bool], None]:
        def start(record: bool) -> None:
            server = new()
            try:
                t = server.start()
            finally:
                server.stop()
            if record:
                out.append(t)
        return start

    start_accel = timed_start(lambda: env.new_accel(devices=2), accel_s)
    start_echo = timed_start(env.new_echo, echo_s)

    if not env.quick:  # one untimed start each: warm the page cache and mint identities
        start_accel(False)
        start_echo(False)
    for i in range(n):
        pair = (start_accel, start_echo) if i % 2 == 0 else (start_echo, start_accel)
        for fn in pair:
            fn(True)
    ratios = [a / e for a, e in zip(accel_s, echo_s)]
    return [Row(
        "daemon start to ready (2 devices)", statistics.median(accel_s) * 1e3,
        "echo-fs process start to mount ready", statistics.median(echo_s) * 1e3, "ms", None,
        middle_half(ratios),
        note=f"median of {n} starts each; accel-emud's command returns once mounted and "
             "booted (launcher + daemon interpreters, 2 firmware boots)",
        details={"accel_s": accel_s, "echo_s": echo_s, "pair_ratios": ratios},
    )]


def _open_read_close(path: str) -> Callable[[], bytes]:
    """One attribute read the way a monitoring tool does it: open, read 4 KiB, close."""

    def read() -> bytes:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            return os.read(fd, 4096)
        finally:
            os.close(fd)

    return read


def sysfs_read(env: Env) -> list[Row]:
    """open + read + close of ``sys/class/accel/accel0/state`` vs the echo fs ``attr`` file."""
    read_state = _open_read_close(str(env.accel.attr(0, "state")))
    read_echo_attr = _open_read_close(str(env.echo.attr))

    if read_state() != b"operational\n":
        raise RuntimeError(f"accel0 state reads {read_state()!r}")
    s = env.sizes
    got = interleave({"echo": read_echo_attr, "state": read_state},
                     block=s.block, rounds=s.rounds, warmup=s.warmup,
                     pin=env.pinned(env.accel, env.echo))
    return [timed_row("sysfs attribute read (accel0/state)", got["state"],
                      "echo-fs open+read+close", got["echo"], goal=None,
                      note="os.open + os.read(4096) + os.close; median per call over "
                           f"{s.rounds} interleaved rounds of {s.block}")]


#: Run in this order. Later issues append (kernels, ...).
BENCHMARKS: list[tuple[str, Benchmark]] = [
    ("command_round_trips", command_round_trips),
    ("sysfs_read", sysfs_read),
    ("daemon_start", daemon_start),
    ("allocator_and_copies", allocator_and_copies),
    ("daemon_memory_per_context", daemon_memory_per_context),
    ("managed_kernels", managed_kernels),
    ("submission", submission),
    ("sanitizer_overhead", sanitizer_overhead),
    ("idle_cpu", idle_cpu),
    ("bystander_under_floods", bystander_under_floods),
    ("bystander_launches_under_floods", bystander_launches_under_floods),
    ("kernels", kernels),
    ("tiny_launches", tiny_launches),
    ("elementwise", elementwise),
    ("fault_recovery", fault_recovery),
    ("partition_isolation", partition_isolation),
    ("torch_backend", torch_backend),
    ("torch_compile", torch_compile),
    ("first_use", first_use),
    ("distributed", distributed),
]
