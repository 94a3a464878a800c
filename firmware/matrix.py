"""The compute engines' matrix unit: what a kernel's ``mma(...)`` runs on.

``mma(c, a, b, row, col, k0, tm, tn, tk, beta[, ta, tb])`` is block-collective
(docs/kernels.md): once per block, ``c[row:row+tm, col:col+tn] = beta * c[...] + A @ B``
with ``A = a[row:row+tm, k0:k0+tk]`` (``a[k0:k0+tk, row:row+tm].T`` when ``ta``) and ``B =
b[k0:k0+tk, col:col+tn]`` (``b[col:col+tn, k0:k0+tk].T`` when ``tb``): BLAS's own
``transa``/``transb``, so a transposed operand is read where it lies, not copied first.
Real accelerators do this in a matrix engine (tensor cores, MFMA, XMX, an MME) fed
straight from memory; the emulated one is the host's BLAS ``sgemm``/``dgemm``, called as a
native function pointer from the kernel's machine code (no GIL, no Python). Each engine
thread calls it single-threaded: the engines are the parallelism, as a matrix unit belongs
to one core.

Which BLAS: two, in ILP64 builds (64-bit integer arguments).

- The OpenBLAS that numpy already loads into the firmware process (its CBLAS
  ``*gemm64_``), from the start: it costs nothing to find.
- Intel MKL's Fortran ``sgemm_64``/``dgemm_64``, which torch's CPU wheel links into
  ``torch/lib/libtorch_cpu.so`` and exports, once asked for: 10-20% less CPU than OpenBLAS
  on a 1024 product's halves (docs/kernels.md, "The matrix unit"), but loading that
  library (not importing torch: ``dlopen`` of the file, found without an import) costs
  ~0.25-0.4 s of CPU and ~100 MB of memory. So a firmware loads it only once it runs a big
  product: a BLAS call of at least ``ASK_MKL_MACS`` multiply-adds marks the pointer array
  (its ``STATE_AT`` word), and the engine that ran the launch loads MKL after reporting it
  done, or for a launch run inline on the control loop the module-loader thread does
  (:func:`serve_request`); later calls use MKL. MKL's thread count is a per-thread
  setting, so every MKL call first sets its thread's to one (a few nanoseconds).

Without torch (or when its library fails to load) the unit stays on OpenBLAS. Without
OpenBLAS (another numpy build) the firmware's pointers are 0 and stay so (only a BLAS
call asks for MKL): the generated code runs the same contraction as plain loops (correct,
much slower). Tests run every path (:func:`blas_pointers`'s kinds).

Why pointers are arguments, not constants: numba's on-disk cache would bake a constant
address from the compiling process into machine code that another process loads. The
firmware is a process of its own (never forked); a fork of a process that uses this module
gets fresh locks (a loader thread's lock held at the fork would never be released).
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

#: Symbol names of OpenBLAS's ILP64 CBLAS entry points, in order of preference.
_GEMM_SYMBOLS = {
    "float32": ("scipy_cblas_sgemm64_", "cblas_sgemm64_"),
    "float64": ("scipy_cblas_dgemm64_", "cblas_dgemm64_"),
}
_THREADS_SYMBOLS = ("scipy_openblas_set_num_threads64_", "openblas_set_num_threads64_")
#: MKL's ILP64 Fortran entry points in torch's library, and its per-thread thread count.
_MKL_GEMM_SYMBOLS = {"float32": "sgemm_64", "float64": "dgemm_64"}
_MKL_THREADS_SYMBOL = "MKL_Set_Num_Threads_Local"
#: Index of each dtype's OpenBLAS entry point in the pointer array the kernels receive;
#: ``FORTRAN_AT + SLOT[dtype]`` is MKL's, ``THREADS_AT`` MKL's thread-count setter and
#: ``STATE_AT`` whether a kernel may ask for MKL (ASK_*). ``WIDTH`` words in all.
SLOT = {"float32": 0, "float64": 1}
FORTRAN_AT = 2
THREADS_AT = 4
STATE_AT = 5
WIDTH = 6
#: ``STATE_AT``'s values: nothing to ask (MKL in use, absent, or not wanted), a big call
#: may ask, a big call asked.
ASK_NEVER, ASK_MAY, ASKED = 0, 1, 2
#: A BLAS call at least this big asks for MKL: 10 Mi multiply-adds, ~0.17 ms of one core
#: on OpenBLAS. An MLP step's 64 x 256 over 784 product (12.8 M) runs inline, ~50 us less
#: on MKL, twice a step: the load (~0.3 s of CPU, once) pays back within a few thousand
#: steps; a test's small products (8 Mi and under) stay on OpenBLAS and never load it.
ASK_MKL_MACS = 10 << 20
#: What :func:`blas_pointers` can give: the firmware's own choice (``auto``: OpenBLAS, then
#: MKL once asked), one library from the start, or none (``loops``).
KINDS = ("auto", "mkl", "openblas", "loops")
#: Work per BLAS call: tiles are cut into row, column and k chunks of these sizes so that
#: the watchdog and a kill are seen between chunks (a full chunk is 512 M multiply-adds,
#: ~7 ms of one core, a small fraction of the watchdog's period). Rows are the long side:
#: OpenBLAS packs each panel of the right operand once per call and streams every row of
#: the call past it, so the fewer rows a call has, the more of its time is packing (one
#: core, a 1024 product as calls of 256 x 512 x 512: 1.3-1.4x the CPU of one call; of
#: 1024 x 512 x 1024: 1.01x; docs/kernels.md, "The matrix unit").
ROW_CHUNK = 1024
COL_CHUNK = 512
K_CHUNK = 1024

_lock = threading.Lock()  # the cached lookups below
_serve_lock = threading.Lock()  # one engine loads MKL; the others carry on meanwhile
_openblas_found: tuple[int, int] | None = None
_mkl_found: tuple[int, int, int] | None | bool = False  # False: not tried yet
_auto: np.ndarray | None = None


def _fresh_locks() -> None:
    global _lock, _serve_lock
    _lock, _serve_lock = threading.Lock(), threading.Lock()


os.register_at_fork(after_in_child=_fresh_locks)


def _loaded_blas_paths() -> list[str]:
    """Shared objects mapped into this process whose file name says OpenBLAS (numpy's)."""
    paths: list[str] = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                path = fields[5].strip() if len(fields) == 6 else ""
                name = path.rsplit("/", 1)[-1].lower()
                if "openblas" in name and ".so" in name and path not in paths:
                    paths.append(path)
    except OSError:
        pass
    return paths


def _find_openblas() -> tuple[int, int]:
    """OpenBLAS's ``(sgemm, dgemm)`` (0 where none was found); also limits it to one
    thread per call."""
    ptrs = [0, 0]
    for path in _loaded_blas_paths():
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for dtype, names in _GEMM_SYMBOLS.items():
            for name in names:
                fn = getattr(lib, name, None)
                if fn is not None and not ptrs[SLOT[dtype]]:
                    ptrs[SLOT[dtype]] = ctypes.cast(fn, ctypes.c_void_p).value or 0
        for name in _THREADS_SYMBOLS:
            setter = getattr(lib, name, None)
            if setter is not None:
                setter.argtypes = [ctypes.c_int]
                setter(1)
                break
        if all(ptrs):
            break
    return ptrs[0], ptrs[1]


def mkl_library() -> Path | None:
    """torch's ``libtorch_cpu.so`` (which holds MKL) when torch is installed, found
    without importing torch (an import costs seconds)."""
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "lib" / "libtorch_cpu.so"
    return path if path.is_file() else None


def _find_mkl() -> tuple[int, int, int] | None:
    """MKL's ``(sgemm, dgemm, thread-count setter)``, or None without torch's library or
    any of them. ``RTLD_LOCAL``: its symbols stay its own, whatever else is loaded."""
    path = mkl_library()
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(str(path), os.RTLD_LOCAL)
    except OSError:
        return None
    names = (_MKL_GEMM_SYMBOLS["float32"], _MKL_GEMM_SYMBOLS["float64"], _MKL_THREADS_SYMBOL)
    fns = [getattr(lib, name, None) for name in names]
    if any(fn is None for fn in fns):
        return None
    s, d, t = (ctypes.cast(fn, ctypes.c_void_p).value or 0 for fn in fns)
    return (s, d, t) if s and d and t else None


def _openblas() -> tuple[int, int]:
    global _openblas_found
    with _lock:
        if _openblas_found is None:
            _openblas_found = _find_openblas()
        return _openblas_found


def _mkl() -> tuple[int, int, int] | None:
    """:func:`_find_mkl`, once per process (the library stays loaded)."""
    global _mkl_found
    with _lock:
        if _mkl_found is False:
            _mkl_found = _find_mkl()
        return _mkl_found  # type: ignore[return-value]


def mkl_available() -> bool:
    """Whether MKL can be loaded (loads it: ~0.3 s the first time)."""
    return _mkl() is not None


def _with_mkl(ptrs: np.ndarray, mkl: tuple[int, int, int]) -> None:
    """Fill in MKL's entry points, the thread-count setter first: a kernel that sees MKL's
    gemm must see the setter too (each word is one aligned store, in program order)."""
    s, d, t = mkl
    ptrs[THREADS_AT] = t
    ptrs[FORTRAN_AT + SLOT["float64"]] = d
    ptrs[FORTRAN_AT + SLOT["float32"]] = s


def blas_pointers(kind: str = "auto") -> np.ndarray:
    """The pointer array kernels receive (layout: ``SLOT``, ``FORTRAN_AT``...).

    ``auto`` is the process's one array, shared by its kernel caches: OpenBLAS until a
    big call asks for MKL (:func:`serve_request` then fills MKL in, and every kernel
    given this array uses it from its next call). ``mkl`` loads MKL now (LookupError when
    it cannot), ``openblas`` never uses MKL, ``loops`` no BLAS at all."""
    global _auto
    if kind not in KINDS:
        raise ValueError(f"blas kind {kind!r}: one of {KINDS}")
    ptrs = np.zeros(WIDTH, np.int64)
    if kind == "loops":
        return ptrs
    ptrs[SLOT["float32"]], ptrs[SLOT["float64"]] = _openblas()
    if kind == "mkl":
        mkl = _mkl()
        if mkl is None:
            raise LookupError("no MKL: torch's libtorch_cpu.so is not installed or not loadable")
        _with_mkl(ptrs, mkl)
    elif kind == "auto":
        with _lock:
            if _auto is None:
                ptrs[STATE_AT] = ASK_MAY if ptrs.any() else ASK_NEVER
                _auto = ptrs
            return _auto
    return ptrs


def serve_request(ptrs: np.ndarray) -> None:
    """Load MKL into ``ptrs`` if a kernel asked (``STATE_AT``): called by the engine that
    ran a launch using mma, after the launch ended, or by the module-loader thread for an
    inline one (the load is not the launch's time, nor under its watchdog, nor the control
    loop's). A thread finding another one loading goes on at once."""
    if ptrs[STATE_AT] != ASKED or not _serve_lock.acquire(blocking=False):
        return
    try:
        if ptrs[STATE_AT] == ASKED:
            mkl = _mkl()
            if mkl is not None:
                _with_mkl(ptrs, mkl)
            ptrs[STATE_AT] = ASK_NEVER
    finally:
        _serve_lock.release()


# --------------------------------------------------------------------------- intrinsics
# Imported by generated modules: a change here must bump jit.FIRMWARE_JIT_ABI.


@intrinsic
def _rt_gemm(typingctx: Any, mkl: Any, threads: Any, cblas: Any, trans_a: Any, trans_b: Any,
             m: Any, n: Any, k: Any, a: Any, a_off: Any, lda: Any, b: Any, b_off: Any, ldb: Any,
             beta: Any, c: Any, c_off: Any, ldc: Any) -> Any:
    """Row-major ``C = beta * C + op(A) @ op(B)``, ``op`` transposing where ``trans_a`` /
    ``trans_b`` is nonzero, for the ``m x n`` matrix C at ``c + c_off`` (offsets in
    elements; leading dimensions ``lda``...; int64 sizes): through MKL's Fortran gemm at
    ``mkl`` when it is nonzero (after ``threads(1)``, MKL's per-thread count), else
    through the CBLAS gemm at ``cblas``. The generated code has checked every range.

    Fortran is column-major and takes every argument by pointer (stack slots here): a
    row-major matrix is its transpose to it, so C's transpose is computed, ``op(B)^T @
    op(A)^T``: B first, the sizes as ``n, m``, each operand's own transposition flag."""
    arrays = (a, b, c)
    if not all(isinstance(x, types.Array) and x.dtype in (types.float32, types.float64)
               for x in arrays) or len({x.dtype for x in arrays}) != 1:
        return None
    sig = types.none(mkl, threads, cblas, trans_a, trans_b, m, n, k, a, a_off, lda, b, b_off,
                     ldb, beta, c, c_off, ldc)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        st = signature.args
        dtype = st[8].dtype
        fty = context.get_value_type(dtype)
        i8, i32, i64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)
        fp, i8p, i64p = fty.as_pointer(), i8.as_pointer(), i64.as_pointer()

        def int64(i: int) -> Any:
            return context.cast(builder, args[i], st[i], types.int64)

        def at(i: int) -> Any:  # array argument i plus its offset (argument i + 1)
            data = context.make_array(st[i])(context, builder, args[i]).data
            return builder.gep(data, [int64(i + 1)])

        def ref(value: Any) -> Any:
            return cgutils.alloca_once_value(builder, value)

        mkl_fn, ta, tb = int64(0), int64(3), int64(4)
        m_v, n_v, k_v, lda_v, ldb_v, ldc_v = (int64(i) for i in (5, 6, 7, 10, 13, 17))
        a_p, b_p, c_p = at(8), at(11), at(15)
        one, beta_v = ir.Constant(fty, 1.0), context.cast(builder, args[14], st[14], dtype)
        zero = ir.Constant(i64, 0)
        with builder.if_else(builder.icmp_signed("!=", mkl_fn, zero)) as (use_mkl, use_cblas):
            with use_mkl:
                set_threads = builder.inttoptr(int64(1), ir.FunctionType(i32, [i32]).as_pointer())
                builder.call(set_threads, [ir.Constant(i32, 1)])
                gemm_t = ir.FunctionType(ir.VoidType(), [i8p, i8p, i64p, i64p, i64p, fp, fp, i64p,
                                                         fp, i64p, fp, fp, i64p])

                def flag(t: Any) -> Any:
                    trans = builder.icmp_signed("!=", t, zero)
                    return ref(builder.select(trans, ir.Constant(i8, ord("T")),
                                              ir.Constant(i8, ord("N"))))

                builder.call(builder.inttoptr(mkl_fn, gemm_t.as_pointer()),
                             [flag(tb), flag(ta), ref(n_v), ref(m_v), ref(k_v), ref(one), b_p,
                              ref(ldb_v), a_p, ref(lda_v), ref(beta_v), c_p, ref(ldc_v)])
            with use_cblas:
                gemm_t = ir.FunctionType(ir.VoidType(), [i32, i32, i32, i64, i64, i64, fty, fp,
                                                         i64, fp, i64, fty, fp, i64])

                def op(t: Any) -> Any:  # CBLAS's 112 Trans or 111 NoTrans
                    trans = builder.icmp_signed("!=", t, zero)
                    return builder.select(trans, ir.Constant(i32, 112), ir.Constant(i32, 111))

                builder.call(builder.inttoptr(int64(2), gemm_t.as_pointer()),
                             [ir.Constant(i32, 101), op(ta), op(tb), m_v, n_v, k_v, one, a_p,
                              lda_v, b_p, ldb_v, beta_v, c_p, ldc_v])  # 101: RowMajor
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _rt_span(typingctx: Any, ary: Any) -> Any:
    """``(first byte address, one past the last)`` of a C-contiguous array: operands of
    one mma may alias (two arguments naming one allocation), which BLAS does not allow."""
    if not isinstance(ary, types.Array):
        return None
    sig = types.UniTuple(types.int64, 2)(ary)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        arr = context.make_array(signature.args[0])(context, builder, args[0])
        start = builder.ptrtoint(arr.data, ir.IntType(64))
        end = builder.add(start, builder.mul(arr.nitems, arr.itemsize))
        return context.make_tuple(builder, signature.return_type, [start, end])

    return sig, codegen


