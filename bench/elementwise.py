"""Elementwise kernels against the host doing the same in this process (issue 14, item 2).

What a framework backend runs most: one pass over a tensor per operator. Each device
figure includes the launch and the synchronize; each baseline is numpy (or a numba
``njit`` loop for saxpy) on the same arrays in this process, timed in alternating blocks
in the same run:

* an in-place add ``x += y`` over 1 Mi and 16 Mi float32 (goal: at most 1.5x numpy's
  ``np.add(x, y, out=x)``);
* saxpy over 16 Mi float32 (goal: at most 1.1x the njit loop's time in every run; the
  row reports the rounds' min, median and max ratio). Two more rows say how much of that
  figure is the machine: the same compiled kernel run in this process by two threads
  over memory mapped as the device's is (a memfd: 4 KiB pages, where numpy's arrays get
  2 MiB ones), with no daemon, no rings and no hand-off, against njit -- the figure two
  engines could reach on this machine -- and the device against it, the emulator's own
  cost. On this VM the first moves with the machine's state between about 0.68x and
  1.0x from run to run, and the device row moves with it (docs/kernels-log.md, "Eighth
  round").
"""

from __future__ import annotations

import mmap
import os
import statistics
import threading
from collections.abc import Callable

from bench.core import Env, Row, interleave, round_ratios, timed_row

#: the in-place add in the device language: one thread per element
ADD_SOURCE = '''
def add_inplace(x, y):
    i = global_id(0)
    if i < x.size:
        x[i] += y[i]
'''


def elementwise(env: Env) -> list[Row]:
    """In-place add (1 Mi, 16 Mi) against numpy and saxpy against njit, same run."""
    import numba
    import numpy as np

    rows: list[Row] = []
    with env.accel_root_env():
        import runtime
        from runtime import kernel_lib

        runtime.init()
        lib = runtime.compile(kernel_lib.SOURCE + ADD_SOURCE)
        s = runtime.Stream()
        sizes = (1 << 20, (4 << 20) if env.quick else (16 << 20))
        rows += [_add(env, runtime, lib, s, np, n) for n in sizes]
        runtime.empty_cache()  # the 16 Mi arrays are gone: room for saxpy's three
        rows += _saxpy(env, runtime, lib, s, np, numba)
    return rows


