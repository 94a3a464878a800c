"""Elementwise kernels against the host doing the same in this process (issue 14, item 2).

What a framework backend runs most: one pass over a tensor per operator. Each device
figure includes the launch and the synchronize; each baseline is numpy (or a numba
``njit`` loop for saxpy) on the same arrays in this process, timed in alternating blocks
in the same run:

* an in-place add ``x += y`` over 1 Mi and 16 Mi float32 (goal: at most 1.5x numpy's
  ``np.add(x, y, out=x)``);
* saxpy over 16 Mi float32 (goal: at most 1.1x the njit loop's time in every round;
  the row reports the rounds' min, median and max ratio).
"""

from __future__ import annotations

import statistics

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
        rows.append(_saxpy(env, runtime, lib, s, np, numba))
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
           numba: object) -> Row:
    """saxpy over 16 Mi float32 against an njit loop: the goal holds for every round."""
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

    njit_saxpy(a, x, y, out)
    dev()
    if not npy.allclose(dout.copy_to_host(), out):  # type: ignore[attr-defined]
        raise RuntimeError("device saxpy disagrees with njit")
    got = interleave({"device": dev, "njit": lambda: njit_saxpy(a, x, y, out)},
                     block=3, rounds=4 if env.quick else 10, warmup=1)
    ratios = round_ratios(got["device"], got["njit"])
    low, mid, high = min(ratios), statistics.median(ratios), max(ratios)
    return timed_row(f"saxpy {n >> 20} Mi float32 (SIMT kernel)", got["device"],
                     "numba njit loop, in process", got["njit"], goal=1.1,
                     note=f"rounds' ratios min {low:.2f} / median {mid:.2f} / max {high:.2f} "
                          f"(goal: max <= 1.1: {'met' if high <= 1.1 else 'NOT met'}); "
                          "includes launch and synchronize",
                     round_min=low, round_max=high)
