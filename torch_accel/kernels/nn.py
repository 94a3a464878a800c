"""Neural-network kernels an MLP's forward and autograd need: softmax / log_softmax rows
and their backward, activation backwards, embedding gather/scatter (``index_rows`` /
``index_add_rows``) and the NLL loss (cross_entropy = log_softmax + nll_loss).

Row kernels run one block of 256 threads per row with float64 partial sums in shared
memory. Indexed accesses use 2-D buffers, so an index outside its row range faults the
stream through the firmware's per-dimension bounds check (no check written here).
"""

from __future__ import annotations

import enum

import numpy as np

import runtime
from torch_accel.kernels import _shared as shared
from torch_accel.kernels._shared import Array, Launch
from torch_accel.kernels.elementwise import erf_source, fill


class Backward(enum.IntEnum):
    """``activation_backward`` op codes (``x`` is the forward input or, where noted, its
    output ``y``)."""

    threshold = 0  # grad where x > p0 else 0 (relu: p0 = 0)
    gelu = 1
    gelu_tanh = 2
    sigmoid = 3  # from y
    tanh = 4  # from y
    silu = 5


class Reduction(enum.IntEnum):
    """``nll_loss`` reductions, numbered as torch's ``reduction`` enum."""

    none = 0
    mean = 1
    sum = 2


_BACKWARD = {
    Backward.threshold: "out[i] = g if v > p0 else 0",
    Backward.gelu: erf_source("v * 0.7071067811865476", "e")
    + "\nout[i] = g * (0.5 * (1.0 + e) + v * exp(-0.5 * v * v) * 0.3989422804014327)",
    Backward.gelu_tanh: "th = tanh(0.7978845608028654 * (v + 0.044715 * v * v * v))\n"
                        "out[i] = g * (0.5 * (1.0 + th) + 0.5 * v * (1.0 - th * th) * "
                        "0.7978845608028654 * (1.0 + 0.134145 * v * v))",
    Backward.sigmoid: "out[i] = g * v * (1.0 - v)",
    Backward.tanh: "out[i] = g * (1.0 - v * v)",
    Backward.silu: "sg = 1.0 / (1.0 + exp(-v))\nout[i] = g * sg * (1.0 + v * (1.0 - sg))",
}

_ROW = """    part = shared_array(256, "float64")
    t = local_id(0)
    base = group_id(0) * n
"""

#: The backwards of a training step's common activations, in a lean loop-free kernel
#: (``activation_backward_hot``) that the firmware may run inline on its scheduler, as
#: elementwise.py's ``unary_hot_*``: gelu's erf loop put relu's backward on an engine at
#: ~5.6 ns an element (LeNet's 64x6x28x28: 1.7 ms) against ~1 ns for the lean kernels.
HOT_BACKWARD = frozenset({Backward.threshold, Backward.sigmoid, Backward.tanh,
                          Backward.silu})

_HOT_BACKWARD_OPS = {k: v for k, v in _BACKWARD.items() if k in HOT_BACKWARD}

_ACTIVATION_OPERANDS = """    i = global_id(0)
    if i < n:
        g = grad[i]
        v = x[i]
"""

