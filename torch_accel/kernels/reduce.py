"""Row reductions of a contiguous ``[rows, n]`` buffer: ``reduce_rows`` (short columns of
an ``[n, rows]`` one too).

A row of at most :data:`SHORT` elements is reduced by one thread. A longer row is cut
into chunks of :data:`CHUNK`; a block of 256 threads reduces each (a strided walk per
thread, then thread 0 over the block's 256 partials) into a float64 (or int64) value and
an int64 index (rows=1, n=16M: 512 blocks). Then one thread per row combines the row's
partial results and writes ``out`` in its own dtype (mean's division, argmax's index): a
second pass of the block kernel over the float64 partials would be one more numba compile
(~20 s here) per input dtype. Accumulating in float64 keeps float32 sums of millions of
elements within float32 rounding of numpy's; NaN counts as the maximum (and
the minimum), and ties keep the first index, as torch does.
"""

from __future__ import annotations

import enum

import numpy as np

import runtime
from torch_accel.kernels import _shared as shared
from torch_accel.kernels._shared import Array, Launch
from torch_accel.kernels.elementwise import Binary, Unary, binary, fill, unary
from torch_accel.kernels.layout import strided_copy


class Reduce(enum.IntEnum):
    """``reduce_rows`` op codes."""

    sum = 0
    prod = 1
    mean = 2
    amax = 3
    amin = 4
    argmax = 5
    argmin = 6
    any = 7
    all = 8


ALIASES = {"max": Reduce.amax, "min": Reduce.amin}
#: elements one block reduces (a longer row gets several blocks)
CHUNK = 32768
#: rows at most this long are reduced by one thread each (a block per short row spent
#: more time in block overhead than in the row: 65536 rows of 64 took 0.8 s)
SHORT = 1024

# the loop and the tree combine (acc, ai) with (v, k); k < 0 marks "no element"
_EXTREME = ("if k >= 0 and (ai < 0 or v {cmp} acc or (v != v and acc == acc) or "
            "((v == acc or (v != v and acc != acc)) and k < ai)):\n    acc = v\n    ai = k")
_COMBINE = {
    Reduce.sum: "acc += v",
    Reduce.prod: "acc *= v",
    Reduce.amax: _EXTREME.format(cmp=">"),
    Reduce.amin: _EXTREME.format(cmp="<"),
    Reduce.any: "if v != 0:\n    acc = 1",
    Reduce.all: "if v == 0:\n    acc = 0",
}
#: each op's combine and the final value it writes
_FAMILY = {Reduce.sum: Reduce.sum, Reduce.mean: Reduce.sum, Reduce.prod: Reduce.prod,
           Reduce.amax: Reduce.amax, Reduce.argmax: Reduce.amax, Reduce.amin: Reduce.amin,
           Reduce.argmin: Reduce.amin, Reduce.any: Reduce.any, Reduce.all: Reduce.all}




def _source() -> str:
    parts = []
    for k, acc in (("f", "float64"), ("i", "int64")):
        parts.append(f"""def stage_{k}(val, idx, x, op: 'int64', n: 'int64', chunk: 'int64',
            nchunks: 'int64', init):
    part = shared_array(256, "{acc}")
    pidx = shared_array(256, "int64")
    t = local_id(0)
    c = group_id(0)
    r = group_id(1)
    lo = c * chunk
    hi = min(n, lo + chunk)
    acc = init
    ai = -1
    for k in range(lo + t, hi, 256):
        v = x[r * n + k]
{shared.dispatch(_COMBINE, " " * 8)}
    part[t] = acc
    pidx[t] = ai
    barrier()
    if t == 0:
        for q in range(1, 256):
            v = part[q]
            k = pidx[q]
{shared.dispatch(_COMBINE, " " * 12)}
        val[r * nchunks + c] = acc
        idx[r * nchunks + c] = ai
""")
    parts.append(f"""def finish(out, val, idx, op: 'int64', fam: 'int64', rows: 'int64', nchunks: 'int64',
           n: 'int64', init, use_idx: 'int64', rs: 'int64', qs: 'int64'):
    r = global_id(0)
    if r < rows:
        acc = init
        ai = -1
        for q in range(nchunks):
            v = val[r * rs + q * qs]
            k = q
            if use_idx != 0:
                k = idx[r * nchunks + q]
{shared.dispatch(_COMBINE, " " * 12, "fam")}
        if op == {int(Reduce.mean)}:
            out[r] = acc / n
        elif op == {int(Reduce.argmax)} or op == {int(Reduce.argmin)}:
            out[r] = ai
        else:
            out[r] = acc
""")
    return "\n".join(parts)


SOURCE = _source()
_INT64 = np.iinfo(np.int64)


def _init(fam: Reduce, floating: bool) -> float | int:
    if fam == Reduce.amax:
        return -np.inf if floating else int(_INT64.min)
    if fam == Reduce.amin:
        return np.inf if floating else int(_INT64.max)
    return 1 if fam in (Reduce.prod, Reduce.all) else 0