def _add(env: Env, runtime: object, lib: object, s: object, np: object, n: int) -> Row:
    """``x += y`` over ``n`` float32 on the device against numpy's in place."""
    npy, rt = np, runtime
    rng = npy.random.default_rng(0)  # type: ignore[attr-defined]
    x, y = rng.random(n, dtype=npy.float32), rng.random(n, dtype=npy.float32)  # type: ignore[attr-defined]
    dx, dy = rt.to_device(x, stream=s), rt.to_device(y, stream=s)  # type: ignore[attr-defined]

    def dev_add() -> None:
        lib.add_inplace[n // 256, 256](dx, dy, stream=s)  # type: ignore[attr-defined]
        s.synchronize()  # type: ignore[attr-defined]

    def host_add() -> None:
        npy.add(x, y, out=x)  # type: ignore[attr-defined]

    dev_add()
    host_add()
    if not npy.array_equal(dx.copy_to_host(), x):  # type: ignore[attr-defined]
        raise RuntimeError("the device's in-place add disagrees with numpy's")
    big = n > 1 << 20
    got = interleave({"device": dev_add, "numpy": host_add}, block=5 if big else 40,
                     rounds=4 if env.quick else 8, warmup=2)
    return timed_row(f"in-place add, {n >> 20} Mi float32", got["device"],
                     "numpy np.add(x, y, out=x), in process", got["numpy"], goal=1.5,
                     note="includes launch and synchronize")


def _saxpy(env: Env, runtime: object, lib: object, s: object, np: object,
           numba: object) -> list[Row]:
    """saxpy over 16 Mi float32 against an njit loop, and the same kernel on two threads
    in this process (:func:`_two_engine_floor`) against both."""
    npy, rt = np, runtime
    n = (4 << 20) if env.quick else (16 << 20)
    rng = npy.random.default_rng(1)  # type: ignore[attr-defined]
    x, y = rng.random(n, dtype=npy.float32), rng.random(n, dtype=npy.float32)  # type: ignore[attr-defined]
    dx, dy = rt.to_device(x, stream=s), rt.to_device(y, stream=s)  # type: ignore[attr-defined]
    dout = rt.empty(n, npy.float32)  # type: ignore[attr-defined]
    out = npy.empty_like(x)  # type: ignore[attr-defined]
    a = npy.float32(2.0)  # type: ignore[attr-defined]

    @numba.njit(nogil=True)  # type: ignore[attr-defined,misc]
    def njit_saxpy(a, xs, ys, out):  # type: ignore[no-untyped-def]
        for i in range(xs.size):
            out[i] = a * xs[i] + ys[i]

    def dev() -> None:
        lib.saxpy[n // 256, 256](a, dx, dy, dout, stream=s)  # type: ignore[attr-defined]
        s.synchronize()  # type: ignore[attr-defined]

    floor, floor_out = _two_engine_floor(env, a, x, y)
    njit_saxpy(a, x, y, out)
    dev()
    floor()
    if not (npy.allclose(dout.copy_to_host(), out) and npy.array_equal(floor_out, out)):  # type: ignore[attr-defined]
        raise RuntimeError("device saxpy or the in-process kernel disagrees with njit")
    got = interleave({"device": dev, "njit": lambda: njit_saxpy(a, x, y, out),
                      "floor": floor},
                     block=3, rounds=4 if env.quick else 10, warmup=1)
    ratios = round_ratios(got["device"], got["njit"])
    low, mid, high = min(ratios), statistics.median(ratios), max(ratios)
    floor_ratios = round_ratios(got["floor"], got["njit"])
    mi = n >> 20
    return [
        timed_row(f"saxpy {mi} Mi float32 (SIMT kernel)", got["device"],
                  "numba njit loop, in process", got["njit"], goal=1.1,
                  note=f"rounds' ratios min {low:.2f} / median {mid:.2f} / max {high:.2f} "
                       f"({sum(r > 1.1 for r in ratios)} of {len(ratios)} rounds above 1.1); "
                       "includes launch and synchronize",
                  round_min=low, round_max=high),
        timed_row(f"saxpy {mi} Mi: the kernel on two threads in process, no device",
                  got["floor"], "numba njit loop, in process", got["njit"], goal=None,
                  note=f"rounds' ratios min {min(floor_ratios):.2f} / max "
                       f"{max(floor_ratios):.2f}: what two engines can reach here, the "
                       "machine's part of the row above",
                  round_min=min(floor_ratios), round_max=max(floor_ratios)),
        timed_row(f"saxpy {mi} Mi: device against the kernel on two threads", got["device"],
                  "the same kernel on two threads in process", got["floor"], goal=None,
                  note="the emulator's own cost: doorbell, dispatch, engine wake-ups, "
                       "completion, synchronize"),
    ]


def _two_engine_floor(env: Env, a: object, x: object, y: object
                      ) -> tuple[Callable[[], None], object]:
    """The device's saxpy as its engines run it, with nothing around it: the kernel
    compiled by the firmware's JIT (the same lowering and numba options), its blocks
    split in halves between this thread and one more, over copies of ``x`` and ``y`` in a
    memfd mapping like the device memory's (4 KiB pages: those cost a single thread 8-11%
    on this VM against numpy's 2 MiB ones). Returns the call and its output array."""
    import numpy as np

    from firmware.jit import KernelCache, Options
    from runtime import kernel_lib, kernels

    n, nbytes = x.size, x.nbytes  # type: ignore[attr-defined]
    ir = kernels.compile_module(kernel_lib.SOURCE)["kernels"]["saxpy"]
    kernel = KernelCache(env.workdir / "floor-jit").get(
        ir, ("float32", "float32[1d]", "float32[1d]", "float32[1d]"), Options())
    fd = os.memfd_create("saxpy-floor", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, 3 * nbytes)
        mem = mmap.mmap(fd, 3 * nbytes)
    finally:
        os.close(fd)
    buf = np.frombuffer(mem, np.float32)
    fx, fy, fout = buf[:n], buf[n:2 * n], buf[2 * n:]
    fx[:], fy[:] = x, y
    blocks = n // 256
    abort = np.zeros(1, np.int64)
    args = [a, fx, fy, fout]

    def half(lo: int, hi: int) -> None:
        kernel.run(lo, hi, (blocks, 1, 1), (256, 1, 1), args, abort)

    def floor() -> None:
        other = threading.Thread(target=half, args=(blocks // 2, blocks))
        other.start()
        half(0, blocks // 2)
        other.join()

    return floor, fout
