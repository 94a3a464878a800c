"""``strided_copy``: one kernel for every layout change (contiguous, expand/broadcast,
permute, slicing, cat into slices) and dtype conversion (``.to``), so a backend needs a
single compile per (dst dtype, src dtype) pair for all of them.

Up to :data:`MAX_DIMS` dimensions, passed as scalars padded with size-1 dimensions (the
language has no scalar arrays). Conversions follow torch: float to int truncates toward
zero (the firmware's store into an integer buffer), anything to bool is ``!= 0``, bool to
a number is 0 or 1.

One thread per row: each thread works out where its row starts from its index (a division
per outer dimension) and then walks the last dimension by adding its strides. A thread per
element, dividing by every dimension for each one, took ~50 ms for the 256 x 784 transpose
an ``nn.Linear`` forward makes of its weight, against 0.6-3 ms a row (same run,
docs/torch.md "Where an eager op's time goes").
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

import runtime
from torch_accel.kernels import _shared as shared
from torch_accel.kernels._shared import Array

MAX_DIMS = 8
#: threads per block: a thread copies a whole row, so blocks are small enough that a
#: few hundred rows still spread over the engines
ROW_BLOCK = 64


def _source() -> str:
    outer = range(MAX_DIMS - 1)
    params = ", ".join([f"s{k}: 'int64'" for k in outer] + [f"p{k}: 'int64'" for k in outer]
                       + [f"q{k}: 'int64'" for k in outer])
    body = []
    for k in reversed(outer):  # innermost outer dimension last in the arguments, first here
        body += [f"        c = r % s{k}", f"        r = r // s{k}",
                 f"        si += c * p{k}", f"        di += c * q{k}"]
    lines = "\n".join(body)
    return f"""def strided_copy(dst, src, rows: 'int64', cols: 'int64', soff: 'int64', doff: 'int64',
                 {params}, pc: 'int64', qc: 'int64'):
    i = global_id(0)
    if i < rows:
        r = i
        si = soff
        di = doff
{lines}
        for j in range(cols):
            dst[di + j * qc] = src[si + j * pc]
"""


SOURCE = _source()


def _coalesce(sizes: Sequence[int], src: Sequence[int], dst: Sequence[int]
              ) -> tuple[list[int], list[int], list[int]]:
    """Drop size-1 dimensions and merge neighbours that are contiguous in both src and
    dst (fewer index divisions per element; a contiguous copy becomes one dimension)."""
    out: list[list[int]] = []
    for n, a, b in zip(sizes, src, dst):
        if n == 1:
            continue
        if out and out[-1][1] == a * n and out[-1][2] == b * n:
            out[-1] = [out[-1][0] * n, a, b]
        else:
            out.append([n, a, b])
    return [o[0] for o in out], [o[1] for o in out], [o[2] for o in out]


def strided_copy(dst: Array, src: Array, sizes: Sequence[int], src_strides: Sequence[int],
                 src_offset: int, dst_strides: Sequence[int], dst_offset: int,
                 stream: runtime.Stream | None = None) -> None:
    """``dst[dst_offset + sum(idx * dst_strides)] = src[src_offset + sum(idx *
    src_strides)]`` for every index over ``sizes`` (strides and offsets in elements of
    each buffer; stride 0 broadcasts), converting the dtype as torch does."""
    if not len(sizes) == len(src_strides) == len(dst_strides):
        raise ValueError("sizes and strides differ in length")
    n = int(np.prod(sizes, dtype=np.int64)) if len(sizes) else 1
    if n == 0:
        return
    sz, ss, ds = _coalesce(sizes, src_strides, dst_strides)
    if len(sz) > MAX_DIMS:
        raise ValueError(f"at most {MAX_DIMS} non-mergeable dimensions, got {len(sz)}")
    # the last dimension is each thread's loop (its address steps, no division per
    # element); the others are one thread per index
    cols, pc, qc = (sz.pop(), ss.pop(), ds.pop()) if sz else (1, 0, 0)
    pad = MAX_DIMS - 1 - len(sz)
    sz, ss, ds = [1] * pad + sz, [0] * pad + ss, [0] * pad + ds
    rows = n // cols
    # a bool source reads as its 0/1 bytes; a bool destination stays bool (!= 0 on store)
    s = shared.flat(src, np.uint8) if src.dtype == np.bool_ else shared.flat(src)
    d = shared.flat(dst, np.uint8) if dst.dtype == np.bool_ and src.dtype == np.bool_ \
        else shared.flat(dst)
    shared.module("layout", SOURCE, dst.device).strided_copy[shared.grid(rows, ROW_BLOCK),
                                                             ROW_BLOCK](
        d, s, rows, cols, src_offset, dst_offset, *sz, *ss, *ds, pc, qc,
        stream=shared.stream_of(dst, stream))
