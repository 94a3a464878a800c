"""Modules and launches: ``runtime.compile(src)`` and ``module.name[grid, block](*args)``.

``compile`` runs the front end (:mod:`runtime.kernels`: validation, the module IR), then
loads the module on a device: the IR goes to the driver in a sealed, immutable memfd, the
driver checks target and capabilities, the firmware validates and JIT-compiles it. A launch
checks its arguments against the kernel's parameters and the device's limits on the host,
queues one LAUNCH packet with its argument block (docs/kernels.md "Launch ABI"), which the
stream places in its argument arena (runtime/stream.py ``ArgArena``): no driver call. Kernel handles belong to the context that loaded them.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import struct
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from abi import kernel_lang, uapi, userq
from runtime import devices as _device
from runtime import _trace, arg_packer, errors
from runtime.arg_packer import Param
from runtime._shm import sealed_memfd
from runtime.memory import DeviceArray, HostArray
from runtime.stream import LONG_ARGS, ArgLaunch, Stream, current_stream

#: launch shapes a kernel remembers as checked (Kernel._config)
CONFIGS = 64
_FLOAT64_CODE = kernel_lang.DTYPE_CODES["float64"]
_BUFFER_RECORD = userq.ARG_RECORD.pack


def _dims(value: int | Sequence[int], what: str) -> tuple[int, int, int]:
    if type(value) is int and 1 <= value < 1 << 21:  # the common case, without the tuples
        return value, 1, 1
    dims = (value,) if isinstance(value, (int, np.integer)) else tuple(value)
    if not 1 <= len(dims) <= 3 or any(not isinstance(d, (int, np.integer)) or d < 1
                                      or d >= 1 << 21 for d in dims):
        raise errors.InvalidValueError(f"{what} must be 1 to 3 positive ints below 2**21, "
                                       f"got {value!r}")
    return tuple(int(d) for d in (*dims, 1, 1)[:3])  # type: ignore[return-value]


def _plain(dims: Any) -> bool:
    """An int or a tuple of ints: a shape that cannot change after it was checked (a list
    can, and a numpy integer hashes like an int of the same value anyway)."""
    return type(dims) is int or (type(dims) is tuple and all(type(d) is int for d in dims))


@functools.lru_cache(maxsize=1024)
def _buffer_tail(dtype: np.dtype, shape: tuple[int, ...]) -> tuple[str, int, int, bytes]:
    """(dtype name, dtype code, byte size, packed shape records) of a buffer: the same few
    dtypes and shapes recur launch after launch, and dtype.name, np.prod and packing the
    records cost more than the rest of a launch's argument checks."""
    code = kernel_lang.DTYPE_CODES[dtype.name]
    nbytes = int(np.prod(shape)) * dtype.itemsize
    dims = [int(d) for d in shape] if shape else [1]
    out = []
    for i in range(0, len(dims), 2):
        pair = dims[i : i + 2]
        out.append(userq.ARG_RECORD.pack(userq.ARG_SHAPE, len(pair), pair[0],
                                         pair[1] if len(pair) > 1 else 0))
    return dtype.name, code, nbytes, b"".join(out)


def _buffer_records(va: int, dtype: np.dtype, shape: tuple[int, ...]) -> tuple[str, int, bytes]:
    """(dtype name, ndim, records) of a buffer argument: what ``_record_args`` caches on
    a device array (its address, dtype and shape never change)."""
    name, code, nbytes, tail = _buffer_tail(dtype, shape)
    return name, len(shape), _BUFFER_RECORD(userq.ARG_BUFFER, code, va, nbytes) + tail


