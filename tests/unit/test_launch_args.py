"""A launch's argument records (runtime/launch.py, runtime/arg_packer.py): Python ints
and floats take a direct packing path (the common case for a framework: sizes, strides, op
codes), which must give exactly the bytes the numpy conversion gives, and leave every
out-of-range value to it; a kernel's generated packer gives exactly the checked path's
block for every argument it takes, and takes the common ones."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from abi import kernel_lang, userq
from runtime import arg_packer, launch
from runtime.memory import ImportedArray

DTYPES = (None, "int64", "int32", "int16", "int8", "uint64", "uint32", "uint16", "uint8",
          "bool", "float64", "float32")
VALUES = (0, 1, -1, 127, -128, 255, 256, 2**31 - 1, -2**31, 2**32 - 1, 2**63 - 1, -2**63,
          2**64 - 1, 2**64, 0.5, -3.25, 1e300, True, float("nan"), float("-inf"))


class _Kernel:
    name = "k"
    module = SimpleNamespace(device=0)
    _scalar_arg = launch.Kernel._scalar_arg
    _buffer_arg = launch.Kernel._buffer_arg


def _block_of_one(p: arg_packer.Param, value: object) -> bytes:
    """The argument block of a one-scalar kernel (``_record_args``, whose common cases
    are the packer's rather than calls to ``_scalar_arg``)."""
    k = _Kernel()
    k._layout = [p]  # type: ignore[attr-defined]
    k._pack = arg_packer.packer([p], 0, "k")  # type: ignore[attr-defined]
    return launch.Kernel._record_args(k, (value,))  # type: ignore[arg-type]


def _numpy_record(p: arg_packer.Param, value: object) -> bytes:
    """The record as numpy converts the value (the path every other argument takes)."""
    dtype = np.dtype(p.dtype) if p.dtype else np.dtype(type(value))
    bits = int.from_bytes(np.array(value, dtype).tobytes().ljust(8, b"\0"), "little")
    return userq.ARG_RECORD.pack(userq.ARG_SCALAR, kernel_lang.DTYPE_CODES[dtype.name], bits, 0)


def _outcome(fn, *args):  # noqa: ANN001, ANN202 - a record, or the exception's type
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # numpy's overflow warnings
            return fn(*args)
    except Exception as exc:  # noqa: BLE001 - the type is what is compared
        return type(exc)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_python_scalars_pack_as_numpy_converts_them(dtype):
    p = arg_packer.Param.of({"name": "n", "kind": "scalar", "dtype": dtype})
    differ = [(v, _outcome(_numpy_record, p, v), _outcome(_Kernel()._scalar_arg, p, v),
               _outcome(_block_of_one, p, v)) for v in VALUES]
    assert [d for d in differ if not d[1] == d[2] == d[3]] == []


def _numpy_scalars() -> list[np.generic]:
    """Every launch-ABI dtype's extremes, and float NaNs whose payloads a float
    conversion would change (a signalling NaN, a negative one)."""
    out: list[np.generic] = [np.bool_(True), np.bool_(False)]
    for name in kernel_lang.DTYPE_CODES:
        dt = np.dtype(name)
        if dt.kind in "iu":
            info = np.iinfo(dt)
            out += [dt.type(info.min), dt.type(info.max), dt.type(1)]
        elif dt.kind == "f":
            bits = np.dtype(f"uint{dt.itemsize * 8}")
            snan = 0x7F800001 if dt.itemsize == 4 else 0x7FF0000000000001
            out += [dt.type(-0.0), dt.type(np.inf), dt.type(np.finfo(dt).tiny),
                    np.array(snan, bits).view(dt)[()], np.array(np.iinfo(bits).max, bits).view(dt)[()]]
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("typed", [True, False], ids=["declared", "untyped"])
def test_numpy_scalars_are_their_own_bits(typed):
    """A numpy scalar of the parameter's type (or any, for an untyped parameter) packs as
    its own bytes, NaN payloads included."""
    for value in _numpy_scalars():
        name = value.dtype.name
        p = arg_packer.Param.of({"name": "v", "kind": "scalar", "dtype": name if typed else None})
        want = userq.ARG_RECORD.pack(userq.ARG_SCALAR, kernel_lang.DTYPE_CODES[name],
                                     int.from_bytes(value.tobytes(), "little"), 0)
        assert _Kernel()._scalar_arg(p, value) == want, (name, value)
        assert _block_of_one(p, value) == want, (name, value)


# --- the generated packer (runtime/arg_packer.py) against the checked path ----------------
_BUFFER_DTYPES = ("float32", "float64", "int32", "uint8")


def _array(dtype: str, shape: tuple[int, ...], device: int = 0, closed: bool = False,
           recorded: bool = True, cls: type = launch.DeviceArray) -> launch.DeviceArray:
    """A device array as a launch sees one (no device behind it: only the fields read)."""
    a = cls.__new__(cls)
    a.shape, a.dtype, a.device, a.va = shape, np.dtype(dtype), device, 0x10_0000
    a.nbytes = int(np.prod(shape)) * a.dtype.itemsize
    a._allocator = SimpleNamespace(closed=launch.errors.DeviceLostError("reset") if closed
                                   else None)
    if recorded:
        a._launch_record = launch._buffer_records(a.va, a.dtype, a.shape)
    return a


def _checked(layout: list[arg_packer.Param], args: tuple) -> object:
    """The block the checked path builds (no packer), or the type of what it raises."""
    k = _Kernel()
    k._layout = layout  # type: ignore[attr-defined]
    k._pack = lambda args: None  # type: ignore[attr-defined]
    return _outcome(launch.Kernel._record_args, k, args)


@st.composite
def _launches(draw: st.DrawFn) -> tuple[list[arg_packer.Param], tuple]:
    """A parameter list and arguments for it: each argument fits its parameter (the
    packer's cases) or, one time in three, is drawn from anything, fitting or not."""
    layout, args = [], []
    for _ in range(draw(st.integers(0, 4))):
        anything = draw(st.integers(0, 2)) == 0
        if draw(st.booleans()):
            ndim = draw(st.sampled_from([None, 1, 2, 3]))
            want = draw(st.sampled_from([None, *_BUFFER_DTYPES]))
            layout.append(arg_packer.Param.of({"name": "b", "kind": "buffer", "dtype": want,
                                            "ndim": ndim}))
            nd = draw(st.integers(0, 3)) if anything or ndim is None else ndim
            dt = draw(st.sampled_from(_BUFFER_DTYPES)) if anything or want is None else want
            shape = tuple(draw(st.lists(st.integers(1, 5), min_size=nd, max_size=nd)))
            odd = (lambda: draw(st.integers(0, 3)) == 0) if anything else (lambda: False)
            args.append(7 if odd() else _array(
                dt, shape, device=int(odd()), closed=odd(), recorded=not odd(),
                cls=ImportedArray if odd() else launch.DeviceArray))
        else:
            want = draw(st.sampled_from(DTYPES))
            p = arg_packer.Param.of({"name": "s", "kind": "scalar", "dtype": want})
            layout.append(p)
            fitting = [v for v in _numpy_scalars() if want in (None, v.dtype.name)]
            if p.int_range is not None or want is None:
                lo, hi, _ = p.int_range or arg_packer.INT64_RANGE
                fitting.append(draw(st.integers(lo, hi)))
            args.append(draw(st.sampled_from(fitting)) if not anything else draw(st.one_of(
                st.sampled_from(_numpy_scalars()), st.sampled_from(VALUES),
                st.integers(-2**65, 2**65), st.floats(), st.just("x"))))
    if draw(st.integers(0, 9)) == 0:  # a wrong number of arguments
        args = args[:-1] if args and draw(st.booleans()) else [*args, np.float32(1)]
    return layout, tuple(args)


@pytest.mark.timeout(120)
@settings(max_examples=400, deadline=None)
@given(_launches())
def test_the_packer_gives_the_checked_block_or_leaves_it_to_the_checked_path(case):
    layout, args = case
    pack = arg_packer.packer(layout, 0, "k")
    for _ in range(2):  # before and after the checked path recorded the arrays
        want, got = _checked(layout, args), _outcome(pack, args)
        assert got is None or got == want, (layout, args, got, want)


@pytest.mark.timeout(60)
def test_the_packer_takes_the_common_arguments_and_nothing_it_must_not():
    fill = [arg_packer.Param.of({"name": "out", "kind": "buffer", "dtype": "float32", "ndim": 1}),
            arg_packer.Param.of({"name": "v", "kind": "scalar", "dtype": None}),
            arg_packer.Param.of({"name": "n", "kind": "scalar", "dtype": "int32"}),
            arg_packer.Param.of({"name": "a", "kind": "scalar", "dtype": "float32"})]
    pack = arg_packer.packer(fill, 0, "fill")
    out = _array("float32", (256,))
    common = [(out, np.float32(1), 5, np.float32(2)), (out, np.int64(-3), np.int32(7), np.float32(0)),
              (out, 2**63 - 1, -2**31, np.float32(-1)),
              (_array("float32", (8,)), -2**63, 2**31 - 1, np.float32(np.inf))]
    for args in common:
        assert pack(args) == _checked(fill, args), args
    left = [(_array("float32", (256,), recorded=False), np.float32(1), 5, np.float32(2)),
            (_array("float32", (256,), closed=True), np.float32(1), 5, np.float32(2)),
            (_array("float32", (256,), device=1), np.float32(1), 5, np.float32(2)),
            (_array("float64", (256,)), np.float32(1), 5, np.float32(2)),
            (_array("float32", (16, 16)), np.float32(1), 5, np.float32(2)),
            (_array("float32", (256,), cls=ImportedArray), np.float32(1), 5,
             np.float32(2)),
            (out, np.float32("nan"), 5, np.float32(2)), (out, 1.5, 5, np.float32(2)),
            (out, 2**63, 5, np.float32(2)), (out, np.float32(1), 2**31, np.float32(2)),
            (out, np.float32(1), np.int64(5), np.float32(2)), (out, np.float32(1), True, 0.5),
            (out, np.float32(1), 5, np.float64(2)), (out, np.float32(1), 5)]
    for args in left:
        assert pack(args) is None, args


class _Stream:
    """What a generated launcher reads of a stream and calls on it."""

    def __init__(self, device: int = 0, capturing: object = None) -> None:
        self.device, self.capturing, self.written = device, capturing, []

    def _write_launch(self, pkt: bytes, raw: bytes) -> int:
        self.written.append((pkt, raw))
        return 7


def _launcher(layout: list[arg_packer.Param]):  # noqa: ANN202 - (launcher, its slow calls)
    slow: list[tuple] = []

    def launch_(*call: object) -> int:
        slow.append(call)
        return 9

    make = arg_packer.launcher_maker(layout, 0, "k")
    return make(4, 256, launch_, lambda n: b"P%d" % n), slow


@pytest.mark.timeout(120)
@settings(max_examples=300, deadline=None)
@given(_launches())
def test_a_launcher_writes_what_the_packer_packs_and_hands_the_rest_on(case):
    """``kernel[grid, block](*args)`` (arg_packer.launcher_maker) writes the launch itself
    exactly when the packer takes the arguments, with the packer's block; anything else
    reaches ``Kernel.launch`` with the arguments exactly as given."""
    layout, args = case
    run, slow = _launcher(layout)
    s = _Stream()
    raw = arg_packer.packer(layout, 0, "k")(args)
    fits = raw is not None and len(raw) <= launch.LONG_ARGS
    assert run(*args, stream=s) == (7 if fits else 9)
    if fits:
        assert s.written == [(b"P%d" % len(raw), raw)] and slow == []
    else:
        assert s.written == [] and slow == [(4, 256, args, s, 0)]


@pytest.mark.timeout(60)
def test_a_launcher_hands_on_every_launch_it_must_not_write(monkeypatch):
    """Dynamic shared memory (any value but the int 0), a stream it may not write (a
    capture, another device's) and a profiler all take the checked path, with the
    arguments as given."""
    fill = [arg_packer.Param.of({"name": "out", "kind": "buffer", "dtype": "float32", "ndim": 1}),
            arg_packer.Param.of({"name": "v", "kind": "scalar", "dtype": None})]
    args = (_array("float32", (256,)), np.float32(1))
    run, slow = _launcher(fill)
    for shared in (0.0, False, np.int64(0), 1):
        s = _Stream()
        run(*args, stream=s, shared_mem=shared)
        assert s.written == [] and slow[-1] == (4, 256, args, s, shared)
    for s in (_Stream(capturing=object()), _Stream(1)):
        run(*args, stream=s)
        assert s.written == [] and slow[-1] == (4, 256, args, s, 0)
    monkeypatch.setattr(launch._trace, "active", object())
    s = _Stream()
    run(*args, stream=s)
    assert s.written == [] and slow[-1] == (4, 256, args, s, 0)
    monkeypatch.undo()
    run(*args, stream=s)
    assert len(s.written) == 1 and len(slow) == 7