#: The block-level helper a kernel that uses mma gets in its generated module (the text is
#: part of the generated source, so its hash is in the cache key). Returns 1 when the
#: launch must stop (a bounds miss, recorded in ``fault``, or the abort word).
#:
#: The generated call passes the eight integer arguments through ``_rt_index`` (int64; a
#: float is a compile error, a uint64 beyond int64 saturates), so the range checks below
#: compare int64 values only, and none of their arithmetic can wrap: each subtraction is
#: of two non-negative values, and the reported far corner saturates. Once a tile passes,
#: every offset below is inside an existing array (at most its element count).
HELPER = '''
@njit(**_NJI)
def _mma_far(start, extent):
    """start + extent - 1 for start, extent >= 0, saturated at 2**63-1 (a fault record)."""
    if extent - 1 > 9223372036854775807 - start:
        return 9223372036854775807
    return start + (extent - 1)


@njit(**_NJI)
def _mma_tile_miss(fault, pos, rows, cols, r0, nr, c0, nc):
    """False when [r0, r0+nr) x [c0, c0+nc) lies in a rows x cols matrix; else True, the
    miss recorded as the tile corner that does not (its start when anything is negative,
    else its far end)."""
    if nr < 0 or nc < 0 or r0 < 0 or c0 < 0:
        _miss2(fault, pos, r0, c0, rows, cols)
        return True
    if r0 > rows or nr > rows - r0 or c0 > cols or nc > cols - c0:
        _miss2(fault, pos, _mma_far(r0, nr), _mma_far(c0, nc), rows, cols)
        return True
    return False


@njit(**_NJI)
def _mma(c, a, b, row, col, k0, tm, tn, tk, beta, ta, tb, blas, slot, abort, fault, pc,
         pa, pb):
    trans_a, trans_b = ta != 0, tb != 0
    # each operand's tile in its own storage: a transposed operand holds k along its rows
    a_r0, a_nr, a_q0, a_nq = (k0, tk, row, tm) if trans_a else (row, tm, k0, tk)
    b_r0, b_nr, b_q0, b_nq = (col, tn, k0, tk) if trans_b else (k0, tk, col, tn)
    for arr, pos, r0, nr, q0, nq in ((c, pc, row, tm, col, tn), (a, pa, a_r0, a_nr, a_q0, a_nq),
                                      (b, pb, b_r0, b_nr, b_q0, b_nq)):
        if _mma_tile_miss(fault, pos, arr.shape[0], arr.shape[1], r0, nr, q0, nq):
            return 1
    if tm == 0 or tn == 0:
        return 0
    cs, ce = _rt_span(c)
    as_, ae = _rt_span(a)
    bs, be = _rt_span(b)
    if (as_ < ce and cs < ae) or (bs < ce and cs < be):  # aliasing c: read from copies
        a = a[a_r0:a_r0 + a_nr, a_q0:a_q0 + a_nq].copy()
        b = b[b_r0:b_r0 + b_nr, b_q0:b_q0 + b_nq].copy()
        a_r0, a_q0, b_r0, b_q0 = 0, 0, 0, 0
    # the tiles' origins as (row of A, k) and (k, column of B)
    ar, ak = (a_q0, a_r0) if trans_a else (a_r0, a_q0)
    bk, bc = (b_q0, b_r0) if trans_b else (b_r0, b_q0)
    # BLAS wants a leading dimension >= 1 even when the operand has no columns (k is 0)
    lda, ldb, ldc = max(a.shape[1], 1), max(b.shape[1], 1), c.shape[1]
    mkl, cblas = blas[@FORTRAN@ + slot], blas[slot]  # MKL when loaded, else OpenBLAS
    for r in range(0, tm, @ROWS@):
        mr = min(@ROWS@, tm - r)
        for q0 in range(0, tn, @COLS@):
            nq = min(@COLS@, tn - q0)
            kk = 0
            while True:  # at least once: with tk == 0 it only scales c by beta
                if _rt_abort_word(abort) > @PREEMPT@:
                    fault[0] = @ABORT@
                    return 1
                kr = min(@KS@, tk - kk)
                bb = beta if kk == 0 else 1.0
                if mkl != 0 or cblas != 0:
                    if mkl == 0 and mr * nq * kr >= @ASK_MACS@ and blas[@STATE@] == @ASK_MAY@:
                        blas[@STATE@] = @ASKED@  # firmware/matrix.py: load MKL after the launch
                    a_at = (ak + kk) * lda + ar + r if trans_a else (ar + r) * lda + ak + kk
                    b_at = (bc + q0) * ldb + bk + kk if trans_b else (bk + kk) * ldb + bc + q0
                    _rt_gemm(mkl, blas[@THREADS@], cblas, ta, tb, mr, nq, kr, a, a_at, lda, b,
                             b_at, ldb, bb, c, (row + r) * ldc + col + q0, ldc)
                else:
                    for i in range(mr):
                        for j in range(nq):
                            cij = c[row + r + i, col + q0 + j]
                            c[row + r + i, col + q0 + j] = 0 if bb == 0 else cij * bb
                        for q in range(kr):
                            if trans_a:
                                av = a[ak + kk + q, ar + r + i]
                            else:
                                av = a[ar + r + i, ak + kk + q]
                            if trans_b:
                                for j in range(nq):
                                    bv = b[bc + q0 + j, bk + kk + q]
                                    c[row + r + i, col + q0 + j] += av * bv
                            else:
                                for j in range(nq):
                                    bv = b[bk + kk + q, bc + q0 + j]
                                    c[row + r + i, col + q0 + j] += av * bv
                kk += kr
                if kk >= tk:
                    break
    return 0
'''


def helper_source(preempt: int, abort_fault: int) -> str:
    """HELPER with its constants: the chunk sizes, the abort word's preemption value (a
    preemption waits for the block; anything above it stops the tile), the fault code
    an abort records, and the pointer array's layout."""
    values = {"ROWS": ROW_CHUNK, "COLS": COL_CHUNK, "KS": K_CHUNK, "PREEMPT": preempt,
              "ABORT": abort_fault, "ASK_MACS": ASK_MKL_MACS, "STATE": STATE_AT,
              "ASK_MAY": ASK_MAY, "ASKED": ASKED, "THREADS": THREADS_AT, "FORTRAN": FORTRAN_AT}
    text = HELPER
    for name, value in values.items():
        text = text.replace(f"@{name}@", str(value))
    return text


__all__ = ["ASK_MKL_MACS", "COL_CHUNK", "KINDS", "K_CHUNK", "ROW_CHUNK", "SLOT", "WIDTH",
           "blas_pointers", "helper_source", "mkl_available", "mkl_library", "serve_request"]
