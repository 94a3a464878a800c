"""The kernel front end (abi/kernel_frontend.py, as runtime/kernels.py runs it) against
docs/kernels.md.

Valid kernels must produce the IR the firmware expects; every rejected construct must be
reported with the user's line and a reason that names it, because the front end is the
only place a user sees a kernel error close to their code. Pure, but for one test: the
firmware's own check of IR the runtime never saw, on the session's real mount
(test_kernel_frontend_differential.py has both paths judge a corpus alike, in-process).
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

import numpy as np
import pytest

from abi import kernel_lang, uapi
from firmware import kernel_check
from runtime.errors import InvalidValueError
from runtime.kernels import (
    BUILTINS,
    DTYPES,
    KernelCompileError,
    compile_module,
    module_hash,
    normalize_dtype,
    validate,
)

SAXPY = '''\
def saxpy(a: "f32", x, y, out):
    """out = a * x + y"""
    i = global_id(0)
    if i < out.size:
        out[i] = a * x[i] + y[i]
'''

GEMM = '''\
def gemm(A, B, C, n: "i32"):
    tA = shared_array((16, 16), "float32")
    tB = shared_array((16, 16), "f32")
    row = group_id(1) * local_size(1) + local_id(1)
    col = global_id(0)
    ly = local_id(1)
    lx = local_id(0)
    acc = 0.0
    for t in range(0, n, local_size(0)):
        tA[ly, lx] = A[row, t + lx]
        tB[ly, lx] = B[t + ly, col]
        barrier()
        for k in range(16):
            acc += tA[ly, k] * tB[k, lx]
        barrier()
    if row < C.shape[0] and col < C.shape[1]:
        C[row, col] = acc
'''

REDUCE = '''\
def reduce_sum(x, total, n):
    part = shared_array(256, "float64")
    lid = local_id(0)
    i = global_id(0)
    part[lid] = x[i] if i < n else 0.0
    barrier()
    step = local_size(0) // 2
    while step > 0:
        if lid < step:
            part[lid] += part[lid + step]
        barrier()
        step >>= 1
    if lid == 0:
        atomic_add(total, 0, part[0])
'''

CONTROL = '''\
def control(x, out, n: "int64", lim):
    i = global_id(0)
    j = 0
    acc = 0
    while True:
        j += 1
        if j % 2 == 0:
            continue
        elif j > n:
            break
        else:
            pass
        acc += j
    for k in range(n - 1, -1, -1):
        if 0 <= k < lim <= n and not k == 3 or k != 4:
            acc = acc + k ** 2 - (k // 2) % 3 + (k & 1 | 2 ^ 3) + (~k << 1 >> 1)
    y = float(acc) / 3.0
    z = int(sqrt(abs(y))) + min(1, 2, acc) + max(i, 0)
    w = floor(exp(0.5) + log(2.0) + sin(y) * cos(y) + tanh(-y))
    out[i] = z if w > 0 else -z
    if i >= n:
        return
    out[i] += x[i] * True
'''

MMA = '''\
def mma_gemm(c: "float32", a: "f32", b, k: "int32"):
    """c += a @ b: one 64x64 tile of c per block, through the matrix unit"""
    i = group_id(1) * 64
    j = group_id(0) * 64
    for k0 in range(0, k, 64):
        mma(c, a, b, i, j, k0, 64, 64, 64, 1.0)
'''

DYNAMIC = '''\
def dyn_reverse(x, out, n: "int32"):
    tile = dynamic_shared("f32")
    lid = local_id(0)
    tile[lid] = x[global_id(0)]
    barrier()
    out[global_id(0)] = tile[local_size(0) - 1 - lid]
'''


def _err(source: str) -> KernelCompileError:
    with pytest.raises(KernelCompileError) as info:
        validate(source)
    return info.value


# --------------------------------------------------------------------------- valid kernels


def test_saxpy_ir() -> None:
    ir = validate(SAXPY)
    assert ir == {
        "name": "saxpy",
        "params": [{"name": "a", "kind": "scalar", "dtype": "float32"},
                   {"name": "x", "kind": "buffer", "dtype": None, "ndim": 1},
                   {"name": "y", "kind": "buffer", "dtype": None, "ndim": 1},
                   {"name": "out", "kind": "buffer", "dtype": None, "ndim": 1}],
        "source": ("def saxpy(a, x, y, out):\n    i = global_id(0)\n    if i < out.size:\n"
                   "        out[i] = a * x[i] + y[i]"),
        "shared_mem": 0,
        "uses_barrier": False,
        "uses_atomics": False,
        "uses_mma": False,
        "dynamic_shared": False,
    }


def test_gemm_tiles_and_uniform_barrier() -> None:
    ir = validate(GEMM)
    assert [(p["name"], p["kind"], p.get("ndim"), p["dtype"]) for p in ir["params"]] == [
        ("A", "buffer", 2, None), ("B", "buffer", 2, None), ("C", "buffer", 2, None),
        ("n", "scalar", None, "int32")]
    assert ir["shared_mem"] == 2 * 16 * 16 * 4
    assert ir["uses_barrier"] and not ir["uses_atomics"]
    # Aliases are spelled canonically for the firmware; annotations are gone.
    assert "shared_array((16, 16), 'float32')" in ir["source"]
    assert "'f32'" not in ir["source"] and '"i32"' not in ir["source"]


def test_reduction_with_atomics_and_barrier_in_uniform_while() -> None:
    ir = validate(REDUCE)
    assert ir["shared_mem"] == 256 * 8
    assert ir["uses_barrier"] and ir["uses_atomics"]
    kinds = {p["name"]: p["kind"] for p in ir["params"]}
    assert kinds == {"x": "buffer", "total": "buffer", "n": "scalar"}


def test_control_flow_operators_and_casts() -> None:
    ir = validate(CONTROL)
    assert ir["params"][2] == {"name": "n", "kind": "scalar", "dtype": "int64"}
    assert ir["params"][3] == {"name": "lim", "kind": "scalar", "dtype": None}
    assert not ir["uses_barrier"]


def test_mma_gemm_ir() -> None:
    """mma's operands become 2-D buffer parameters; the uniform locals and the loop
    over k0 pass the barrier rule, which applies to mma as a block collective."""
    ir = validate(MMA)
    assert ir["params"] == [
        {"name": "c", "kind": "buffer", "dtype": "float32", "ndim": 2},
        {"name": "a", "kind": "buffer", "dtype": "float32", "ndim": 2},
        {"name": "b", "kind": "buffer", "dtype": None, "ndim": 2},
        {"name": "k", "kind": "scalar", "dtype": "int32"}]
    assert ir["uses_mma"] and not ir["uses_barrier"] and not ir["uses_atomics"]
    assert ir["shared_mem"] == 0
    # after uses_atomics, as docs/kernels.md lists it; dynamic_shared comes last
    assert list(ir)[-2:] == ["uses_mma", "dynamic_shared"] and not ir["dynamic_shared"]
    assert "mma(c, a, b, i, j, k0, 64, 64, 64, 1.0)" in ir["source"]
    assert "mma" in BUILTINS


def test_dynamic_shared_ir() -> None:
    """dynamic_shared(dtype): a 1-D block-shared array sized by the launch
    (shared_mem=NBYTES), so it adds nothing to the static shared_mem."""
    ir = validate(DYNAMIC)
    assert ir["dynamic_shared"] is True
    assert ir["shared_mem"] == 0
    assert ir["uses_barrier"] and not ir["uses_atomics"] and not ir["uses_mma"]
    assert list(ir)[-1] == "dynamic_shared"
    assert [(p["name"], p["kind"]) for p in ir["params"]] == [
        ("x", "buffer"), ("out", "buffer"), ("n", "scalar")]
    # the alias is spelled canonically for the firmware (ast.unparse quotes with ')
    assert "    tile = dynamic_shared('float32')\n" in ir["source"]
    assert "f32" not in ir["source"]
    assert "dynamic_shared" in BUILTINS


def test_dynamic_shared_aliases_and_mixes_with_static() -> None:
    """Several dynamic_shared declarations alias the same per-block memory (each with
    its own dtype); a static shared_array next to them still counts its bytes; atomics
    work on a dynamic_shared array like on any shared array."""
    ir = validate("def k(x):\n    f = dynamic_shared('f64')\n"
                  "    u = dynamic_shared('uint8')\n    s = shared_array(8, 'int32')\n"
                  "    lid = local_id(0)\n    f[lid] = 1.0\n    u[lid] = 2\n"
                  "    s[lid] = 3\n    atomic_add(f, 0, x[lid])\n")
    assert ir["dynamic_shared"] is True and ir["shared_mem"] == 8 * 4
    assert ir["uses_atomics"]
    assert "f = dynamic_shared('float64')" in ir["source"]
    assert "u = dynamic_shared('uint8')" in ir["source"]
    assert "s = shared_array(8, 'int32')" in ir["source"]
    for source in (SAXPY, GEMM, REDUCE, CONTROL, MMA):
        assert validate(source)["dynamic_shared"] is False


ACCEPTED_MMA = [
    # uniform bounds from .shape, a uniform `if`, beta from a scalar parameter
    "def k(c, a, b, beta):\n    for k0 in range(0, a.shape[1], 16):\n"
    "        mma(c, a, b, 0, 0, k0, 16, 16, 16, beta)\n",
    "def k(c, a, b, n):\n    if group_id(0) < n:\n"
    "        mma(c, a, b, group_id(0) * 16, 0, 0, 16, 16, 16, 0.0)\n",
    # mma next to ordinary element code and a barrier; the same buffer twice
    "def k(c: 'float64', a: 'f64', s, n):\n    barrier()\n"
    "    mma(c, a, a, 0, 0, 0, n, n, n, 0.0)\n    i = global_id(0)\n"
    "    s[i] = c[i, 0]\n",
    # the layout flags: one (ta) or both, constants or uniform scalar parameters
    "def k(c, a, b):\n    mma(c, a, b, 0, 0, 0, 16, 16, 16, 0.0, 1)\n",
    "def k(c, a, b, ta, tb):\n    mma(c, a, b, 0, 0, 0, 16, 16, 16, 1.0, ta, tb)\n",
    # a thread-dependent return after the last mma is fine
    "def k(c, a, b, n):\n    mma(c, a, b, 0, 0, 0, 16, 16, 16, 0.0)\n"
    "    if global_id(0) >= n:\n        return\n",
]


@pytest.mark.parametrize("source", ACCEPTED_MMA)
def test_uniform_mma_accepted(source: str) -> None:
    ir = validate(source)
    assert ir["uses_mma"]
    assert all(p["ndim"] == 2 for p in ir["params"] if p["name"] in ("a", "b", "c"))


def _arg_types(ir: dict[str, Any]) -> tuple[str, ...]:
    return tuple(f"{p['dtype'] or 'float32'}[{p['ndim']}d]" if p["kind"] == "buffer"
                 else p["dtype"] or "float32" for p in ir["params"])


@pytest.mark.parametrize("source", [SAXPY, GEMM, REDUCE, CONTROL, MMA, DYNAMIC])
def test_the_firmware_takes_the_ir_and_sees_the_same_kernel(source: str) -> None:
    """The firmware checks ``source`` again (firmware/kernel_check.py, with the same front
    end): it must pass and describe the same kernel -- buffers, scalars, shared arrays."""
    ir = validate(source)
    k = kernel_check.validate(ir, _arg_types(ir))
    assert set(k.buffers) == {p["name"] for p in ir["params"] if p["kind"] == "buffer"}
    assert k.scalars == {p["name"] for p in ir["params"] if p["kind"] == "scalar"}
    static = sum(math.prod(shape) * np.dtype(dtype).itemsize
                 for shape, dtype in k.shared.values() if shape != kernel_check.DYNAMIC_SHAPE)
    assert static == ir["shared_mem"]
    assert kernel_check.calls_mma(k.fn.body) == ir["uses_mma"]


def test_module_ir_and_hash() -> None:
    m = compile_module(SAXPY + "\n\n" + GEMM)
    assert m["format"] == 1 and m["isa"] == "aemu-isa" and m["isa_version"] == "1.0"
    assert list(m["kernels"]) == ["saxpy", "gemm"]
    assert json.loads(json.dumps(m)) == m
    h = module_hash(m)
    assert len(h) == 64 and h == module_hash(json.loads(json.dumps(m)))
    assert h != module_hash(compile_module(SAXPY))


def test_validate_picks_by_name_or_refuses_several() -> None:
    assert validate(SAXPY + GEMM, name="gemm")["name"] == "gemm"
    e = _err(SAXPY + GEMM)
    assert "compile_module" in e.reason


def test_module_rejects_top_level_code_and_duplicates() -> None:
    with pytest.raises(KernelCompileError, match="line 2: only kernel definitions"):
        compile_module('"""doc"""\nX = 3\ndef k(x):\n    x[0] = 1\n')
    with pytest.raises(KernelCompileError, match="defined twice"):
        compile_module("def k(x):\n    x[0] = 1\ndef k(x):\n    x[0] = 2\n")
    with pytest.raises(KernelCompileError, match="line 2: syntax error"):
        compile_module("def k(x):\n    x[0] = = 1\n")


def test_dtype_aliases() -> None:
    assert normalize_dtype("f32") == "float32" and normalize_dtype("u8") == "uint8"
    assert normalize_dtype("bool") == "bool" and normalize_dtype("float16") is None


def _decorator(fn):  # stands in for a @kernel decorator: validation must strip it
    return fn


@_decorator
def _host_kernel(x, out: "f64"):
    i = global_id(0)
    out[i] = x[i] * 2.0


def _host_bad(x):
    i = global_id(0)
    x[i] = len(x)


def test_function_objects_and_file_line_numbers() -> None:
    ir = validate(_host_kernel)
    assert ir["source"].startswith("def _host_kernel(x, out):")
    assert ir["params"][1]["dtype"] == "float64"
    m = compile_module([_host_kernel, SAXPY])
    assert list(m["kernels"]) == ["_host_kernel", "saxpy"]
    with pytest.raises(KernelCompileError) as info:
        validate(_host_bad)
    want = _host_bad.__code__.co_firstlineno + 2
    assert info.value.lineno == want
    assert str(info.value).startswith(f"kernel _host_bad, line {want}: call of `len`")


def test_lambda_is_not_a_kernel() -> None:
    with pytest.raises(KernelCompileError, match="not a lambda"):
        validate(lambda x: x)


def test_error_is_an_invalid_value_error() -> None:
    e = _err("def k(x):\n    import os\n")
    assert isinstance(e, InvalidValueError) and isinstance(e, ValueError)
    assert str(e) == "kernel k, line 2: imports are not allowed in a kernel"
    assert (e.lineno, e.kernel) == (2, "k")


def test_is_pure_python() -> None:
    """The runtime must not pull numba/numpy/firmware in through the front end."""
    import runtime.kernels as k
    text = open(k.__file__).read()
    for mod in ("numba", "numpy", "firmware"):
        assert f"import {mod}" not in text and f"from {mod}" not in text
    assert "numba" not in sys.modules or True  # other tests may have loaded it


# --------------------------------------------------------------------------- rejections

REJECTED = [
    # imports, global/nonlocal, exec/eval
    ("def k(x):\n    import os\n", 2, "imports are not allowed"),
    ("def k(x):\n    i = 0\n    from math import sqrt\n", 3, "imports are not allowed"),
    ("def k(x):\n    global G\n    x[0] = 1\n", 2, "`global`"),
    ("def k(x):\n    x[0] = eval('1')\n", 2, "`eval` is not allowed"),
    ("def k(x):\n    i = 0\n    exec(i)\n", 3, "`exec` is not allowed"),
    # attribute tricks and dunders
    ("def k(x):\n    y = x.__class__\n", 2, "dunder name `__class__`"),
    ("def k(x):\n    p = x.ctypes\n", 2, "attribute `.ctypes` is not allowed"),
    ("def k(x):\n    p = x.ctypes.data\n", 2, "attribute `.ctypes` is not allowed"),
    ("def k(x):\n    p = x.shape[0].real\n", 2, "attribute `.real` is not allowed"),
    ("def k(x):\n    p = x.size.__index__()\n", 2, "dunder name `__index__`"),
    ("def k(x):\n    __builtins__[0] = 1\n", 2, "dunder name `__builtins__`"),
    ("def k(x):\n    x[0] = __import__\n", 2, "dunder name `__import__`"),
    ("def k(x):\n    x[0] = __import__('os')\n", 2, "dunder name `__import__`"),
    ("def k(x):\n    s = x.shape\n", 2, "`x.shape` is not a value"),
    ("def k(x):\n    x.size = 3\n", 2, "cannot assign to `x.size`"),
    ("def k(x):\n    i = 0\n    x[0] = i.real\n", 3, "attribute `.real` is not allowed"),
    ("def k(x):\n    i = 0\n    x[0] = i.size\n", 3, "only allowed on a buffer parameter"),
    ("def k(x):\n    t = shared_array(4, 'f32')\n    x[0] = t.size\n", 3,
     "only allowed on a buffer parameter"),
    # unknown calls and free names
    ("def k(x):\n    print(x[0])\n", 2, "call of `print`: not a kernel built-in"),
    ("def k(x):\n    x[0] = len(x)\n", 2, "call of `len`"),
    ("def k(x):\n    x[0] = np.sum(x)\n", 2, "calling `np.sum` is not allowed"),
    ("def k(x):\n    x[0] = SCALE * x[0]\n", 2, "free name `SCALE`"),
    ("def k(x):\n    x[0] = np\n", 2, "free name `np`"),
    ("def k(x):\n    x[0] = os.sep\n", 2, "free name `os`"),
    ("def k(x):\n    x[0] = TABLE[0]\n", 2, "free name `TABLE`"),
    ("def k(x):\n    y += 1\n", 2, "free name `y`"),
    ("def k(x, a):\n    x[0] = a(1)\n", 2, "`a` is not callable"),
    ("def k(x):\n    f = sqrt\n", 2, "built-in `sqrt` can only be called"),
    ("def k(x):\n    r = range(3)\n", 2, "range() is only allowed as the iterable"),
    ("def k(x):\n    sqrt = 3\n", 2, "cannot assign to `sqrt`"),
    # constructs the language does not have
    ("def k(x):\n    f = lambda v: v\n", 2, "lambda"),
    ("def k(x):\n    y = [v for v in range(3)]\n", 2, "list comprehensions"),
    ("def k(x):\n    y = sum(v for v in x)\n", 2, "call of `sum`"),
    ("def k(x):\n    y = (v for v in x)\n", 2, "generator expressions"),
    ("def k(x):\n    with x:\n        pass\n", 2, "`with`"),
    ("def k(x):\n    try:\n        pass\n    except E:\n        pass\n", 2, "`try`"),
    ("def k(x):\n    yield 1\n", 2, "`yield`"),
    ("def k(x):\n    x[0] = yield\n", 2, "`yield`"),
    ("async def k(x):\n    pass\n", 1, "async"),
    ("def k(x):\n    def inner():\n        pass\n", 2, "nested functions"),
    ("def k(x):\n    class C:\n        pass\n", 2, "class definitions"),
    ("def k(x):\n    i = 0\n    del i\n", 3, "`del`"),
    ("def k(x):\n    x[0] = min(*x)\n", 2, "starred arguments"),
    ("def k(x):\n    x[0] = min(1, 2, key=abs)\n", 2, "keyword arguments are not allowed"),
    ("def k(x):\n    t = shared_array(shape=4, dtype='f32')\n", 2, "keyword arguments"),
    ("def k(x):\n    return 1\n", 2, "`return` with a value"),
    ("def k(x):\n    if x[0]:\n        return None\n", 3, "`return` with a value"),
    ("def k(x):\n    a, b = 1, 2\n", 2, "tuple unpacking"),
    ("def k(x):\n    a = b = 1\n", 2, "chained assignment"),
    ("def k(x):\n    a: 'f32' = 1.0\n", 2, "annotated assignments"),
    ("def k(x):\n    x[0] = 'hello'\n", 2, "string constants are only allowed as dtype"),
    ("def k(x):\n    x[0] = None\n", 2, "the constant None"),
    ("def k(x):\n    x[0] = 1j\n", 2, "the constant 1j"),
    ("def k(x):\n    x[0] = [1]\n", 2, "lists are not allowed"),
    ("def k(x):\n    x[0] = (1, 2)\n", 2, "tuples are only allowed"),
    ("def k(x):\n    x[0:2] = 1\n", 2, "slices are not allowed"),
    ("def k(x):\n    x[0] = f'{x}'\n", 2, "f-strings"),
    ("def k(x):\n    if (y := 3):\n        x[0] = y\n", 2, "assignment expressions"),
    ("def k(x):\n    x[0] = 1 if x[1] is x[2] else 0\n", 2, "the comparison `is`"),
    ("def k(x):\n    x[0] = 1 in x\n", 2, "the comparison `in`"),
    ("def k(x):\n    x[0] = x[1] @ x[2]\n", 2, "the operator `@`"),
    ("def k(x):\n    i = 2\n    i **= 2\n", 3, "augmented assignment `**=`"),
    ("def k(x):\n    x[0] + 1\n", 2, "an expression statement has no effect; only barrier(), "
     "atomic_add(...) and mma(...) may stand alone as statements"),
    ("def k(x):\n    sqrt(x[0])\n", 2, "the result of sqrt() is unused; only barrier(), "
     "atomic_add(...) and mma(...) may stand alone as statements"),
    ("def k(x):\n    i = 0\n    'note'\n", 3, "string constants are only allowed"),
    ("def k(x):\n    assert x[0]\n", 2, "`assert`"),
    ("def k(x):\n    raise ValueError\n", 2, "`raise`"),
    ("def k(x):\n    for i in x:\n        pass\n", 2, "must iterate over range"),
    ("def k(x):\n    for i, j in range(3):\n        pass\n", 2, "single name"),
    ("def k(x):\n    for i in range(3):\n        pass\n    else:\n        pass\n", 2,
     "`for ... else`"),
    ("def k(x):\n    for i in range(1, 2, 3, 4):\n        pass\n", 2, "range() takes 1 to 3"),
    ("def k(x):\n    for i in range(n=3):\n        pass\n", 2, "keyword arguments"),
    ("def k(x):\n    break\n", 2, "`break` outside a loop"),
    # signature
    ("def k(x, *rest):\n    pass\n", 1, "plain positional names"),
    ("def k(x, n=3):\n    pass\n", 1, "default values"),
    ("def k(x: float):\n    pass\n", 1, "must be a dtype name string"),
    ("def k(x: 'float16'):\n    pass\n", 1, "unknown dtype \"float16\""),
    ("def k(x) -> int:\n    pass\n", 1, "return annotation"),
    ("def k(x, min):\n    pass\n", 1, "shadows a kernel built-in"),
    # built-in signatures
    ("def k(x):\n    d = 0\n    x[0] = global_id(d)\n", 3, "constant dimension d in 0..2"),
    ("def k(x):\n    x[0] = local_id(3)\n", 2, "constant dimension d in 0..2"),
    ("def k(x):\n    x[0] = group_id(True)\n", 2, "constant dimension d in 0..2"),
    ("def k(x):\n    x[0] = num_groups()\n", 2, "num_groups() takes 1 argument"),
    ("def k(x):\n    barrier(0)\n", 2, "barrier() takes 0 argument"),
    ("def k(x):\n    x[0] = barrier()\n", 2, "barrier() returns nothing"),
    ("def k(x):\n    y = atomic_add(x, 0, 1)\n", 2, "atomic_add() returns nothing"),
    ("def k(x):\n    atomic_add(x, 0)\n", 2, "atomic_add() takes 3 argument"),
    ("def k(x):\n    i = 0\n    atomic_add(i, 0, 1)\n", 3, "must be a buffer parameter"),
    ("def k(x):\n    x[0] = max(1)\n", 2, "max() takes at least 2"),
    ("def k(x):\n    x[0] = sqrt(1, 2)\n", 2, "sqrt() takes 1 argument"),
    # shared_array
    ("def k(x):\n    x[0] = shared_array(4, 'f32')[0]\n", 2, "only allowed as the right side"),
    ("def k(x):\n    t = 0\n    t += shared_array(4, 'f32')\n", 3, "only allowed as the right"),
    ("def k(x, n):\n    t = shared_array(n, 'f32')\n", 2, "positive constant int"),
    ("def k(x):\n    t = shared_array((4, 0), 'f32')\n", 2, "positive constant int"),
    ("def k(x):\n    t = shared_array(4, 'float16')\n", 2, "unknown dtype \"float16\""),
    ("def k(x):\n    t = shared_array(4, float)\n", 2, "dtype name string"),
    ("def k(x):\n    t = shared_array(4)\n", 2, "shared_array() takes 2"),
    ("def k(x):\n    t = shared_array(4, 'f32')\n    t = 1\n", 3, "cannot rebind shared array"),
    ("def k(x):\n    t = shared_array(4, 'f32')\n    t = shared_array(4, 'f32')\n", 3,
     "already defined at line 2"),
    ("def k(x):\n    x = shared_array(4, 'f32')\n", 2, "cannot be bound to a shared array"),
    ("def k(x):\n    t = shared_array((4, 4), 'f32')\n    x[0] = t[1]\n", 3,
     "has 2 dimension(s) but is indexed with 1"),
    ("def k(x):\n    t = shared_array(4, 'f32')\n    x[0] = t + 1\n", 3,
     "array `t` can only be indexed"),
    # buffers and ndim
    ("def k(x):\n    x[0] = 1\n    x[0, 1] = 2\n", 3, "inconsistent ndim for buffer `x`"),
    ("def k(x, y):\n    y[0] = x[0, 0]\n    atomic_add(x, 1, 1)\n", 3, "inconsistent ndim"),
    ("def k(x):\n    x[0] = x.shape[1]\n", 2, "`x.shape[1]` is out of range"),
    ("def k(x, n):\n    x[0] = x.shape[n]\n", 2, "constant non-negative int"),
    ("def k(x, y):\n    y[0] = x + 1\n    x[0] = 2\n", 2, "array `x` can only be indexed"),
    ("def k(x):\n    x = 3\n    x[0] = 1\n", 2, "cannot rebind buffer parameter"),
    # the firmware refuses it too (at launch, as a faulted packet): said here, with the line
    ("def k(x, n):\n    n = 3\n    x[0] = n\n", 2, "cannot assign to scalar parameter `n`"),
    ("def k(x, n):\n    n += 1\n    x[0] = n\n", 2, "cannot assign to scalar parameter `n`"),
    ("def k(x):\n    i = 0\n    x[0] = i[0]\n", 3, "is a scalar, not an array"),
    # barrier uniformity
    ("def k(x, n):\n    if global_id(0) < n:\n        barrier()\n", 3,
     "barrier() under control flow that depends on the thread"),
    ("def k(x):\n    for i in range(x[0]):\n        barrier()\n", 3, "reads `x[...]`"),
    ("def k(x, n):\n    i = local_id(0) * 2\n    j = i + 1\n    while j < n:\n"
     "        barrier()\n        j += 1\n", 5, "uses `j`, which depends on the thread"),
    ("def k(x, n):\n    m = 0\n    if global_id(0) == 0:\n        m = 5\n"
     "    for i in range(m):\n        barrier()\n", 6, "depends on the thread"),
    ("def k(x, n):\n    for i in range(n):\n        if local_id(0) == i:\n            break\n"
     "        barrier()\n", 5, "has a `break` at line 4"),
    ("def k(x, n):\n    if global_id(0) >= n:\n        return\n    barrier()\n", 4,
     "after the `return` at line 3"),
    ("def k(x, n):\n    for i in range(n):\n        barrier()\n        if x[i] > 0:\n"
     "            return\n", 3, "after the `return` at line 5"),
]


@pytest.mark.parametrize("source,line,reason", REJECTED,
                         ids=[f"{i}-{r[2][:30]}" for i, r in enumerate(REJECTED)])
def test_rejected(source: str, line: int, reason: str) -> None:
    e = _err(source)
    assert reason in e.reason, e.reason
    assert e.lineno == line, str(e)
    assert str(e) == f"kernel k, line {line}: {e.reason}" or e.kernel is None


ACCEPTED_BARRIERS = [
    # uniform: scalar params, constants, group_id / local_size / num_groups, .shape
    "def k(x, n):\n    for i in range(n // local_size(0)):\n        barrier()\n",
    "def k(x, n):\n    if group_id(0) < num_groups(0) - 1:\n        barrier()\n",
    "def k(x):\n    m = x.shape[0] * 2\n    while m > 0:\n        barrier()\n        m -= 1\n",
    # a thread-dependent return after the last barrier is fine
    "def k(x, n):\n    barrier()\n    if global_id(0) >= n:\n        return\n    x[0] = 1\n",
    # a break of an inner loop does not make the outer trip count vary
    "def k(x, n):\n    for i in range(n):\n        for j in range(n):\n"
    "            if x[j] > 0:\n                break\n        barrier()\n",
]


@pytest.mark.parametrize("source", ACCEPTED_BARRIERS)
def test_uniform_barriers_accepted(source: str) -> None:
    assert validate(source)["uses_barrier"]


_MMA_CALL = "mma(c, a, b, 0, 0, 0, 16, 16, 16, 0.0)"

#: (source, line, the exact reason): mma's rules, and barrier's messages, which the
#: shared block-collective check must keep byte for byte.
REJECTED_EXACT = [
    # barrier's messages, unchanged by the generalisation to mma
    ("def k(x, n):\n    if global_id(0) < n:\n        barrier()\n", 3,
     "barrier() under control flow that depends on the thread: the `if` at line 2 uses "
     "global_id()"),
    ("def k(x, n):\n    if global_id(0) >= n:\n        return\n    barrier()\n", 4,
     "barrier() can run after the `return` at line 3, which depends on the thread: the "
     "threads that returned would never reach it"),
    # arguments that differ between the threads of a block
    ("def k(c, a, b):\n    mma(c, a, b, local_id(0), 0, 0, 64, 64, 64, 1.0)\n", 2,
     "mma() argument 4 (`local_id(0)`) differs between the threads of a block: "
     "uses local_id()"),
    ("def k(c, a, b, n):\n    j = global_id(0) * 64\n    for k0 in range(0, n, 64):\n"
     "        mma(c, a, b, 0, j, k0, 64, 64, 64, 1.0)\n", 4,
     "mma() argument 5 (`j`) differs between the threads of a block: uses `j`, which "
     "depends on the thread"),
    ("def k(c, a, b, s):\n    mma(c, a, b, 0, 0, 0, 16, 16, 16, s[0])\n", 2,
     "mma() argument 10 (`s[0]`) differs between the threads of a block: reads `s[...]` "
     "(a loaded value)"),
    # placement: the barrier rule
    (f"def k(c, a, b):\n    if local_id(0) == 0:\n        {_MMA_CALL}\n", 3,
     "mma() under control flow that depends on the thread: the `if` at line 2 uses "
     "local_id()"),
    (f"def k(c, a, b, n):\n    for i in range(n):\n        if local_id(0) == i:\n"
     f"            break\n        {_MMA_CALL}\n", 5,
     "mma() under control flow that depends on the thread: the `for` at line 2 has a "
     "`break` at line 4 that depends on the thread (the `if` at line 3 uses local_id())"),
    (f"def k(c, a, b, n):\n    if global_id(0) >= n:\n        return\n    {_MMA_CALL}\n", 4,
     "mma() can run after the `return` at line 3, which depends on the thread: the "
     "threads that returned would never reach it"),
    (f"def k(c, a, b, n):\n    for t in range(n):\n        {_MMA_CALL}\n"
     "        if c[t, 0] > 0:\n            return\n", 3,
     "mma() can run after the `return` at line 5, which depends on the thread: the "
     "threads that returned would never reach it"),
    # operands that are not buffer parameters
    ("def k(c, a, n):\n    for k0 in range(0, n, 16):\n"
     "        mma(c, a, n, 0, 0, k0, 16, 16, 16, 1.0)\n", 3,
     "the first three arguments of mma must be buffer parameters, not `n`"),
    ("def k(c, b):\n    t = shared_array((16, 16), 'f32')\n"
     "    mma(c, t, b, 0, 0, 0, 16, 16, 16, 0.0)\n", 3,
     "the first three arguments of mma must be buffer parameters, not `t`"),
    ("def k(c, a):\n    b = 0.0\n    mma(c, a, b, 0, 0, 0, 16, 16, 16, 0.0)\n", 3,
     "the first three arguments of mma must be buffer parameters, not `b`"),
    ("def k(c, a, b):\n    mma(c[0], a, b, 0, 0, 0, 16, 16, 16, 0.0)\n", 2,
     "the first three arguments of mma must be buffer parameters, not `c[0]`"),
    ("def k(c, a):\n    mma(c, a, B, 0, 0, 0, 16, 16, 16, 0.0)\n", 2,
     "free name `B`: a kernel can only use its parameters, its locals and the kernel "
     "built-ins (no globals, closures or host objects)"),
    # signature, statement-only, dtypes
    ("def k(c, a, b):\n    mma(c, a, b, 0, 0, 0, 16, 16, 16)\n", 2,
     "mma() takes 10 to 12 argument(s), not 9"),
    ("def k(c, a, b):\n    mma(c, a, b, 0, 0, 0, 16, 16, 16, 0.0, 1, 1, 0)\n", 2,
     "mma() takes 10 to 12 argument(s), not 13"),
    # the layout flags are uniform scalars like the rest
    ("def k(c, a, b):\n    mma(c, a, b, 0, 0, 0, 16, 16, 16, 0.0, local_id(0), 0)\n", 2,
     "mma() argument 11 (`local_id(0)`) differs between the threads of a block: "
     "uses local_id()"),
    ("def k(c, a, b, s):\n    mma(c, a, b, 0, 0, 0, 16, 16, 16, 0.0, 0, s[0])\n", 2,
     "mma() argument 12 (`s[0]`) differs between the threads of a block: reads `s[...]` "
     "(a loaded value)"),
    (f"def k(c, a, b):\n    y = {_MMA_CALL}\n", 2,
     "mma() returns nothing; call it as a statement"),
    (f"def k(c, a, b):\n    c[0, 0] = 1.0 + {_MMA_CALL}\n", 2,
     "mma() returns nothing; call it as a statement"),
    (f"def k(c, a: 'int32', b):\n    {_MMA_CALL}\n", 2,
     "mma() operands must be float32 or float64 buffers, `a` is int32"),
    (f"def k(c: 'f32', a: 'float64', b):\n    {_MMA_CALL}\n", 2,
     "mma() operands must share one dtype"),
    # mma's operands are 2-D, whichever use comes first
    (f"def k(c, a, b):\n    i = global_id(0)\n    c[i] = 0.0\n    {_MMA_CALL}\n", 4,
     "inconsistent ndim for buffer `c`: indexed with 2 index(es) here but with 1 at line 3"),
    (f"def k(c, a, b):\n    {_MMA_CALL}\n    c[global_id(0)] = 0.0\n", 3,
     "inconsistent ndim for buffer `c`: indexed with 1 index(es) here but with 2 at line 2"),
    # a built-in name
    ("def k(x, mma):\n    pass\n", 1, "parameter `mma` shadows a kernel built-in"),
    ("def k(x):\n    mma = 1\n", 2, "cannot assign to `mma`: it is a kernel built-in"),
    # dynamic_shared(dtype): only as `name = dynamic_shared(...)`, one dtype name string
    ("def k(x):\n    x[0] = dynamic_shared('f32')[0]\n", 2,
     "dynamic_shared(...) is only allowed as the right side of a plain "
     "`name = dynamic_shared(...)`"),
    ("def k(x):\n    t = 1.0 + dynamic_shared('f32')\n", 2,
     "dynamic_shared(...) is only allowed as the right side of a plain "
     "`name = dynamic_shared(...)`"),
    ("def k(x):\n    t = 0\n    t += dynamic_shared('f32')\n", 3,
     "dynamic_shared(...) is only allowed as the right side of a plain "
     "`name = dynamic_shared(...)`"),
    ("def k(x):\n    x[0] = dynamic_shared('f32')\n", 2,
     "dynamic_shared(...) is only allowed as the right side of a plain "
     "`name = dynamic_shared(...)`"),
    ("def k(x):\n    i = 0\n    dynamic_shared('f32')\n", 3,
     "dynamic_shared(...) is only allowed as the right side of a plain "
     "`name = dynamic_shared(...)`"),
    ("def k(x):\n    t = dynamic_shared(4, 'f32')\n", 2,
     "dynamic_shared() takes 1 argument(s), not 2"),
    ("def k(x):\n    t = dynamic_shared()\n", 2,
     "dynamic_shared() takes 1 argument(s), not 0"),
    ("def k(x):\n    t = dynamic_shared(dtype='f32')\n", 2,
     "keyword arguments are not allowed (`dtype=` in dynamic_shared())"),
    ("def k(x):\n    t = dynamic_shared(float)\n", 2,
     "the dtype of dynamic_shared must be a dtype name string such as \"float32\", "
     "not `float`"),
    ("def k(x):\n    t = dynamic_shared(4)\n", 2,
     "the dtype of dynamic_shared must be a dtype name string such as \"float32\", "
     "not `4`"),
    ("def k(x):\n    t = dynamic_shared('float16')\n", 2,
     "unknown dtype \"float16\" in dynamic_shared (known: "
     + ", ".join(DTYPES) + ")"),
    ("def k(x):\n    t = dynamic_shared('f32')\n    t[0, 1] = 1.0\n", 3,
     "shared array `t` has 1 dimension(s) but is indexed with 2"),
    ("def k(x):\n    t = dynamic_shared('f32')\n    atomic_add(t, (0, 1), 1.0)\n", 3,
     "shared array `t` has 1 dimension(s) but is indexed with 2"),
    ("def k(x):\n    t = dynamic_shared('f32')\n    t = 1.0\n", 3,
     "cannot rebind shared array `t`"),
    ("def k(x):\n    t = dynamic_shared('f32')\n    t = dynamic_shared('i32')\n", 3,
     "shared array `t` is already defined at line 2"),
    ("def k(x):\n    t = shared_array(4, 'f32')\n    t = dynamic_shared('f32')\n", 3,
     "shared array `t` is already defined at line 2"),
    ("def k(x):\n    x = dynamic_shared('f32')\n", 2,
     "parameter `x` cannot be bound to a shared array"),
    ("def k(x):\n    t = dynamic_shared('f32')\n    x[0] = t\n", 3,
     "array `t` can only be indexed (`t[i]`), passed to atomic_add or mma, or used "
     "through .shape[k]/.size"),
    ("def k(x):\n    t = dynamic_shared('f32')\n    x[0] = t.size\n", 3,
     "`.size` is only allowed on a buffer parameter, not on `t`"),
    ("def k(x, dynamic_shared):\n    pass\n", 1,
     "parameter `dynamic_shared` shadows a kernel built-in"),
    ("def k(x):\n    dynamic_shared = 1\n", 2,
     "cannot assign to `dynamic_shared`: it is a kernel built-in"),
    ("def k(x):\n    f = dynamic_shared\n", 2, "built-in `dynamic_shared` can only be called"),
    # shared_array's messages, unchanged by the generalisation to dynamic_shared
    ("def k(x):\n    x[0] = shared_array(4, 'f32')[0]\n", 2,
     "shared_array(...) is only allowed as the right side of a plain "
     "`name = shared_array(...)`"),
    ("def k(x):\n    t = shared_array(4, float)\n", 2,
     "the dtype of shared_array must be a dtype name string such as \"float32\", "
     "not `float`"),
    ("def k(x):\n    t = shared_array(4, 'float16')\n", 2,
     "unknown dtype \"float16\" in shared_array (known: " + ", ".join(DTYPES) + ")"),
    ("def k(x):\n    t = shared_array(0, 'f32')\n", 2,
     "the shape of shared_array must be a positive constant int or a tuple of them, "
     "not `0`"),
]


@pytest.mark.parametrize("source,line,reason", REJECTED_EXACT,
                         ids=[f"{i}-{r[2][:30]}" for i, r in enumerate(REJECTED_EXACT)])
def test_rejected_exact(source: str, line: int, reason: str) -> None:
    e = _err(source)
    assert e.reason == reason
    assert e.lineno == line, str(e)
    assert str(e) == f"kernel k, line {line}: {reason}"
