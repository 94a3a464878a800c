"""The compute engines' matrix unit: what a kernel's ``mma(...)`` runs on.

``mma(c, a, b, row, col, k0, tm, tn, tk, beta[, ta, tb])`` is block-collective
(docs/kernels.md): once per block, ``c[row:row+tm, col:col+tn] = beta * c[...] + A @ B``
with ``A = a[row:row+tm, k0:k0+tk]`` (``a[k0:k0+tk, row:row+tm].T`` when ``ta``) and ``B =
b[k0:k0+tk, col:col+tn]`` (``b[col:col+tn, k0:k0+tk].T`` when ``tb``): BLAS's own
``transa``/``transb``, so a transposed operand is read where it lies, not copied first.
Real accelerators do this in a matrix engine (tensor cores, MFMA, XMX, an MME) fed
straight from memory; the emulated one is the host's BLAS
``sgemm``/``dgemm``, called as a native function pointer from the kernel's machine code
(no GIL, no Python): the OpenBLAS that numpy already loads into the firmware process, in
its ILP64 build (64-bit integer arguments, ``*64_`` symbols). Each engine thread calls it
single-threaded: the engines are the parallelism, as a matrix unit belongs to one core.

Without such a BLAS (another numpy build), the pointers are 0 and the generated code runs
the same contraction as plain loops (correct, much slower); tests run both paths.

Why pointers are arguments, not constants: numba's on-disk cache would bake a constant
address from the compiling process into machine code that another process loads.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

#: Symbol names of the ILP64 CBLAS entry points, in order of preference.
_GEMM_SYMBOLS = {
    "float32": ("scipy_cblas_sgemm64_", "cblas_sgemm64_"),
    "float64": ("scipy_cblas_dgemm64_", "cblas_dgemm64_"),
}
_THREADS_SYMBOLS = ("scipy_openblas_set_num_threads64_", "openblas_set_num_threads64_")
#: Index of each dtype's entry point in the pointer array the kernels receive.
SLOT = {"float32": 0, "float64": 1}
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

_lock = threading.Lock()
_pointers: np.ndarray | None = None


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


def blas_pointers() -> np.ndarray:
    """``[sgemm, dgemm]`` entry points (0 where none was found), looked up once per
    process; also limits that BLAS to one thread per call."""
    global _pointers
    with _lock:
        if _pointers is None:
            ptrs = np.zeros(len(SLOT), np.int64)
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
                if ptrs.all():
                    break
            _pointers = ptrs
        return _pointers


# --------------------------------------------------------------------------- intrinsics
# Imported by generated modules: a change here must bump jit.FIRMWARE_JIT_ABI.


@intrinsic
def _rt_gemm(typingctx: Any, fn: Any, transa: Any, transb: Any, m: Any, n: Any, k: Any,
             a: Any, a_off: Any, lda: Any, b: Any, b_off: Any, ldb: Any, beta: Any, c: Any,
             c_off: Any, ldc: Any) -> Any:
    """``cblas_?gemm(RowMajor, transa, transb, m, n, k, 1, a+a_off, lda, b+b_off, ldb,
    beta, c+c_off, ldc)`` through the function pointer ``fn`` (ILP64: int64 sizes;
    ``transa``/``transb`` CBLAS's 111 NoTrans or 112 Trans). Offsets are in elements; the
    generated code has checked every range."""
    arrays = (a, b, c)
    if not all(isinstance(x, types.Array) and x.dtype in (types.float32, types.float64)
               for x in arrays) or len({x.dtype for x in arrays}) != 1:
        return None
    sig = types.none(fn, transa, transb, m, n, k, a, a_off, lda, b, b_off, ldb, beta, c, c_off,
                     ldc)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        (fnv, ta_v, tb_v, mv, nv, kv, av, ao, lda_v, bv, bo, ldb_v, beta_v, cv, co, ldc_v) = args
        aty = signature.args[6]
        fty = ir.FloatType() if aty.dtype == types.float32 else ir.DoubleType()
        i32, i64 = ir.IntType(32), ir.IntType(64)
        ptr_t = fty.as_pointer()
        gemm_t = ir.FunctionType(ir.VoidType(), [i32, i32, i32, i64, i64, i64, fty, ptr_t,
                                                 i64, ptr_t, i64, fty, ptr_t, i64])

        def at(arr: Any, arrty: Any, off: Any, offty: Any) -> Any:
            data = context.make_array(arrty)(context, builder, arr).data
            return builder.gep(data, [context.cast(builder, off, offty, types.int64)])

        def i64v(v: Any, t: Any) -> Any:
            return context.cast(builder, v, t, types.int64)

        def i32v(v: Any, t: Any) -> Any:
            return context.cast(builder, v, t, types.int32)

        st = signature.args
        call = builder.inttoptr(i64v(fnv, st[0]), gemm_t.as_pointer())
        row_major = ir.Constant(i32, 101)
        builder.call(call, [row_major, i32v(ta_v, st[1]), i32v(tb_v, st[2]),
                            i64v(mv, st[3]), i64v(nv, st[4]), i64v(kv, st[5]),
                            ir.Constant(fty, 1.0), at(av, st[6], ao, st[7]), i64v(lda_v, st[8]),
                            at(bv, st[9], bo, st[10]), i64v(ldb_v, st[11]),
                            context.cast(builder, beta_v, st[12], aty.dtype),
                            at(cv, st[13], co, st[14]), i64v(ldc_v, st[15])])
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
def _mma(c, a, b, row, col, k0, tm, tn, tk, beta, ta, tb, fn, abort, fault, pc, pa, pb):
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
    op_a = 112 if trans_a else 111  # CBLAS Trans / NoTrans
    op_b = 112 if trans_b else 111
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
                if fn != 0:
                    a_at = (ak + kk) * lda + ar + r if trans_a else (ar + r) * lda + ak + kk
                    b_at = (bc + q0) * ldb + bk + kk if trans_b else (bk + kk) * ldb + bc + q0
                    _rt_gemm(fn, op_a, op_b, mr, nq, kr, a, a_at, lda, b, b_at, ldb, bb,
                             c, (row + r) * ldc + col + q0, ldc)
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
    preemption waits for the block; anything above it stops the tile) and the fault code
    an abort records."""
    return (HELPER.replace("@ROWS@", str(ROW_CHUNK)).replace("@COLS@", str(COL_CHUNK))
            .replace("@KS@", str(K_CHUNK))
            .replace("@PREEMPT@", str(preempt)).replace("@ABORT@", str(abort_fault)))


__all__ = ["COL_CHUNK", "K_CHUNK", "ROW_CHUNK", "SLOT", "blas_pointers", "helper_source"]
