"""What every kernel module here shares: its module on a device, choosing the stream,
flat/2-D views of buffers, grid sizes and op-code dispatch text. Nothing here launches:
each kernel module launches its own kernels (``module[grid, block](...)``, the runtime's
one launch path, runtime/launch.py).

Each distinct (kernel, argument dtypes) costs the firmware a numba compile of seconds on
first use, so the library has few kernels, most of them choosing their operation by an
int scalar (``op``) that is uniform across the launch; :func:`dispatch` writes that
``if op == ...: elif ...`` chain from a table so that no two kernels repeat it by hand.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Union

import numpy as np

import runtime

Array = Union[runtime.DeviceArray, runtime.DeviceView]

#: threads per block of the one-thread-per-element kernels and of the block reductions
BLOCK = 256
#: the most threads of a plane kernel's block (a tile of whole output rows, :func:`plane_tile`)
PLANE_BLOCK = 1024
#: the fewest threads worth a plane kernel's block
PLANE_MIN = 32


class Launch(NamedTuple):
    """A kernel launch as its arguments, before it is queued: what a kernel function
    launches (``binary``, ``softmax_rows``, ...), and what the torch backend's launch plans
    are made from (ops/_plans.py), so the two cannot differ."""

    kernel: runtime.Kernel
    grid: Any
    block: Any
    args: tuple[Any, ...]

    def __call__(self, stream: runtime.Stream | None) -> None:
        self.kernel[self.grid, self.block](*self.args, stream=stream)

    def plan(self) -> runtime.LaunchPlan:
        return self.kernel.plan(self.grid, self.block, self.args)


def module(name: str, source: str, device: int) -> runtime.Module:
    """The module ``name`` compiled from ``source``, loaded once on ``device``: a part of
    the runtime's hold on the device (``runtime.devices.Device.part``), as the runtime
    keeps its own ``@runtime.kernel`` modules, so it goes with the device's primary
    context and a recovered device loads it again. (The firmware compiles each kernel
    when it is first launched with new argument dtypes.)"""
    return runtime.devices.get(device).part(
        ("torch_accel", name), lambda: runtime.compile(source, device=device))


def stream_of(arr: Array, stream: runtime.Stream | None) -> runtime.Stream:
    """The stream to launch on: the given one, else the current stream of ``arr``'s device."""
    return stream if stream is not None else runtime.current_stream(arr.device)


def size(arr: Array) -> int:
    """Number of elements."""
    return int(np.prod(arr.shape, dtype=np.int64)) if arr.shape else 1


