"""A kernel's argument packer: straight-line Python generated from its parameter list once.

A framework launches the same few kernels millions of times, so the checks of a launch's
arguments run millions of times too. A loop over the parameters asks of every argument,
on every launch, which kind of parameter it meets (buffer or scalar, typed or not); for a
two-argument kernel that loop cost ~1.0 us of a ~4.7 us launch call. The kernel's
parameters never change, so those questions are answered once here, in the source of a
function with one block per parameter; the same checks then take ~0.4 us. (Triton
generates its launchers per kernel signature for the same reason.)

The packer takes only the common cases, each producing exactly the bytes
``Kernel._record_args`` would:

* a device array or view on the kernel's device, not freed, whose records it keeps
  (``_launch_record``, set by ``_record_args`` on its first launch), of the parameter's
  dtype and number of dimensions where the parameter declares them;
* a numpy scalar of the parameter's type (of any launch-ABI type for an untyped one), not
  a NaN (``_record_args`` keeps a NaN's payload bits);
* a Python int within an integer parameter's range (int64's for an untyped one).

For anything else it returns None and the launch takes ``Kernel._record_args``, which
checks every argument and raises saying why: the packer never decides that an argument
is wrong, so it cannot disagree with the checked path about an error.

``kernel[grid, block]`` is a launcher made from the same checks (``launcher_maker``): the
packer's body inside the launch call itself, whose every "return None" hands the launch to
``Kernel.launch`` instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from abi import kernel_lang, userq
from runtime.memory import DeviceArray, DeviceView

#: the arguments whose records a launch keeps on them (``_launch_record``)
RECORDED = (DeviceArray, DeviceView)
#: numpy scalar type -> launch-ABI dtype code
SCALAR_CODES = {np.dtype(name).type: code for name, code in kernel_lang.DTYPE_CODES.items()}
INT64_CODE = kernel_lang.DTYPE_CODES["int64"]
#: (lowest, highest, mask of its width) of a Python int an untyped parameter takes
INT64_RANGE = (-(1 << 63), (1 << 63) - 1, (1 << 64) - 1)

Packer = Callable[[Sequence[Any]], "bytes | None"]


class Param(NamedTuple):
    """What a launch checks an argument against, read from the kernel's IR once (not per
    launch, per argument)."""

    name: str
    buffer: bool
    dtype: str | None
    ndim: int | None
    #: scalars with a declared dtype: its numpy scalar type and launch-ABI code
    scalar_type: type | None
    code: int
    #: declared integer scalars: the range a Python int must lie in to be packed directly,
    #: and the mask of its width (the record holds the dtype's little-endian bytes)
    int_range: tuple[int, int, int] | None

    @classmethod
    def of(cls, p: dict[str, Any]) -> Param:
        want = p.get("dtype")
        scalar = p["kind"] != "buffer" and want is not None
        ints = scalar and np.dtype(want).kind in "iu"
        return cls(p["name"], p["kind"] == "buffer", want, p.get("ndim"),
                   np.dtype(want).type if scalar else None,
                   kernel_lang.DTYPE_CODES[want] if scalar else 0,
                   (int(np.iinfo(want).min), int(np.iinfo(want).max),
                    (1 << np.iinfo(want).bits) - 1) if ints else None)


def _buffer(i: int, p: Param, fail: str) -> list[str]:
    checks = [f"type(a{i}) not in RECORDED", f"a{i}.device != DEVICE",
              f"a{i}._allocator.closed is not None"]
    lines = [f"    if {' or '.join(checks)}:", f"        {fail}",
             "    try:", f"        name{i}, ndim{i}, r{i} = a{i}._launch_record",
             "    except AttributeError:  # its first launch: _record_args records it",
             f"        {fail}"]
    wrong = ([f"name{i} != {p.dtype!r}"] if p.dtype is not None else []) + \
        ([f"ndim{i} != {p.ndim!r}"] if p.ndim is not None else [])
    if wrong:
        lines += [f"    if {' or '.join(wrong)}:", f"        {fail}"]
    return lines


def _scalar(i: int, p: Param, env: dict[str, Any], fail: str) -> list[str]:
    a = f"a{i}"
    if p.dtype is None:  # any launch-ABI numpy scalar as itself, an int as an int64
        lines = [f"    c{i} = SCALAR_CODES.get(type({a}))",
                 f"    if c{i} is not None and {a} == {a}:",
                 f"        r{i} = SCALAR_RECORDS[c{i}].pack(ARG_SCALAR, c{i}, {a}, 0)"]
        lo, hi, mask = INT64_RANGE
        code = INT64_CODE
    else:
        env[f"T{i}"], env[f"PACK{i}"] = p.scalar_type, userq.ARG_SCALAR_RECORDS[p.code].pack
        lines = [f"    if type({a}) is T{i} and {a} == {a}:",
                 f"        r{i} = PACK{i}(ARG_SCALAR, {p.code}, {a}, 0)"]
        if p.int_range is None:
            return [*lines, "    else:", f"        {fail}"]
        (lo, hi, mask), code = p.int_range, p.code
    return [*lines, f"    elif type({a}) is int and {lo} <= {a} <= {hi}:",
            f"        r{i} = RECORD(ARG_SCALAR, {code}, {a} & {mask}, 0)",
            "    else:", f"        {fail}"]


def _checks(params: Sequence[Param], env: dict[str, Any], fail: str) -> list[str]:
    """The body that checks arguments ``a0``, ``a1``, ... and packs their records ``r0``,
    ``r1``, ...; ``fail`` is the statement for anything the checked path must decide."""
    lines: list[str] = []
    for i, p in enumerate(params):
        lines += _buffer(i, p, fail) if p.buffer else _scalar(i, p, env, fail)
    return lines


def _env(device: int) -> dict[str, Any]:
    return {"RECORDED": RECORDED, "DEVICE": device, "SCALAR_CODES": SCALAR_CODES,
            "SCALAR_RECORDS": userq.ARG_SCALAR_RECORDS, "RECORD": userq.ARG_RECORD.pack,
            "ARG_SCALAR": userq.ARG_SCALAR}


def _define(lines: list[str], env: dict[str, Any], fn: str, what: str, name: str) -> Any:
    """Function ``fn`` of the generated source ``lines`` (``what`` of kernel ``name``, as
    tracebacks show it)."""
    code = compile("\n".join(lines) + "\n", f"<{what} of {name}>", "exec")
    exec(code, env)  # noqa: S102 - our own source, built from the parameter list
    return env[fn]


def packer(params: Sequence[Param], device: int, name: str) -> Packer:
    """The packer of a kernel with ``params`` on ``device``: its argument block as
    ``Kernel._record_args`` builds it, or None where that path must decide."""
    env = _env(device)
    n = len(params)
    lines = ["def pack(args):", f"    if len(args) != {n}:", "        return None"]
    if n:
        lines.append(f"    {''.join(f'a{i}, ' for i in range(n))}= args")
    lines += _checks(params, env, "return None")
    lines.append(f"    return {' + '.join(f'r{i}' for i in range(n)) or repr(b'')}")
    return _define(lines, env, "pack", "argument packer", name)  # type: ignore[no-any-return]


#: ``make(grid, block, launch, packet_for)``: the launcher of ``kernel[grid, block]``
LauncherMaker = Callable[[Any, Any, Callable[..., int], Callable[[int], bytes]],
                         Callable[..., int]]
_MISSING = object()  # an argument not passed (the launchers' positional defaults)


def _given(head: tuple[Any, ...], more: tuple[Any, ...]) -> tuple[Any, ...]:
    """The positional arguments a launcher was called with (missing ones are a suffix)."""
    return tuple(a for a in head if a is not _MISSING) + more


def launcher_maker(params: Sequence[Param], device: int, name: str) -> LauncherMaker:
    """``kernel[grid, block]``'s launchers, generated once per kernel: each takes the
    kernel's arguments as positional parameters (no tuple of them to build and unpack),
    checks and packs them as the packer does, and writes the launch with the stream's
    ``_write_launch``, as ``Kernel.launch`` does (the stream's arena places the block);
    anything else -- a missing or extra argument, dynamic shared memory, another device's
    stream, a capture, a profiler, an argument the packer leaves to the checked path --
    goes to ``launch(grid, block, args, stream, shared_mem)``, which checks and says why. One call instead of three (launcher,
    packer, write): the host-call row of ``bench.compare --only tiny`` went from
    2.01-2.08x to 1.91-1.93x of a no-op submit (docs/kernels.md "Seventh round")."""
    from runtime import _trace
    from runtime.stream import LONG_ARGS, current_stream

    env = _env(device)
    env.update(current_stream=current_stream, TRACE=_trace, MISSING=_MISSING, given=_given,
               LONG=LONG_ARGS, ZERO=0)
    n = len(params)
    head = "".join(f"a{i}, " for i in range(n))
    slow = f"return launch(grid, block, ({head}), stream, shared_mem)"
    lines = ["def make(grid, block, launch, packet_for):",
             "    packets = {}",
             f"    def launcher({''.join(f'a{i}=MISSING, ' for i in range(n))}"
             f"{'/, ' if n else ''}*more, stream=None, shared_mem=0):",
             "        s = current_stream(DEVICE) if stream is None else stream",
             # (CPython has one int 0: any other zero, or a bool, takes the checked path)
             f"        if more{f' or a{n - 1} is MISSING' if n else ''} or shared_mem is not "
             "ZERO or TRACE.active is not None or s.device != DEVICE or s.capturing is not None:",
             f"            return launch(grid, block, given(({head}), more), stream, "
             "shared_mem)"]
    lines += ["    " + line for line in _checks(params, env, slow)]
    lines += [f"        raw = {' + '.join(f'r{i}' for i in range(n)) or repr(b'')}",
              "        pkt = packets.get(len(raw))",
              "        if pkt is None:",
              "            if len(raw) > LONG:",
              f"                {slow}",
              "            pkt = packets[len(raw)] = packet_for(len(raw))",
              "        return s._write_launch(pkt, raw)",
              "    return launcher"]
    return _define(lines, env, "make", "launchers", name)  # type: ignore[no-any-return]