SOURCE = f"""def activation_backward(out, grad, x, op: 'int64', p0, n: 'int64'):
{_ACTIVATION_OPERANDS}{shared.dispatch_store(_BACKWARD, " " * 8, "0.0")}


def activation_backward_hot(out, grad, x, op: 'int64', p0, n: 'int64'):
{_ACTIVATION_OPERANDS}{shared.dispatch_store(_HOT_BACKWARD_OPS, " " * 8, "0.0")}


def softmax(out, x, n: 'int64', logf: 'int64'):
{_ROW}    m = -1.0e300 * 1.0e300
    for j in range(t, n, 256):
        m = max(m, x[base + j])
    part[t] = m
{shared.block_tree("part", "max({a}, {b})")}
    mx = part[0]
    barrier()
    s = 0.0
    for j in range(t, n, 256):
        s += exp(x[base + j] - mx)
    part[t] = s
{shared.block_tree("part", "{a} + {b}")}
    tot = part[0]
    if logf != 0:
        lt = log(tot)
        for j in range(t, n, 256):
            out[base + j] = x[base + j] - mx - lt
    else:
        for j in range(t, n, 256):
            out[base + j] = exp(x[base + j] - mx) / tot


def softmax_backward(gi, g, y, n: 'int64', logf: 'int64'):
{_ROW}    s = 0.0
    for j in range(t, n, 256):
        if logf != 0:
            s += g[base + j]
        else:
            s += g[base + j] * y[base + j]
    part[t] = s
{shared.block_tree("part", "{a} + {b}")}
    tot = part[0]
    for j in range(t, n, 256):
        if logf != 0:
            gi[base + j] = g[base + j] - exp(y[base + j]) * tot
        else:
            gi[base + j] = y[base + j] * (g[base + j] - tot)


def softmax_short(out, x, rows: 'int64', n: 'int64', logf: 'int64'):
    r = global_id(0)
    if r < rows:
        base = r * n
        m = -1.0e300 * 1.0e300
        for j in range(n):
            m = max(m, x[base + j])
        s = 0.0
        for j in range(n):
            s += exp(x[base + j] - m)
        lt = log(s)
        for j in range(n):
            if logf != 0:
                out[base + j] = x[base + j] - m - lt
            else:
                out[base + j] = exp(x[base + j] - m) / s


def softmax_backward_short(gi, g, y, rows: 'int64', n: 'int64', logf: 'int64'):
    r = global_id(0)
    if r < rows:
        base = r * n
        s = 0.0
        for j in range(n):
            if logf != 0:
                s += g[base + j]
            else:
                s += g[base + j] * y[base + j]
        for j in range(n):
            if logf != 0:
                gi[base + j] = g[base + j] - exp(y[base + j]) * s
            else:
                gi[base + j] = y[base + j] * (g[base + j] - s)


def index_rows(out, weight, index, rows: 'int64', cols: 'int64'):
    i = global_id(0)
    if i < rows * cols:
        r = i // cols
        c = i % cols
        out[r, c] = weight[index[r], c]


def index_add_rows(out, index, src, rows: 'int64', cols: 'int64'):
    i = global_id(0)
    if i < rows * cols:
        r = i // cols
        c = i % cols
        atomic_add(out, (index[r], c), src[r, c])


def nll_loss(out, total, logp, target, rows: 'int64', reduction: 'int64', ignore: 'int64'):
    part = shared_array(256, "float64")
    cnt = shared_array(256, "float64")
    t = local_id(0)
    s = 0.0
    c = 0.0
    for r in range(t, rows, 256):
        tg = target[r]
        v = 0.0
        if tg != ignore:
            v = -logp[r, tg]
            s += v
            c += 1.0
        if reduction == 0:
            out[r] = v
    part[t] = s
    cnt[t] = c
{shared.block_tree("part", "{a} + {b}")}
{shared.block_tree("cnt", "{a} + {b}")}
    if t == 0:
        total[0] = cnt[0] if reduction != 0 else 0.0
        if reduction == 1:
            out[0] = part[0] / cnt[0]
        elif reduction == 2:
            out[0] = part[0]


def nll_loss_backward(grad, gout, target, rows: 'int64', n: 'int64', reduction: 'int64',
                      ignore: 'int64'):
    cnt = shared_array(256, "float64")
    t = local_id(0)
    c = 0.0
    for r in range(t, rows, 256):
        if target[r] != ignore:
            c += 1.0
    cnt[t] = c
{shared.block_tree("cnt", "{a} + {b}")}
    for r in range(t, rows, 256):
        tg = target[r]
        for j in range(n):
            grad[r, j] = 0.0
        if tg != ignore:
            if reduction == 0:
                grad[r, tg] = -gout[r]
            elif reduction == 1:
                grad[r, tg] = -gout[0] / cnt[0]
            else:
                grad[r, tg] = -gout[0]
"""


#: rows at most this long get a thread each (softmax and its backward): a 256-thread
#: block with its barrier phases per row of 10 classes (a classifier's logits) is mostly
#: block overhead
SHORT_ROW = 64
#: threads per block of the thread-per-row kernels: a batch of 64 rows still spreads
#: over the engines
SHORT_BLOCK = 32


def _mod(device: int) -> runtime.Module:
    return shared.module("nn", SOURCE, device)


def activation_backward_launch(op: Backward | str, out: Array, grad: Array, x: Array,
                               p0: float = 0.0) -> Launch | None:
    """The launch of :func:`activation_backward` (None: no elements)."""
    op = Backward[op] if isinstance(op, str) else Backward(op)
    shared.check_same(out, grad, x)
    n = shared.size(out)
    if not n:
        return None
    module = _mod(out.device)
    kernel = module.activation_backward_hot if op in HOT_BACKWARD else \
        module.activation_backward
    return Launch(kernel, shared.grid(n), shared.BLOCK, (
        shared.flat(out), shared.flat(grad), shared.flat(x), int(op),
        shared.scalar(p0, x.dtype), n))


