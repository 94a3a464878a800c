"""Vectorised phases of the kernel lowering (firmware/lower/passes/vectorise.py,
"Vectorised phases" in docs/kernels.md): which phases take the block-wide form, and that
every observable -- results, barriers, returns, faults, aborts, atomics -- is what the
per-thread form gives.

Compiled kernels are shared through one module-scoped cache, as in test_jit_unit.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from test_jit_unit import ir_of, no_abort

from firmware.jit import ABORT_WATCHDOG, KernelCache, KernelFault, Options
from runtime import kernel_lib, kernels
from testkit import REPO

pytestmark = pytest.mark.timeout(300)

LIB = kernels.compile_module(kernel_lib.SOURCE)["kernels"]
GEMM_T = ("float32[2d]", "float32[2d]", "float32[2d]", "int64")


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> KernelCache:
    root: Path = tmp_path_factory.mktemp("jitcache")
    return KernelCache(root)


def vectorised(src: str) -> set[int]:
    """The phases of a generated module that have a vectorised form."""
    return {int(line.split("def _phv")[1].split("(")[0])
            for line in src.splitlines() if line.startswith("def _phv")}


def test_tiled_gemm_inner_loop_is_vectorised_and_exact(cache: KernelCache) -> None:
    k = cache.get(LIB["gemm"], GEMM_T, Options())
    assert vectorised(k.source) == {2}  # for k in range(16): acc += ta[ty, k] * tb[k, tx]
    fn = k.source.split("def _phv2(")[1].split("@njit")[0]
    assert "_miss(" not in fn and -1 < fn.index("for u_k in range(") < fn.index("for _l0 in")
    unchecked = cache.get(LIB["gemm"], GEMM_T, Options(boundscheck=False))
    assert vectorised(unchecked.source) == {2}
    rng = np.random.default_rng(1)
    for m in (64, 40):  # 40: the edge blocks fail the range checks, run per thread
        a = rng.standard_normal((m, m), dtype=np.float32)
        b = rng.standard_normal((m, m), dtype=np.float32)
        grid = ((m + 15) // 16, (m + 15) // 16, 1)
        outs = []
        for kk in (k, unchecked):
            c = np.zeros((m, m), np.float32)
            kk.run(0, grid[0] * grid[1], grid, (16, 16, 1), [a, b, c, np.int64(m)], no_abort())
            outs.append(c)
        # per-thread float64 sums of float32 products, k in order: the same bits both ways
        ref = np.zeros((m, m))
        for j in range(m):
            ref += (a[:, j:j + 1] * b[j:j + 1, :]).astype(np.float64)
        np.testing.assert_array_equal(outs[0], ref.astype(np.float32))
        np.testing.assert_array_equal(outs[1], outs[0])


def test_reduce_sum_span_loop_is_vectorised_and_exact(cache: KernelCache) -> None:
    k = cache.get(LIB["reduce_sum"], ("float32[1d]", "float64[1d]"), Options())
    assert vectorised(k.source) == {0}  # each block's span; what the spans leave is phase 1
    x = np.random.default_rng(2).integers(-1000, 1000, 300_001).astype(np.float32)
    for nb in (1, 7, 64, 2000):  # 2000 blocks: every span empty, all of x in the tail
        total = np.zeros(1)
        k.run(0, nb, (nb, 1, 1), (256, 1, 1), [x, total], no_abort())
        assert total[0] == x.astype(np.int64).sum()  # integers: every order is exact
    y = np.random.default_rng(3).random(100_000, dtype=np.float32)
    total = np.zeros(1)
    k.run(0, 25, (25, 1, 1), (256, 1, 1), [y, total], no_abort())
    assert np.isclose(total[0], y.astype(np.float64).sum(), rtol=1e-12)


BARRIER_LOOP = ir_of("""
    def rows(x, out, n):
        s = shared_array(64, "float64")
        t = local_id(0)
        acc = 0.0
        for r in range(n):
            s[t] = x[r * 64 + t]
            barrier()
            for k in range(64):
                acc += s[k] * (t + 1)
            barrier()
        out[global_id(0)] = acc