def flat(arr: Array, dtype: np.dtype | str | None = None) -> runtime.DeviceView:
    """``arr``'s bytes as a 1-D array (of ``dtype``, default its own): the elementwise
    kernels index flat buffers, and a launch checks each buffer's number of dimensions."""
    dt = np.dtype(dtype) if dtype is not None else arr.dtype
    return arr.view(dt, (arr.nbytes // dt.itemsize,), 0)


def matrix(arr: Array, rows: int, cols: int) -> runtime.DeviceView:
    """The first ``rows * cols`` elements of ``arr`` as a C-order ``[rows, cols]`` array:
    2-D indexing checks each index against its own extent (a column past ``cols`` faults
    even where the flat element would exist)."""
    return arr.view(arr.dtype, (rows, cols), 0)


def grid(n: int, block: int = BLOCK) -> int:
    """Blocks for one thread per element (at least one)."""
    return max(1, -(-n // block))


def as_bytes_if_bool(arr: Array) -> Array:
    """A bool buffer as uint8 (same bytes, 0 or 1): bool kernels are the uint8 kernels,
    which saves a compile per kernel and avoids numba's arithmetic on booleans."""
    return flat(arr, np.uint8) if arr.dtype == np.bool_ else arr


def scalar(value: float | int | bool, dtype: np.dtype) -> np.generic:
    """``value`` as a numpy scalar of the kernel's compute type for ``dtype``: float64 for
    floats, int64 for signed ints and bool, uint64 for uint64 (numba types ``uint64 op
    int64`` as float64, which would round large values)."""
    dtype = np.dtype(dtype)
    if dtype.kind == "f":  # rounded to the buffer's dtype first, as torch casts a scalar
        return np.float64(dtype.type(value))
    if dtype == np.uint64:
        return np.uint64(int(value) & (2**64 - 1))
    return np.int64(int(value))


def kind(dtype: np.dtype) -> str:
    """``"f"`` for float dtypes, ``"i"`` for integers and bool: the two variants of each
    op-code kernel (operations such as ``~`` or ``&`` do not type on floats)."""
    return "f" if np.dtype(dtype).kind == "f" else "i"


def dispatch(ops: Mapping[int, str], indent: str, var: str = "op") -> str:
    """``if op == k: <statement>`` / ``elif`` lines for each op code and its statement
    (one line of kernel source, possibly several joined by newlines at ``indent``)."""
    lines = []
    for i, (code, stmt) in enumerate(ops.items()):
        lines.append(f"{indent}{'if' if i == 0 else 'elif'} {var} == {int(code)}:")
        lines += [f"{indent}    {s}" for s in stmt.split("\n")]
    return "\n".join(lines)


def dispatch_store(ops: Mapping[int, str], indent: str, init: str, var: str = "op") -> str:
    """:func:`dispatch` of statements that each end in ``out[i] = <value>``, as one
    store after the chain: each op sets ``_r`` (first ``init``) and ``out[i] = _r``
    follows. The firmware's checked variant of a kernel checks each store, so one store
    instead of one per op cut ``unary_f``'s first compile from 5.8 s to 3.8 s (CPU, same
    run). Only for chains whose values unify without loss in numba (floats, bools): an
    int64 and a uint64 branch unify to float64."""
    body = {}
    for code, stmt in ops.items():
        if "out[i] = " not in stmt:
            raise ValueError(f"op {int(code)} stores no out[i]: {stmt!r}")
        body[code] = stmt.replace("out[i] = ", "_r = ")
    return f"{indent}_r = {init}\n{dispatch(body, indent, var)}\n{indent}out[i] = _r"


def check_same(*arrays: Array) -> None:
    """Refuse arrays of different dtypes where a kernel needs one dtype."""
    dts = {a.dtype for a in arrays}
    if len(dts) != 1:
        raise TypeError(f"expected one dtype, got {sorted(str(d) for d in dts)}")


def block_tree(part: str, combine: str, indent: str = "    ") -> str:
    """Kernel text combining the 256-entry shared array ``part`` (each thread has stored
    its value at ``part[t]``, ``t = local_id(0)``) into ``part[0]``, which every thread
    may then read. ``combine`` is an expression of ``{a}`` and ``{b}`` (``{a} + {b}``).
    Thread 0 walks the 256 values: one phase, where a barrier tree is eight, each a numba
    function of its own to compile (seconds), for a few hundred nanoseconds per block."""
    c = combine.format(a="_acc", b=f"{part}[_q]")
    return "\n".join(f"{indent}{s}" for s in (
        "barrier()", "if t == 0:", f"    _acc = {part}[0]", "    for _q in range(1, 256):",
        f"        _acc = {c}", f"    {part}[0] = _acc", "barrier()"))


def plane_tile(planes: int, out_spatial: Sequence[int],
               device: int) -> tuple[int, int, int] | None:
    """The block (x, y, z threads: output columns, rows, planes) of a *plane kernel*, or
    None where one does not serve. A plane kernel gives a thread one position of a 2-D
    output plane (``[planes, OH, OW]``, a plane being a batch element or a channel of
    one) and indexes each dimension of its buffers on its own by the thread ids, so that
    every index is affine in them: the firmware then range-checks a block's accesses
    once and runs its threads as one vector loop (docs/kernels.md, "Vectorised phases").

    Whole rows, as many as divide the plane's height and fit :data:`PLANE_BLOCK` threads
    (or the device's limit, if lower), then as many planes as divide their number and
    fit, so the blocks tile the output exactly (a block reaching past it would fail its
    range check and run the slow checked loop) and each phase of a block runs as many
    threads as it can (a phase costs a range check and a call besides its threads:
    LeNet's second convolution, 10 x 10 outputs, unfolded in 0.55 against 0.67 ms with 8
    batch elements a block instead of 1). None for a row wider than a block, or a tile
    under :data:`PLANE_MIN` threads, whose blocks would cost more than their work."""
    oh, ow = out_spatial
    limit = min(PLANE_BLOCK, runtime.devices.get(device).part(
        ("torch_accel", "max_threads_per_block"),
        lambda: runtime.get_device_properties(device).max_threads_per_block))
    if not 0 < ow <= limit or oh <= 0 or planes <= 0:
        return None
    rows = _largest_divisor(oh, limit // ow)
    per_block = _largest_divisor(planes, limit // (ow * rows))
    return (ow, rows, per_block) if ow * rows * per_block >= PLANE_MIN else None


def _largest_divisor(n: int, at_most: int) -> int:
    return max(d for d in range(1, min(n, at_most) + 1) if n % d == 0)


def plane_grid(planes: int, out_spatial: Sequence[int],
               tile: tuple[int, int, int]) -> tuple[int, int, int]:
    """The grid of :func:`plane_tile`'s blocks over ``[planes, *out_spatial]``."""
    return (out_spatial[1] // tile[0], out_spatial[0] // tile[1], planes // tile[2])


def shaped(arr: Array, shape: Sequence[int]) -> runtime.DeviceView:
    """``arr``'s first elements as a C-order array of ``shape``: a plane kernel indexes
    each dimension on its own."""
    return arr.view(arr.dtype, tuple(shape), 0)
