"""A small kernel library in the device language, used by the demo, tests and benchmarks.

Each is the SIMT way of writing it (one thread per element or per output), so it
exercises the language and the engine rather than hiding work in the host: fill, copy,
saxpy, a block reduction (shared memory, barriers, one atomic per block), a tiled GEMM
(shared-memory tiles, barriers inside a uniform loop) and a row softmax. ``matmul`` is the
GEMM a real library would ship: each block hands one output tile to the device's matrix
unit (``mma``, the "matrix" capability), the way CUDA GEMMs use tensor cores.
"""

from __future__ import annotations

SOURCE = '''
def spin(x, n):
    # work that takes time: each thread counts to n (a large grid runs for seconds, a
    # block at a time), for what must happen while a kernel is in flight
    acc = 0.0
    for k in range(n):
        acc += 1.0
    x[global_id(0)] = acc


def fill(out, value):
    i = global_id(0)
    if i < out.size:
        out[i] = value


def copy(dst, src):
    i = global_id(0)
    if i < dst.size:
        dst[i] = src[i]


def saxpy(a, x, y, out):
    i = global_id(0)
    if i < out.size:
        out[i] = a * x[i] + y[i]


def reduce_sum(x, total):
    # block g sums one contiguous span of x, its threads 256 elements apart, so an engine
    # streams the span through its caches (a grid-stride walk reads 1 KiB of every 64 KiB
    # on a 64-block grid and leaves the caches cold: docs/kernels-log.md). The
    # span (x.size // num_groups(0) // local_size(0) * local_size(0) elements, whole
    # strides only) is spelled out in the loop: a range over it is then uniform (every
    # thread in range), so the engine runs it across the block's threads
    part = shared_array(256, "float64")
    t = local_id(0)
    acc = 0.0
    for j in range(group_id(0) * (x.size // num_groups(0) // local_size(0) * local_size(0)),
                   (group_id(0) + 1) * (x.size // num_groups(0) // local_size(0) * local_size(0)),
                   local_size(0)):
        acc += x[j + t]
    barrier()
    # what the spans leave (fewer elements than the grid has threads): one each
    tail = (num_groups(0) * (x.size // num_groups(0) // local_size(0) * local_size(0))
            + global_id(0))
    if tail < x.size:
        acc += x[tail]
    part[t] = acc
    barrier()
    for k in range(8):  # a uniform loop: every thread meets every barrier
        step = 128 >> k
        if t < step:
            part[t] += part[t + step]
        barrier()
    if t == 0:
        atomic_add(total, 0, part[0])


def gemm(a, b, c, n):
    ta = shared_array((16, 16), "float32")
    tb = shared_array((16, 16), "float32")
    tx = local_id(0)
    ty = local_id(1)
    col = group_id(0) * 16 + tx
    row = group_id(1) * 16 + ty
    acc = 0.0
    for t in range(0, n, 16):
        if row < n and t + tx < n:
            ta[ty, tx] = a[row, t + tx]
        else:
            ta[ty, tx] = 0.0
        if col < n and t + ty < n:
            tb[ty, tx] = b[t + ty, col]
        else:
            tb[ty, tx] = 0.0
        barrier()
        for k in range(16):
            acc += ta[ty, k] * tb[k, tx]
        barrier()
    if row < n and col < n:
        c[row, col] = acc


def matmul(a, b, c):
    # c = a @ b on the matrix unit: one 128x128 tile of c per block, the whole k at once;
    # grid (ceil(n / 128), ceil(m / 128)), any block size (mma is issued once per block).
    i = group_id(1) * 128
    j = group_id(0) * 128
    mma(c, a, b, i, j, 0, min(128, c.shape[0] - i), min(128, c.shape[1] - j), a.shape[1], 0.0)


def softmax_rows(x, out, rows, cols):
    r = global_id(0)
    if r < rows:
        m = x[r, 0]
        for j in range(1, cols):
            m = max(m, x[r, j])
        s = 0.0
        for j in range(cols):
            e = exp(x[r, j] - m)
            out[r, j] = e
            s += e
        for j in range(cols):
            out[r, j] = out[r, j] / s
'''