""")


def test_barriers_inside_uniform_loops(cache: KernelCache) -> None:
    k = cache.get(BARRIER_LOOP, ("float64[1d]", "float64[1d]", "int64"), Options())
    assert vectorised(k.source) == {2}
    x = np.random.default_rng(4).random(64 * 5)
    out = np.zeros(128)
    k.run(0, 2, (2, 1, 1), (64, 1, 1), [x, out, np.int64(5)], no_abort())
    acc = np.zeros(64)
    for r in range(5):
        for j in range(64):
            acc += x[r * 64 + j] * (np.arange(64) + 1)
    np.testing.assert_array_equal(out, np.tile(acc, 2))


RETURN_FIRST = ir_of("""
    def ret(x, out):
        t = local_id(0)
        acc = 0.0
        if group_id(0) >= 1:
            return
        barrier()
        for k in range(8):
            acc += x[k] * t
        out[global_id(0)] = acc
""")


def test_thread_return_before_a_vectorised_phase(cache: KernelCache) -> None:
    """The threads that returned in an earlier phase are skipped in a vectorised one (a
    whole block's: the barrier rule forbids a thread returning alone before a barrier)."""
    k = cache.get(RETURN_FIRST, ("float64[1d]", "float64[1d]"), Options())
    assert vectorised(k.source) == {1}
    x = np.arange(8, dtype=np.float64)
    out = np.full(64, -1.0)
    k.run(0, 2, (2, 1, 1), (32, 1, 1), [x, out], no_abort())
    t = np.arange(64) % 32
    np.testing.assert_array_equal(out, np.where(np.arange(64) < 32, x.sum() * t, -1.0))


OOB_LOOP = ir_of("""
    def oob(x, out, m):
        t = local_id(0)
        acc = 0.0
        for k in range(m):
            acc += x[k, t + 5]
        out[global_id(0)] = acc
""", {"x": 2})


def test_out_of_bounds_in_an_interchanged_loop_faults_as_per_thread(cache: KernelCache) -> None:
    k = cache.get(OOB_LOOP, ("float32[2d]", "float32[1d]", "int64"), Options())
    assert vectorised(k.source) == {0}
    x = np.ones((5, 40), np.float32)
    out = np.zeros(64, np.float32)
    # thread 0 misses first at x[5, 5] (k = 5); in k-major order x[0, 40] (thread 35) would
    with pytest.raises(KernelFault) as ei:
        k.run(0, 1, (1, 1, 1), (64, 1, 1), [x, out, np.int64(8)], no_abort())
    assert (ei.value.kind, ei.value.param, ei.value.index, ei.value.block) == \
        ("bounds", "x", 5 * 40 + 5, 0)
    assert k.run(0, 1, (1, 1, 1), (32, 1, 1), [x, out, np.int64(5)], no_abort()) == 1
    np.testing.assert_array_equal(out[:32], 5.0)  # in range: the vectorised form ran


ATOMIC_LOOP = ir_of("""
    def hist(bins, n):
        t = local_id(0)
        for k in range(n):
            atomic_add(bins, (t + k) % 8, 1)
""")
DIVERGENT = ir_of("""
    def tri(x, out):
        t = local_id(0)
        acc = 0.0
        for k in range(t):
            acc += x[k]
        out[global_id(0)] = acc
""")
STORE_IN_LOOP = ir_of("""
    def acc_out(x, out):
        t = global_id(0)
        for k in range(4):
            out[t] += x[k]
""")
FLOAT32_LOCAL = ir_of("""
    def f32(x, out):
        t = global_id(0)
        v = x[t]
        for k in range(3):
            v = v * v
        out[t] = v
""")


def test_what_keeps_the_per_thread_form(cache: KernelCache) -> None:
    # atomics (their order), a thread-dependent loop, a store inside the uniform loop, a
    # float32 local living across the loop (a float64 array would round differently)
    h = cache.get(ATOMIC_LOOP, ("int64[1d]", "int64"), Options())
    t = cache.get(DIVERGENT, ("float64[1d]", "float64[1d]"), Options())
    s = cache.get(STORE_IN_LOOP, ("float64[1d]", "float64[1d]"), Options())
    f = cache.get(FLOAT32_LOCAL, ("float32[1d]", "float32[1d]"), Options())
    assert all(vectorised(k.source) == set() for k in (h, t, s, f))
    bins = np.zeros(8, np.int64)
    h.run(0, 3, (3, 1, 1), (64, 1, 1), [bins, np.int64(10)], no_abort())
    assert (bins == 3 * 64 * 10 // 8).all()
    x = np.arange(64, dtype=np.float64)
    out = np.zeros(64)
    t.run(0, 1, (1, 1, 1), (64, 1, 1), [x, out], no_abort())
    np.testing.assert_array_equal(out, np.cumsum(np.r_[0, x[:-1]]))
    out = np.zeros(64)
    s.run(0, 1, (1, 1, 1), (64, 1, 1), [x, out], no_abort())
    assert (out == x[:4].sum()).all()
    xf = np.random.default_rng(5).random(64, dtype=np.float32) + np.float32(0.5)
    of = np.zeros(64, np.float32)
    f.run(0, 1, (1, 1, 1), (64, 1, 1), [xf, of], no_abort())
    np.testing.assert_array_equal(of, ((xf * xf) * (xf * xf)) * ((xf * xf) * (xf * xf)))


SPIN_LOOP = ir_of("""
    def spin(out, n):
        acc = 0.0
        for k in range(n):
            acc += 1.0
        out[global_id(0)] = acc
""")


def test_interchanged_loop_sees_the_abort_word(cache: KernelCache) -> None:
    k = cache.get(SPIN_LOOP, ("float64[1d]", "int64"), Options())
    assert vectorised(k.source) == {0}
    out = np.zeros(64)
    abort = no_abort()
    result: list[BaseException | int] = []

    def go() -> None:
        try:
            result.append(k.run(0, 1, (1, 1, 1), (64, 1, 1), [out, np.int64(1 << 40)], abort))
        except BaseException as exc:  # noqa: BLE001
            result.append(exc)

    th = threading.Thread(target=go, daemon=True)
    th.start()
    time.sleep(0.3)
    assert th.is_alive()
    abort[0] = ABORT_WATCHDOG
    th.join(10)
    assert not th.is_alive(), "the vectorised loop did not see the abort word"
    assert isinstance(result[0], KernelFault) and result[0].kind == "watchdog"


DYNAMIC_ALIAS = ir_of("""
    def alias(out, n):
        a = dynamic_shared("float64")
        b = dynamic_shared("float64")
        t = local_id(0)
        acc = 0.0
        for k in range(n):
            acc += b[k]
        a[t] = acc + t + 1
        out[global_id(0)] = a[t]
""")


def test_aliasing_dynamic_shared_arrays_keep_the_per_thread_order(cache: KernelCache) -> None:
    # a and b are the same bytes: thread t's store a[t] is seen by later threads' loads of
    # b[k], which only the per-thread order gives (a race, but the old, defined, result)
    k = cache.get(DYNAMIC_ALIAS, ("float64[1d]", "int64"), Options())
    assert vectorised(k.source) == set()
    out = np.zeros(4)
    k.run(0, 1, (1, 1, 1), (4, 1, 1), [out, np.int64(4)], no_abort(), dynamic_shared=4 * 8)
    np.testing.assert_array_equal(out, [1.0, 3.0, 7.0, 15.0])  # vectorised: 1, 2, 3, 4


STRIDED_SUM = ir_of("""
    def strided(x, out, lo, hi):
        t = local_id(0)
        acc = 0.0
        for k in range(lo, hi, 3):
            acc += x[k, t]
        out[global_id(0)] = acc
""", {"x": 2})
STEP_PARAM = ir_of("""
    def by_step(x, out, n, step):
        t = local_id(0)
        acc = 0.0
        for k in range(0, n, step):
            acc += x[k, t]
        out[global_id(0)] = acc
""", {"x": 2})


def test_unroll_and_jam_keeps_each_threads_order(cache: KernelCache) -> None:
    # four iterations per pass of the thread loops, then the remainder one by one: each
    # thread still adds its terms in loop order, so the rounding is the per-thread form's
    k = cache.get(STRIDED_SUM, ("float64[2d]", "float64[1d]", "int64", "int64"), Options())
    assert vectorised(k.source) == {0}
    fn = k.source.split("def _phv0(")[1].split("@njit")[0]
    assert "len(range(" in fn and "_rt_uindex(u_k + 9)" in fn and "u_k + 12" not in fn
    rng = np.random.default_rng(6)
    x = rng.standard_normal((40, 64)) * 10.0 ** rng.integers(-8, 8, (40, 64))
    for lo, hi in ((0, 40), (1, 38), (2, 3), (5, 5), (7, 2), (0, 12)):  # 14, 13, 1, 0 trips
        out = np.zeros(64)
        k.run(0, 1, (1, 1, 1), (64, 1, 1), [x, out, np.int64(lo), np.int64(hi)], no_abort())
        ref = np.zeros(64)
        for kk in range(lo, hi, 3):
            ref = ref + x[kk]
        np.testing.assert_array_equal(out, ref)
    s = cache.get(STEP_PARAM, ("float64[2d]", "float64[1d]", "int64", "int64"), Options())
    assert vectorised(s.source) == {0} and "len(range(" not in s.source  # step unknown
    out = np.zeros(64)
    s.run(0, 1, (1, 1, 1), (64, 1, 1), [x, out, np.int64(40), np.int64(7)], no_abort())
    np.testing.assert_array_equal(out, sum((x[j] for j in range(0, 40, 7)), np.zeros(64)))


GUARDED_LOAD = ir_of("""
    def guarded(x, out, m):
        i = global_id(0)
        if local_id(0) < m:
            v = x[i] * 2.0
        else:
            v = -1.0
        out[i] = v
""")


def test_a_guarded_load_runs_as_a_select_where_the_block_checked_it(cache: KernelCache) -> None:
    # in a block whose range check passed, the load the guard skips is in range anyway: it
    # is made for every thread and the guard picks the value (a select, which vectorises)
    k = cache.get(GUARDED_LOAD, ("float32[1d]", "float32[1d]", "int64"), Options())
    assert " if _l0 < u_m else " in k.source
    x = np.arange(256, dtype=np.float32)
    t = np.arange(256) % 64
    for m in (64, 20, 0):  # the guard false for some threads of blocks that passed
        out = np.zeros(256, np.float32)
        k.run(0, 4, (4, 1, 1), (64, 1, 1), [x, out, np.int64(m)], no_abort())
        np.testing.assert_array_equal(out, np.where(t < m, x * 2, -1.0).astype(np.float32))
    # x shorter than the grid: the last block's check fails, its threads run checked, and
    # the guard keeps them from x's missing elements (no fault)
    short = np.arange(100, dtype=np.float32)
    out = np.zeros(128, np.float32)
    k.run(0, 2, (2, 1, 1), (64, 1, 1), [short, out, np.int64(36)], no_abort())
    want = np.where(np.arange(128) % 64 < 36, np.r_[short, np.zeros(28, np.float32)] * 2, -1)
    np.testing.assert_array_equal(out, want.astype(np.float32))
    with pytest.raises(KernelFault) as ei:  # the guard lets an index past x: the same fault
        k.run(0, 2, (2, 1, 1), (64, 1, 1), [short, out, np.int64(40)], no_abort())
    assert (ei.value.kind, ei.value.param, ei.value.index, ei.value.block) == ("bounds", "x", 100, 1)


BOUNDS_GUARD = ir_of("""
    def add(x, y, n):
        i = global_id(0)
        if i < n:
            x[i] += y[i]
""")
LOWER_GUARD = ir_of("""
    def shift(out, x, k):
        i = global_id(0)
        if k <= i:
            out[i] = x[i - k]
""")
LOCAL_GUARD = ir_of("""
    def halves(x, out):
        t = local_id(0)
        v = 0.0
        if t < 32:
            v = x[global_id(0)]
        out[global_id(0)] = v
""")


def fast_body(src: str) -> str:
    """The thread loop the block runs when its range checks passed (the inlined phase)."""
    return src.split("def _grid(")[1].split("        else:")[0]


def test_a_bounds_guard_true_for_the_whole_block_is_checked_once(cache: KernelCache) -> None:
    # if i < n: x[i] += y[i] -- a block whose last thread passes the guard runs without it
    # (vectorised); the grid's edge block runs the checked per-thread loop
    k = cache.get(BOUNDS_GUARD, ("float32[1d]", "float32[1d]", "int64"), Options())
    fast = fast_body(k.source)
    assert "< (u_n)" in fast and "if u_i < u_n" not in fast
    for n, blocks in ((256, 4), (200, 4), (1, 1), (0, 2)):
        x = np.zeros(256, np.float32)
        y = np.arange(256, dtype=np.float32)
        k.run(0, blocks, (blocks, 1, 1), (64, 1, 1), [x, y, np.int64(n)], no_abort())
        np.testing.assert_array_equal(x, np.where(np.arange(256) < min(n, blocks * 64), y, 0))
    # the guard lets threads past x: the same fault (first missing index, its block)
    x = np.zeros(100, np.float32)
    with pytest.raises(KernelFault) as ei:
        k.run(0, 2, (2, 1, 1), (64, 1, 1), [x, np.zeros(128, np.float32), np.int64(128)],
              no_abort())
    assert (ei.value.kind, ei.value.param, ei.value.index, ei.value.block) == ("bounds", "x", 100, 1)
    # a lower bound written either way round
    s = cache.get(LOWER_GUARD, ("float32[1d]", "float32[1d]", "int64"), Options())
    assert "if u_k <= u_i" not in fast_body(s.source)
    for kk in (0, 3, 64, 70):
        out = np.full(192, -1.0, np.float32)
        xs = np.arange(192, dtype=np.float32)
        s.run(0, 3, (3, 1, 1), (64, 1, 1), [out, xs, np.int64(kk)], no_abort())
        want = np.where(np.arange(192) >= kk, np.arange(192) - kk, -1).astype(np.float32)
        np.testing.assert_array_equal(out, want)


def test_a_guard_on_local_ids_stays_per_thread(cache: KernelCache) -> None:
    # if t < 32 holds for half of every block: kept as a branch, the block stays range-checked
    k = cache.get(LOCAL_GUARD, ("float32[1d]", "float32[1d]"), Options())
    assert "if u_t < 32" in fast_body(k.source)
    x = np.arange(256, dtype=np.float32)
    out = np.full(256, -1.0, np.float32)
    k.run(0, 4, (4, 1, 1), (64, 1, 1), [x, out], no_abort())
    np.testing.assert_array_equal(out, np.where(np.arange(256) % 64 < 32, x, 0))


#: A guard on the global id that holds for a block whose range checks passed, after a
#: loop the phase vectorises (docs/compiler.md, the renderer's modes).
GUARD_AFTER_LOOP = ir_of("""
    def k(x, out, n):
        i = global_id(0)
        acc = 0.0
        for j in range(n):
            acc += x[j]
        if i < n:
            out[i] = acc
""")


def test_a_vectorised_phase_keeps_its_guard_without_bounds_checks(cache: KernelCache) -> None:
    # without bounds checks no block passed a range check, so none may drop the guard:
    # one block of 64 threads with n = 10 writes out[:10] and nothing past it
    types = ("float32[1d]", "float32[1d]", "int64")
    for boundscheck in (True, False):
        k = cache.get(GUARD_AFTER_LOOP, types, Options(boundscheck=boundscheck))
        x, out = np.ones(64, np.float32), np.full(64, -1.0, np.float32)
        k.run(0, 1, (1, 1, 1), (64, 1, 1), [x, out, np.int64(10)], no_abort())
        np.testing.assert_array_equal(out, np.where(np.arange(64) < 10, 10.0, -1.0),
                                      err_msg=f"boundscheck={boundscheck}")


#: A phase with a local that could stay per thread and one that cannot (the vectorise
#: pass gives the phase up): found by lowering a corpus under two hash seeds.
SEED_ORDER = ir_of("""
    def rk(x, y, out, a, n, m, s):
        i = global_id(0)
        tx = local_id(0)
        row = group_id(0) * 16 + tx
        acc = 0
        t = 0.0
        for k in range(0, n):
            acc *= sqrt(abs(min(float(i), x[i + n] * a)))
        if i < n:
            t = x[i] * a
        else:
            t = a
        t = a
        acc -= x[row + 1] * a - sqrt(abs(x[i * 2] * a))
        j = 0
        while j < n:
            j += 1
            acc += x[j]
        for q in range(m):
            barrier()
            acc += x[tx + q]
            barrier()
""")


def test_generated_source_does_not_depend_on_the_hash_seed() -> None:
    # the source is the JIT cache key: a process with another PYTHONHASHSEED must find
    # the entry another one built
    code = ("import hashlib, json, sys\nfrom firmware import lower\n"
            "ir, types = json.load(sys.stdin)\n"
            "src = lower.lower(ir, tuple(types), lower.Options(boundscheck=False, fastmath=True))\n"
            "print(hashlib.sha1(src.encode()).hexdigest())\n")
    types = ["float32[1d]", "float32", "float32", "float32", "int64", "int64", "int64"]
    digests = {}
    for seed in range(6):
        run = subprocess.run([sys.executable, "-c", code], input=json.dumps([SEED_ORDER, types]),
                             capture_output=True, text=True, timeout=120, cwd=REPO,
                             env={**os.environ, "PYTHONHASHSEED": str(seed)}, check=True)
        digests[seed] = run.stdout.strip()
    assert len(set(digests.values())) == 1, digests