def reduce_rows(op: Reduce | str, out: Array, x: Array, rows: int, n: int,
                stream: runtime.Stream | None = None, columns: bool = False) -> None:
    """``out[r] = OP(x[r, :])`` for each of ``rows`` rows of ``n`` contiguous elements;
    with ``columns``, of each of ``rows`` columns of a contiguous ``[n, rows]`` ``x`` (a
    reduction over leading dimensions, as a bias gradient's sum, without transposing
    ``x`` first; ``n`` at most :data:`SHORT`). ``out`` may have another dtype (int64 for
    argmax/argmin and for sums of ints, bool for any/all). An empty row gives the op's
    identity (-inf for amax, index -1 for argmax)."""
    if isinstance(op, str):
        op = ALIASES.get(op) or Reduce[op]
    op = Reduce(op)
    if rows == 0:
        return
    floating = x.dtype.kind == "f"
    if op == Reduce.mean and not floating:
        raise TypeError("mean needs float input")
    s = shared.stream_of(out, stream)
    acc = np.float64 if floating else np.int64
    fam = _FAMILY[op]
    init = shared.scalar(_init(fam, floating), acc)
    if n == 0:  # an empty x is an empty allocation, which no launch may name
        fill(out, np.nan if op == Reduce.mean else -1 if op in (Reduce.argmax, Reduce.argmin)
             else init, s)
        return
    mod = shared.module("reduce", SOURCE, out.device)
    xf = shared.as_bytes_if_bool(shared.flat(x))
    if columns and n > SHORT:
        raise ValueError(f"reduce_rows(columns=True) walks at most {SHORT} elements, not {n}")
    if n <= SHORT:  # a thread per row, walking it: no block, barrier or partials
        short_launch(op, out, x, rows, n, columns)(s)
        return
    nchunks = -(-n // CHUNK)
    val = runtime.empty(rows * nchunks, acc, device=out.device)
    idx = runtime.empty(rows * nchunks, np.int64, device=out.device)
    mod.get_kernel(f"stage_{'f' if floating else 'i'}")[(nchunks, rows), shared.BLOCK](
        val, idx, xf, int(fam), n, CHUNK, nchunks, init, stream=s)
    mod.finish[shared.grid(rows), shared.BLOCK](shared.flat(out), val, idx, int(op), int(fam),
                                                rows, nchunks, n, init, 1, nchunks, 1, stream=s)


def short_launch(op: Reduce, out: Array, x: Array, rows: int, n: int, columns: bool,
                 index: Array | None = None) -> Launch:
    """The launch of :func:`reduce_rows` for rows of 0 < ``n`` <= :data:`SHORT`: a thread
    per row (or column) walking it. ``index`` is ``finish``'s int64 index buffer, which
    it reads only after a staged pass, never here: any one int64 element (default a
    buffer of the device's own; a launch plan names one of its call's, so as not to hold
    a buffer of its own)."""
    floating = x.dtype.kind == "f"
    fam = _FAMILY[op]
    rs, qs = (1, rows) if columns else (n, 1)
    return Launch(shared.module("reduce", SOURCE, out.device).finish, shared.grid(rows),
                  shared.BLOCK, (
                      shared.flat(out), shared.as_bytes_if_bool(shared.flat(x)),
                      _no_index(out.device) if index is None else index, int(op), int(fam),
                      rows, n, n, shared.scalar(_init(fam, floating),
                                                np.float64 if floating else np.int64),
                      0, rs, qs))


_dummies: dict[int, runtime.DeviceArray] = {}


def _no_index(device: int) -> runtime.DeviceArray:
    """An int64 buffer for ``finish``'s unused ``idx`` (one per device, never read)."""
    if device not in _dummies:
        _dummies[device] = runtime.empty(1, np.int64, device=device)
    return _dummies[device]


def var_rows(out: Array, x: Array, rows: int, n: int, correction: int = 1, std: bool = False,
             stream: runtime.Stream | None = None) -> None:
    """Variance (or standard deviation) of each row, ``sum((x - mean)**2) / (n -
    correction)`` (NaN where ``n <= correction``), float input. Two passes composed of
    kernels the backend compiles anyway (mean, a broadcast copy, sub, mul, sum), so it
    costs no compile of its own; it needs a temporary of ``x``'s size."""
    if x.dtype.kind != "f":
        raise TypeError("var/std need float input")
    s = shared.stream_of(out, stream)
    mean = runtime.empty(rows, x.dtype, device=x.device)
    reduce_rows(Reduce.mean, mean, x, rows, n, s)
    dev = runtime.empty(rows * n, x.dtype, device=x.device)
    strided_copy(dev, mean, (rows, n), (1, 0), 0, (n, 1), 0, s)
    binary(Binary.sub, dev, x, dev, stream=s)
    binary(Binary.mul, dev, dev, dev, stream=s)
    reduce_rows(Reduce.sum, out, dev, rows, n, s)
    dof = n - correction
    binary(Binary.mul, out, out, 1.0 / dof if dof > 0 else np.inf, stream=s)
    if std:
        unary(Unary.sqrt, out, out, stream=s)
