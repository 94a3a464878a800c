"""Memory benchmarks (bring-up 2): caching allocator, copy bandwidth, per-context cost.

Each figure is compared with a baseline measured in the same run, interleaved:
* cached allocate+free through the runtime vs an uncached driver allocation (MEM_ALLOC +
  MEM_FREE transactions), the cost the cache exists to avoid;
* host-to-device and device-to-host copies, from pinned and from pageable memory, vs numpy
  copying the same bytes between two host arrays (the memory-bandwidth ceiling here);
* the daemon's and firmware's resident memory per context vs the echo filesystem's per
  open file.
Times are per operation, so "ratio <= 1.43" is "at least 0.7x numpy's bandwidth".
"""

from __future__ import annotations

import os
import time

from abi import uapi
from bench.core import Env, Row, Samples, interleave, middle_half, timed_row

COPY_BYTES = 64 << 20
QUICK_COPY_BYTES = 16 << 20


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def allocator_and_copies(env: Env) -> list[Row]:
    """The caching allocator against the driver's allocate+free, and copies against memcpy.

    The allocator's worth is the driver round trips it saves, so its baseline is the
    uncached MEM_ALLOC+MEM_FREE pair of the same size on the same context."""
    import numpy as np

    with env.accel_root_env():
        import runtime

        runtime.init()
        ctx = runtime.primary_context(0)
        s = env.sizes

        def cached() -> None:
            a = runtime.empty(1024, np.float32)
            del a

        def uncached() -> None:
            r = ctx.channel.call(uapi.ACCEL_CMD_MEM_ALLOC, uapi.accel_mem_alloc(
                ctx_id=ctx.id, size=4096, kind=uapi.MemKind.DEVICE, fd=-1))
            ctx.channel.call(uapi.ACCEL_CMD_MEM_FREE,
                             uapi.accel_mem_free(ctx_id=ctx.id, handle=r.handle))

        got = interleave({"uncached": uncached, "cached": cached}, block=s.block,
                         rounds=s.rounds, warmup=s.warmup, pin=env.pinned(env.accel))
        cached_us = got["cached"].median_us
        rows = [timed_row(
            "cached allocate+free (runtime.empty, 4 KiB)", got["cached"],
            "uncached driver MEM_ALLOC+MEM_FREE", got["uncached"], goal=None,
            note=f"goal: at most 5 us absolute; measured {cached_us:.2f} us "
                 f"({'met' if cached_us <= 5 else 'NOT met'}); includes the DeviceArray object")]

        n = QUICK_COPY_BYTES if env.quick else COPY_BYTES
        rng = np.random.default_rng(0)
        src = rng.integers(0, 255, n, dtype=np.uint8)
        dst = np.empty(n, np.uint8)
        pin_in = runtime.pinned_empty(n, np.uint8)
        pin_in[:] = src
        pin_out = runtime.pinned_empty(n, np.uint8)
        dev = runtime.empty(n, np.uint8)
        stream = runtime.Stream()

        def numpy_copy() -> None:
            np.copyto(dst, src)

        def h2d_pinned() -> None:
            dev.copy_from_host(pin_in, stream=stream)
            stream.synchronize()

        def d2h_pinned() -> None:
            dev.copy_to_host(pin_out, stream=stream)
            stream.synchronize()

        def h2d_pageable() -> None:
            dev.copy_from_host(src, stream=stream)
            stream.synchronize()

        def d2h_pageable() -> None:
            dev.copy_to_host(dst, stream=stream)

        h2d_pinned()
        d2h_pinned()
        if not np.array_equal(pin_out, src):
            raise RuntimeError("pinned round trip corrupted the data")
        block, rounds = (3, 4) if env.quick else (5, 8)
        bw = interleave({"numpy": numpy_copy, "h2d_pinned": h2d_pinned,
                         "d2h_pinned": d2h_pinned, "h2d_pageable": h2d_pageable,
                         "d2h_pageable": d2h_pageable},
                        block=block, rounds=rounds, warmup=1)
        base = bw["numpy"]
        gbps = lambda smp: n / (smp.median_us * 1e3)  # noqa: E731 - bytes per ns = GB/s
        label = f"{n >> 20} MiB"
        for key, name, goal in (("h2d_pinned", "host-to-device copy, pinned", 1 / 0.7),
                                ("d2h_pinned", "device-to-host copy, pinned", 1 / 0.7),
                                ("h2d_pageable", "host-to-device copy, pageable (staged)", None),
                                ("d2h_pageable", "device-to-host copy, pageable (staged)", None)):
            rows.append(timed_row(
                f"{name} ({label})", bw[key], f"numpy copy of {label}", base, goal=goal,
                note=f"{gbps(bw[key]):.1f} GB/s vs numpy {gbps(base):.1f} GB/s; time ratio "
                     "<= 1.43 means at least 0.7x numpy's bandwidth; includes submit and "
                     "synchronize"))
        del dev, pin_in, pin_out
        runtime.empty_cache()
    return rows


