"""A launch's scalar records (runtime/launch.py): Python ints and floats take a direct
packing path (the common case for a framework: sizes, strides, op codes), which must give
exactly the bytes the numpy conversion gives, and leave every out-of-range value to it."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import numpy as np
import pytest

from abi import kernel_lang, userq
from runtime import launch

DTYPES = (None, "int64", "int32", "int16", "int8", "uint64", "uint32", "uint16", "uint8",
          "bool", "float64", "float32")
VALUES = (0, 1, -1, 127, -128, 255, 256, 2**31 - 1, -2**31, 2**32 - 1, 2**63 - 1, -2**63,
          2**64 - 1, 2**64, 0.5, -3.25, 1e300, True, float("nan"), float("-inf"))


class _Kernel:
    name = "k"
    module = SimpleNamespace(device=0)
    _scalar_arg = launch.Kernel._scalar_arg


def _block_of_one(p: launch._Param, value: object) -> bytes:
    """The argument block of a one-scalar kernel (``_record_args``, whose common cases
    are inline rather than calls to ``_scalar_arg``)."""
    k = _Kernel()
    k._layout = [p]  # type: ignore[attr-defined]
    return launch.Kernel._record_args(k, (value,))  # type: ignore[arg-type]


def _numpy_record(p: launch._Param, value: object) -> bytes:
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
    p = launch._Param.of({"name": "n", "kind": "scalar", "dtype": dtype})
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
        p = launch._Param.of({"name": "v", "kind": "scalar", "dtype": name if typed else None})
        want = userq.ARG_RECORD.pack(userq.ARG_SCALAR, kernel_lang.DTYPE_CODES[name],
                                     int.from_bytes(value.tobytes(), "little"), 0)
        assert _Kernel()._scalar_arg(p, value) == want, (name, value)
        assert _block_of_one(p, value) == want, (name, value)