class Kernel:
    """One kernel of a loaded module; ``kernel[grid, block](*args, stream=None)`` launches."""

    def __init__(self, module: Module, name: str, ir: dict[str, Any], handle: int) -> None:
        self.module, self.name, self.ir, self.handle = module, name, ir, handle
        self.params: list[dict[str, Any]] = ir["params"]
        self._layout = [Param.of(p) for p in self.params]
        self._pack = arg_packer.packer(self._layout, module.device, name)
        self._make_launcher = arg_packer.launcher_maker(self._layout, module.device, name)
        #: (grid, block) as written -> the checked, packed dimensions (_config)
        self._configs: dict[tuple[Any, Any], tuple[int, int]] = {}
        #: (grid, block) as written -> its launcher (__getitem__), for the same shapes
        self._launchers: dict[tuple[Any, Any], Callable[..., int]] = {}

    def __repr__(self) -> str:
        return f"<Kernel {self.name} on accel:{self.module.device}>"

    def __getitem__(self, config: tuple[Any, Any]) -> Callable[..., int]:
        try:
            return self._launchers[config]
        except (KeyError, TypeError):
            pass
        grid, block = config
        if not (_plain(grid) and _plain(block)):  # may change after a check: launch checks
            return functools.partial(self._launch_args, grid, block)
        launcher = self._launcher(grid, block)
        if len(self._launchers) < CONFIGS:
            self._launchers[config] = launcher
        return launcher

    def plan(self, grid: Any, block: Any, args: Sequence[Any]) -> LaunchPlan:
        """This launch checked once, to run again with other buffers (:class:`LaunchPlan`)."""
        return LaunchPlan(self, grid, block, args)

    def _launch_args(self, grid: Any, block: Any, *args: Any, stream: Stream | None = None,
                     shared_mem: int = 0) -> int:
        return self.launch(grid, block, args, stream, shared_mem)

    def _launcher(self, grid: Any, block: Any) -> Callable[..., int]:
        """``kernel[grid, block]`` for a shape that cannot change: a launch with no
        dynamic shared memory, on a stream of the kernel's device that captures nothing,
        whose arguments the packer takes (the common case of every launch after a
        program's first), goes from the generated launcher
        (:func:`runtime.arg_packer.launcher_maker`) straight to the stream's
        ``_write_launch`` with this shape's packet for its block's length, made once, as
        :meth:`launch` ends too; anything else is
        :meth:`launch`, which checks and says why. The same checks either way; the
        figures are in docs/kernels.md ("Seventh round")."""
        return self._make_launcher(grid, block, self.launch, lambda n: self._packet(
            *self._config(grid, block), 0, n))

    def _config(self, grid: Any, block: Any) -> tuple[int, int]:
        """The packet words of a grid and block, checked against the device: a program
        launches a few shapes over and over, so a shape written as ints or tuples of ints
        is checked once (anything else, a list say, is checked every time)."""
        try:
            return self._configs[grid, block]
        except (KeyError, TypeError):
            pass
        g, b = _dims(grid, "grid"), _dims(block, "block")
        props = self.module.properties
        if b[0] * b[1] * b[2] > props.max_threads_per_block:
            raise errors.InvalidValueError(
                f"{self.name}: block of {b[0] * b[1] * b[2]} threads; accel:{self.module.device} "
                f"allows {props.max_threads_per_block}")
        words = userq.pack_dims(g), userq.pack_dims(b)
        if _plain(grid) and _plain(block) and len(self._configs) < CONFIGS:
            self._configs[grid, block] = words
        return words

    def _record_args(self, args: Sequence[Any]) -> bytes:
        """The argument block of ``args``. Every argument is checked against its
        parameter on every launch: the common cases by the kernel's packer
        (:mod:`runtime.arg_packer`), anything else here, raising saying why."""
        raw = self._pack(args)
        if raw is None:
            layout = self._layout
            if len(args) != len(layout):
                names = ", ".join(p.name for p in layout)
                raise errors.InvalidValueError(f"{self.name} takes {len(layout)} arguments "
                                               f"({names}), got {len(args)}")
            raw = b"".join([self._buffer_arg(p, v) if p.buffer else self._scalar_arg(p, v)
                            for p, v in zip(layout, args)])
        if len(raw) > LONG_ARGS:
            raise errors.InvalidValueError(f"{self.name}: too many or too large arguments")
        return raw

    def _buffer_arg(self, p: Param, value: Any) -> bytes:
        """A buffer's records, checked against the parameter. What depends only on its
        address, dtype and shape is computed once (a device array keeps it, for the
        packer: ``_launch_record``; the rest share :func:`_buffer_tail`)."""
        if isinstance(value, DeviceArray):
            if value._allocator.closed is not None:
                raise value.dropped()
            if value.device != self.module.device:
                raise errors.InvalidValueError(
                    f"{self.name}: argument {p.name} lives on accel:{value.device}, the "
                    f"kernel runs on accel:{self.module.device}")
            if type(value) in arg_packer.RECORDED:
                try:
                    name, ndim, record = value._launch_record
                except AttributeError:  # its first launch
                    name, ndim, record = value._launch_record = _buffer_records(
                        value.va, value.dtype, value.shape)
            else:
                name, ndim, record = _buffer_records(value.va, value.dtype, value.shape)
        elif isinstance(value, HostArray) and value._accel is not None:
            name, ndim, record = _buffer_records(value.device_va, value.dtype, value.shape)
        else:
            raise errors.InvalidValueError(
                f"{self.name}: argument {p.name} must be a device array (or pinned or "
                f"managed memory), got {type(value).__name__}")
        if p.dtype is not None and name != p.dtype:
            raise errors.InvalidValueError(f"{self.name}: argument {p.name} must be "
                                           f"{p.dtype}, got {name}")
        if p.ndim not in (None, ndim):
            raise errors.InvalidValueError(f"{self.name}: argument {p.name} must have "
                                           f"{p.ndim} dimensions, got {ndim}")
        return record

    def _scalar_arg(self, p: Param, value: Any) -> bytes:
        """A scalar's record. A numpy scalar of exactly the parameter's type (or of any
        launch-ABI type, for an untyped parameter) is its own bytes; anything else converts
        through numpy (which rounds and range-checks)."""
        code = arg_packer.SCALAR_CODES.get(type(value)) if p.dtype is None else \
            (p.code if type(value) is p.scalar_type else None)
        if code is not None:
            if value == value:
                return userq.ARG_SCALAR_RECORDS[code].pack(userq.ARG_SCALAR, code, value, 0)
            # a NaN keeps its bits (packing goes through a C double, which would quiet a
            # signalling NaN)
            bits = int.from_bytes(value.tobytes(), "little")
            return userq.ARG_RECORD.pack(userq.ARG_SCALAR, code, bits, 0)
        # A Python int for an integer parameter (what a framework passes for sizes, strides
        # and op codes): its two's-complement bits, without a numpy array per argument
        # (~5 us each). Out of range goes on to numpy, which says so.
        if type(value) is int:
            (lo, hi, mask), code = (p.int_range, p.code) if p.int_range is not None else \
                (arg_packer.INT64_RANGE, arg_packer.INT64_CODE) if p.dtype is None \
                else ((1, 0, 0), 0)
            if lo <= value <= hi:
                return userq.ARG_RECORD.pack(userq.ARG_SCALAR, code, value & mask, 0)
        if type(value) is float and p.dtype in (None, "float64"):
            return userq.ARG_RECORD.pack(userq.ARG_SCALAR, _FLOAT64_CODE,
                                         int.from_bytes(struct.pack("<d", value), "little"), 0)
        if not isinstance(value, (int, float, bool, np.number, np.bool_)):
            raise errors.InvalidValueError(f"{self.name}: argument {p.name} must be a "
                                           f"number, got {type(value).__name__}")
        dtype = np.dtype(p.dtype) if p.dtype else (np.dtype(value.dtype) if isinstance(
            value, (np.number, np.bool_)) else np.dtype(type(value)))
        bits = int.from_bytes(np.array(value, dtype).tobytes().ljust(8, b"\0"), "little")
        return userq.ARG_RECORD.pack(userq.ARG_SCALAR, kernel_lang.DTYPE_CODES[dtype.name], bits, 0)

    def launch(self, grid: Any, block: Any, args: Sequence[Any], stream: Stream | None = None,
               shared_mem: int = 0) -> int:
        """Queue the launch; return its seqno on the stream. The hot path of a framework
        (an operator is a launch): a few calls, each check made once."""
        if (rec := _trace.active) is not None and rec.outermost():
            return rec.call("Kernel.launch", {"kernel": self.name}, self.launch, grid, block,
                            args, stream, shared_mem)
        try:
            g, b = self._configs[grid, block]
        except (KeyError, TypeError):
            g, b = self._config(grid, block)
        if type(shared_mem) is not int or shared_mem != 0:
            self._check_shared_mem(shared_mem)
        device = self.module.device
        s = stream or current_stream(device)
        if s.device != device:
            raise errors.InvalidValueError(f"{self.name}: stream is on accel:{s.device}")
        raw = self._record_args(args)
        pkt = self._packet(g, b, int(shared_mem), len(raw))
        if s.capturing is not None:  # a replay writes the block in its stream's arena
            uses = [v for p, v in zip(self._layout, args) if p.buffer]
            return s.submit([ArgLaunch(pkt, raw)], uses=uses)
        return s._write_launch(pkt, raw)

    def _check_shared_mem(self, shared_mem: Any) -> None:
        """Dynamic shared bytes: an int, not negative, within the device's per-block limit
        on top of the kernel's static bytes (the static bytes alone were checked at
        load)."""
        static = self.ir.get("shared_mem", 0)
        limit = self.module.properties.max_shared_mem_per_block
        if not isinstance(shared_mem, (int, np.integer)) or isinstance(shared_mem, bool) \
                or shared_mem < 0 or static + shared_mem > limit:
            raise errors.InvalidValueError(
                f"{self.name}: shared_mem={shared_mem!r} dynamic bytes per block on top of its "
                f"{static} static bytes; accel:{self.module.device} allows {limit} per block")

    def _packet(self, grid: int, block: int, dynamic: int, length: int) -> bytes:
        """The LAUNCH packet's 64 bytes (grid and block as packed words), naming no
        address: the stream's arena places its block (``ArgArena.write``)."""
        return userq.Launch(self.handle, grid, block, dynamic, 0, length).encode()