def daemon_memory_per_context(env: Env) -> list[Row]:
    """Resident memory the daemon and its firmware spend per context (peak, 16 open: one
    process's share of contexts, less those this process already holds on the device)."""
    accel = env.accel
    share = int(accel.root.joinpath(
        "sys/class/accel/accel0/limits/max_contexts_per_process").read_text())
    fw_pids = [int(accel.root.joinpath(f"sys/kernel/debug/accel/accel{i}/fw_pid").read_text())
               for i in range(accel.devices)]
    pids = [p for p in [accel.pid, *fw_pids] if p is not None]
    echo_pid = env.echo.proc.pid if env.echo.proc else None

    def total(ps: list[int]) -> int:
        return sum(_rss_kib(p) for p in ps)

    before = total(pids)
    with env.accel_root_env():
        from runtime.context import Context

        held = sum(c.physical == "accel0" for c in Context.live)  # earlier benchmarks'
        count = min(8 if env.quick else 16, share - held)
        contexts: list[Context] = []
        try:
            contexts += (Context("accel0") for _ in range(count))
            after = total(pids)
        finally:
            for ctx in contexts:
                ctx.close()
    echo_before = _rss_kib(echo_pid) if echo_pid else 0
    efds = [os.open(env.echo.file, os.O_RDWR | os.O_CLOEXEC) for _ in range(count)]
    echo_after = _rss_kib(echo_pid) if echo_pid else 0
    for fd in efds:
        os.close(fd)
    per_ctx = (after - before) / count
    per_open = max(echo_after - echo_before, 1) / count
    return [Row("daemon+firmware resident memory per context", per_ctx,
                "echo-fs resident memory per open file", per_open, "KiB", None,
                middle_half([per_ctx / per_open]),
                note=f"VmRSS growth over {count} contexts (each with its default queue and "
                     f"firmware queue thread); daemon {accel.pid}, firmware {fw_pids}",
                details={"before_kib": before, "after_kib": after,
                         "echo_before_kib": echo_before, "echo_after_kib": echo_after})]



MANAGED_KERNEL_BYTES = 64 << 20
QUICK_MANAGED_KERNEL_BYTES = 16 << 20


def managed_kernels(env: Env) -> list[Row]:
    """A kernel over managed memory whose pages are on the host (first touch: each page
    faults and migrates, firmware/managed.py) against the same launch right after, its
    pages resident: what migration adds to a launch; and that resident launch against the
    same kernel on device memory: what the managed variant's page marking costs. Each
    round sends the pages back to the host first (an untimed PREFETCH), then times the
    launches in that order (the order is the point), so every case sees the same machine
    state round by round."""
    import numpy as np

    with env.accel_root_env():
        import runtime
        from runtime import kernel_lib

        runtime.init()
        lib = runtime.compile(kernel_lib.SOURCE)
        n = QUICK_MANAGED_KERNEL_BYTES if env.quick else MANAGED_KERNEL_BYTES
        x = runtime.managed_empty(n // 4, np.float32)
        x[:] = 0
        dev = runtime.empty(n // 4, np.float32)
        stream = runtime.Stream()
        faults = env.accel.root / "sys/class/accel/accel0/managed_faults"
        grid = n // 4 // 256

        def launch(value: float, out: object = x) -> int:
            t0 = time.perf_counter_ns()
            lib.fill[grid, 256](out, value, stream=stream)
            stream.synchronize()
            return time.perf_counter_ns() - t0

        launch(1.0)  # compiles the managed variant
        launch(1.0, dev)  # and the plain one
        first, resident = Samples("first touch"), Samples("resident")
        device = Samples("device memory")
        migrated = []
        for r in range(6 if env.quick else 12):
            x.prefetch(to_device=False, stream=stream)
            before = int(faults.read_text())
            first.ns.append(launch(float(r)))
            resident.ns.append(launch(float(r) + 0.5))
            migrated.append(int(faults.read_text()) - before)
            device.ns.append(launch(float(r), dev))
        if not (x == r + 0.5).all():
            raise RuntimeError("the kernel's writes to managed memory are wrong on the host")
        for smp in (first, resident, device):
            smp.block_medians = list(smp.ns)
        pages = n >> 16
        del x, dev
        runtime.empty_cache()
    return [timed_row(
        f"kernel over managed memory, first touch (fill, {n >> 20} MiB)", first,
        "same, pages resident", resident, goal=None,
        note=f"{pages} pages fault and migrate per first-touch launch (managed_faults "
             f"grew by {sorted(set(migrated))} per round, read a moment after each; the "
             "firmware publishes its counters when it idles); launch + synchronize",
        pages=pages, faults_per_round=migrated), timed_row(
        f"kernel over managed memory, resident (fill, {n >> 20} MiB)", resident,
        "same kernel over device memory", device, goal=None,
        note="the managed variant marks each block's pages and the engine reads the page "
             "map after each slice; launch + synchronize")]