def activation_backward(op: Backward | str, out: Array, grad: Array, x: Array,
                        p0: float = 0.0, stream: runtime.Stream | None = None) -> None:
    """``out = grad * d OP / dx`` elementwise (float buffers of one dtype)."""
    launch = activation_backward_launch(op, out, grad, x, p0)
    if launch is not None:
        launch(shared.stream_of(out, stream))


def threshold_backward(out: Array, grad: Array, x: Array, threshold: float,
                       stream: runtime.Stream | None = None) -> None:
    """relu's backward: ``grad`` where ``x > threshold``, else 0."""
    activation_backward(Backward.threshold, out, grad, x, threshold, stream)


def gelu_backward(out: Array, grad: Array, x: Array, approximate: str = "none",
                  stream: runtime.Stream | None = None) -> None:
    """gelu's backward, exact (``approximate="none"``) or of the tanh form."""
    op = Backward.gelu_tanh if approximate == "tanh" else Backward.gelu
    activation_backward(op, out, grad, x, 0.0, stream)


def sigmoid_backward(out: Array, grad: Array, y: Array,
                     stream: runtime.Stream | None = None) -> None:
    """From sigmoid's output ``y``: ``grad * y * (1 - y)``."""
    activation_backward(Backward.sigmoid, out, grad, y, 0.0, stream)


def tanh_backward(out: Array, grad: Array, y: Array,
                  stream: runtime.Stream | None = None) -> None:
    """From tanh's output ``y``: ``grad * (1 - y * y)``."""
    activation_backward(Backward.tanh, out, grad, y, 0.0, stream)


def _rows_launch(name: str, buffers: tuple[Array, ...], rows: int, n: int,
                 log: bool) -> Launch | None:
    """A softmax kernel over ``rows`` rows of ``n``: ``<name>_short`` a thread per row for
    rows of at most :data:`SHORT_ROW` elements, else ``<name>`` a block per row."""
    if not (rows and n):
        return None
    module = _mod(buffers[0].device)
    flat = tuple(shared.flat(b) for b in buffers)
    if n <= SHORT_ROW:
        return Launch(module.get_kernel(f"{name}_short"), shared.grid(rows, SHORT_BLOCK),
                      SHORT_BLOCK, (*flat, rows, n, int(log)))
    return Launch(module.get_kernel(name), rows, shared.BLOCK, (*flat, n, int(log)))


def softmax_rows_launch(out: Array, x: Array, rows: int, n: int,
                        log: bool = False) -> Launch | None:
    """The launch of :func:`softmax_rows` (None: no elements)."""
    return _rows_launch("softmax", (out, x), rows, n, log)


def softmax_rows(out: Array, x: Array, rows: int, n: int, log: bool = False,
                 stream: runtime.Stream | None = None) -> None:
    """Softmax (or log_softmax) of each row of a contiguous ``[rows, n]`` buffer: a block
    per row, or a thread per row for rows of at most :data:`SHORT_ROW` elements."""
    launch = softmax_rows_launch(out, x, rows, n, log)
    if launch is not None:
        launch(shared.stream_of(out, stream))


def softmax_backward_rows_launch(grad_in: Array, grad_out: Array, y: Array, rows: int,
                                 n: int, log: bool = False) -> Launch | None:
    """The launch of :func:`softmax_backward_rows` (None: no elements)."""
    return _rows_launch("softmax_backward", (grad_in, grad_out, y), rows, n, log)


def softmax_backward_rows(grad_in: Array, grad_out: Array, y: Array, rows: int, n: int,
                          log: bool = False, stream: runtime.Stream | None = None) -> None:
    """From the forward's output ``y``: ``y * (g - sum(g * y))``, or for log_softmax
    ``g - exp(y) * sum(g)``, per row."""
    launch = softmax_backward_rows_launch(grad_in, grad_out, y, rows, n, log)
    if launch is not None:
        launch(shared.stream_of(grad_in, stream))


def _rows_of(arr: Array, cols: int) -> int:
    return arr.nbytes // (arr.dtype.itemsize * cols) if cols else 0