class LaunchPlan:
    """One launch of a kernel checked once, for launching again and again with only its
    buffers' addresses new: what a framework's eager operator needs, whose kernel, grid,
    scalars, dtypes and shapes repeat op after op while its output is a fresh allocation
    (``Kernel.plan``). A call takes, for each buffer parameter in order, a device array
    (an allocation, not a view) and a byte offset into it, and checks only what can
    change: the array is of the kernel's device and not freed, and the window of the
    planned dtype and shape at that offset lies inside it. The argument block is then the
    planned one with the addresses in place, written by the stream's arena like any
    launch's (``Stream._write_launch``); a capturing stream, a profiler or another device's
    stream take ``Kernel.launch`` on views of the same windows instead, which decides.
    A plan belongs to its kernel's module: after a reset it fails as the module does."""

    __slots__ = ("kernel", "grid", "block", "device", "_args", "_buffers", "_pieces",
                 "_block", "_packet")

    def __init__(self, kernel: Kernel, grid: Any, block: Any, args: Sequence[Any]) -> None:
        if not (_plain(grid) and _plain(block)):
            raise errors.InvalidValueError("a launch plan's grid and block must be ints or "
                                           "tuples of ints")
        raw = kernel._record_args(args)  # every argument checked, as a launch checks them
        self.kernel, self.grid, self.block = kernel, grid, block
        self.device = kernel.module.device
        #: the scalars; a buffer's place is None (holding the first call's arrays would
        #: keep their memory from the allocator for as long as the plan lives)
        self._args = [None if p.buffer else v for p, v in zip(kernel._layout, args)]
        #: per buffer parameter: (its position in args, dtype, shape, bytes)
        self._buffers: list[tuple[int, np.dtype, tuple[int, ...], int]] = []
        #: the block is the bytes around the buffers' addresses, the addresses between
        #: them: ``_block.pack(*_pieces)`` with each address (odd places) filled in, one C
        #: call instead of a record packed and two concatenations per buffer
        pieces: list[Any] = []
        piece, at = b"", userq.ARG_RECORD_VALUE_AT
        for i, (p, v) in enumerate(zip(kernel._layout, args)):
            if not p.buffer:
                piece += kernel._scalar_arg(p, v)
                continue
            shape = tuple(v.shape)
            _, code, nbytes, tail = _buffer_tail(v.dtype, shape)
            self._buffers.append((i, v.dtype, shape, nbytes))
            record = _BUFFER_RECORD(userq.ARG_BUFFER, code, 0, nbytes)
            pieces += (piece + record[:at], 0)
            piece = record[at + 8:] + tail
        pieces.append(piece)
        self._pieces = pieces
        self._block = userq.arg_block_struct([len(run) for run in pieces[::2]])
        assert self._block.size == len(raw)
        self._packet = kernel._packet(*kernel._config(grid, block), 0, len(raw))

    def __call__(self, buffers: Sequence[tuple[DeviceArray, int]],
                 stream: Stream | None = None) -> int:
        """Queue the launch with ``buffers`` (``(array, byte offset)`` per buffer
        parameter); return its seqno on the stream."""
        device = self.device
        planned = self._buffers
        if len(buffers) != len(planned):
            return self._checked(buffers, stream)
        pieces = self._pieces.copy()
        j = 1
        for (base, off), (_, _, _, nbytes) in zip(buffers, planned):
            if type(base) is not DeviceArray or base.device != device \
                    or base._allocator.closed is not None or not 0 <= off <= base.nbytes - nbytes:
                return self._checked(buffers, stream)
            pieces[j] = base.va + off
            j += 2
        s = current_stream(device) if stream is None else stream
        if s.device != device or s.capturing is not None or _trace.active is not None:
            return self._checked(buffers, stream)
        return s._write_launch(self._packet, self._block.pack(*pieces))

    def _checked(self, buffers: Sequence[tuple[Any, int]], stream: Stream | None) -> int:
        """The launch through ``Kernel.launch`` on views of the buffers' windows: it checks
        every argument and says why one is wrong, records a capture, shows a profiler."""
        if len(buffers) != len(self._buffers):
            raise errors.InvalidValueError(f"{self.kernel.name}: its plan takes "
                                           f"{len(self._buffers)} buffers, got {len(buffers)}")
        args = list(self._args)
        for (base, off), (i, dtype, shape, _) in zip(buffers, self._buffers):
            if not isinstance(base, DeviceArray):
                raise errors.InvalidValueError(f"{self.kernel.name}: a plan's buffer must be "
                                               f"a device array, got {type(base).__name__}")
            args[i] = base.view(dtype, shape, off)
        return self.kernel.launch(self.grid, self.block, args, stream)


class Module:
    """A device module loaded on one device (through this process's primary context)."""

    def __init__(self, ir: dict[str, Any], device: _device.DeviceLike = None) -> None:
        self.device = _device._index(device)
        self.ir = ir
        self.properties = _device.get_device_properties(self.device)
        ctx = _device.primary_context(self.device)
        raw = json.dumps(ir, sort_keys=True).encode()
        if len(raw) > uapi.ACCEL_MODULE_MAX:
            raise errors.InvalidValueError(f"module of {len(raw)} bytes; the driver takes at "
                                           f"most {uapi.ACCEL_MODULE_MAX}")
        image = sealed_memfd("module", len(raw), raw)
        try:
            reply = ctx.channel.call(uapi.ACCEL_CMD_MODULE_LOAD, uapi.accel_module_load(
                ctx_id=ctx.id, fd=image, size=len(raw)))
        except errors.FirmwareCorruptError as exc:  # ENOEXEC here: a module for another target
            raise errors.InvalidValueError(f"module not loadable on accel:{self.device}: "
                                           "built for another instruction set", exc.errno) from None
        except errors.AccelError as exc:  # EOPNOTSUPP: a kernel needs a missing capability
            if exc.errno != errno.EOPNOTSUPP:
                raise
            have = self.properties.capabilities
            needs = [f"{name} needs {cap}" for name, k in ir["kernels"].items()
                     for flag, cap in kernel_lang.KERNEL_FLAG_CAPS if k.get(flag) and cap not in have]
            raise errors.InvalidValueError(f"module not loadable on accel:{self.device}: "
                                           f"{'; '.join(needs) or exc}", exc.errno) from None
        finally:
            os.close(image)
        self.id: int = reply.module_id
        self._ctx = ctx
        self._kernels: dict[str, Kernel] = {}

    def __getattr__(self, name: str) -> Kernel:
        if name.startswith("_"):
            raise AttributeError(name)
        return self.get_kernel(name)

    def get_kernel(self, name: str) -> Kernel:
        k = self._kernels.get(name)
        if k is None:
            if name not in self.ir["kernels"]:
                raise errors.InvalidValueError(f"module has no kernel {name!r} (it has "
                                               f"{', '.join(self.ir['kernels'])})")
            reply = self._ctx.channel.call(uapi.ACCEL_CMD_KERNEL_GET, uapi.accel_kernel_get(
                ctx_id=self._ctx.id, module_id=self.id, name=name.encode()))
            k = self._kernels[name] = Kernel(self, name, self.ir["kernels"][name], reply.handle)
            self._ctx.kernel_names[reply.handle] = name
            self._ctx.kernel_irs[reply.handle] = k.ir
            if not name.startswith("_") and name not in vars(self) \
                    and not hasattr(type(self), name):
                # ``module.name`` from now on without __getattr__ (a failed lookup first:
                # ~2 us, more than the rest of a small launch's checks)
                setattr(self, name, k)
        return k

    @property
    def kernels(self) -> list[str]:
        return list(self.ir["kernels"])


def compile(source_or_function: Any, device: _device.DeviceLike = None) -> Module:  # noqa: A001
    """Compile kernel source (or functions) to a module and load it on ``device``."""
    from runtime.kernels import compile_module

    return Module(compile_module(source_or_function), device)


class kernel:  # noqa: N801 - a decorator, named like torch's and numba's
    """``@runtime.kernel``: compile on first launch, per device; then ``f[grid, block](...)``."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.name = fn.__name__
        self._ir: dict[str, Any] | None = None
        self._lock = threading.Lock()

    def _kernel(self, device: int) -> Kernel:
        """Compiled once per process, loaded once per device (a part of its Device)."""
        with self._lock:
            if self._ir is None:
                from runtime.kernels import compile_module

                self._ir = compile_module(self.fn)
        ir = self._ir
        mod = _device.get(device).part(("kernel", self), lambda: Module(ir, device))
        return mod.get_kernel(self.name)

    def __getitem__(self, config: tuple[Any, Any]) -> Callable[..., int]:
        grid, block = config

        def launch(*args: Any, stream: Stream | None = None, shared_mem: int = 0) -> int:
            dev = stream.device if stream is not None else _device.current_device()
            return self._kernel(dev).launch(grid, block, args, stream, shared_mem)
        return launch