def index_rows(out: Array, weight: Array, index: Array, rows_out: int, row_len: int,
               stream: runtime.Stream | None = None) -> None:
    """``out[r, :] = weight[index[r], :]`` (embedding, index_select on dim 0); an index
    outside ``weight``'s rows faults the stream. ``index`` is int64 (or int32)."""
    if rows_out and row_len:
        _mod(out.device).index_rows[shared.grid(rows_out * row_len), shared.BLOCK](
            shared.matrix(out, rows_out, row_len),
            shared.matrix(weight, _rows_of(weight, row_len), row_len), shared.flat(index), rows_out,
            row_len, stream=shared.stream_of(out, stream))


def index_add_rows(out: Array, index: Array, src: Array, rows_src: int, row_len: int,
                   stream: runtime.Stream | None = None) -> None:
    """``out[index[r], :] += src[r, :]`` with atomics (embedding backward; repeated
    indices accumulate). Int and float dtypes (the firmware's atomic_add has no bool);
    float sums are in an unspecified order."""
    if out.dtype == np.bool_:
        raise TypeError("index_add_rows: no atomic add on bool")
    if rows_src and row_len:
        _mod(out.device).index_add_rows[shared.grid(rows_src * row_len), shared.BLOCK](
            shared.matrix(out, _rows_of(out, row_len), row_len), shared.flat(index),
            shared.matrix(src, rows_src, row_len), rows_src, row_len,
            stream=shared.stream_of(out, stream))


def nll_loss_rows(out_loss: Array, logp: Array, target: Array, rows: int, n: int,
                  reduction: Reduction | str = Reduction.mean, ignore_index: int = -100,
                  stream: runtime.Stream | None = None, total: Array | None = None) -> None:
    """``-logp[r, target[r]]`` per row (0 where ``target == ignore_index``), into
    ``out_loss[rows]`` for reduction none, else into ``out_loss[0]`` summed (sum) or
    divided by the count of non-ignored targets (mean; NaN when all are ignored). One
    block: the batch's rows, not their classes, are the work. ``total[0]`` (one element
    of ``out_loss``'s dtype) gets that count, 0 for reduction none: torch's
    ``total_weight`` without class weights, in the same launch."""
    red = Reduction[reduction] if isinstance(reduction, str) else Reduction(reduction)
    s = shared.stream_of(out_loss, stream)
    if rows == 0:  # an empty batch (whose buffers no launch may name): torch's values
        if red != Reduction.none:
            fill(out_loss, np.nan if red == Reduction.mean else 0.0, s)
        if total is not None:
            fill(total, 0.0, s)
        return
    if total is None:
        total = runtime.empty(1, out_loss.dtype, device=out_loss.device, stream=s)
    nll_loss_launch(out_loss, total, logp, target, rows, n, red, ignore_index)(s)


def nll_loss_launch(out_loss: Array, total: Array, logp: Array, target: Array, rows: int,
                    n: int, reduction: Reduction, ignore_index: int) -> Launch:
    """The launch of :func:`nll_loss_rows` for a batch of ``rows`` > 0, ``total`` given."""
    return Launch(_mod(out_loss.device).nll_loss, 1, shared.BLOCK, (
        shared.flat(out_loss), shared.flat(total), shared.matrix(logp, rows, n),
        shared.flat(target), rows, int(reduction), ignore_index))


def nll_loss_backward_rows(grad_logp: Array, grad_out: Array, target: Array, rows: int,
                           n: int, reduction: Reduction | str = Reduction.mean,
                           ignore_index: int = -100,
                           stream: runtime.Stream | None = None) -> None:
    """``grad_logp`` (``[rows, n]``) zeroed, then ``-grad_out`` (per row for none, else
    ``grad_out[0]``, divided by the non-ignored count for mean) at each target; one
    launch, whose threads zero the rows they write (a fill before it was a launch of its
    own, a training step's cross-entropy backward had four)."""
    launch = nll_loss_backward_launch(grad_logp, grad_out, target, rows, n, reduction,
                                      ignore_index)
    if launch is not None:
        launch(shared.stream_of(grad_logp, stream))


def nll_loss_backward_launch(grad_logp: Array, grad_out: Array, target: Array, rows: int,
                             n: int, reduction: Reduction | str = Reduction.mean,
                             ignore_index: int = -100) -> Launch | None:
    """The launch of :func:`nll_loss_backward_rows` (None: an empty batch)."""
    red = Reduction[reduction] if isinstance(reduction, str) else Reduction(reduction)
    if rows == 0:
        return None
    return Launch(_mod(grad_logp.device).nll_loss_backward, 1, shared.BLOCK, (
        shared.matrix(grad_logp, rows, n), shared.flat(grad_out), shared.flat(target), rows,
        n, int(red), ignore_index))
