"""The runtime and the firmware judge every kernel the same: one language, one front end.

A corpus of kernels goes through both paths -- the runtime's (``runtime.kernels.validate``,
what a user's source meets) and the firmware's (``firmware.kernel_check.validate`` on an IR
whose ``source`` is the same text, what a hand-made module meets at the device) -- and each
must accept it or reject it with the same message: every kernel of the tree (the tests,
the bench, the examples, the runtime's kernel library, the PyTorch backend's kernels),
hand-written hostile ones, and kernels hypothesis makes up. A kernel the runtime accepts
is also accepted by the firmware in the form the runtime emits (its IR's cleaned source).
Pure: no daemon (the firmware's check on a real mount is in test_kernel_frontend.py).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from abi import kernel_lang
from firmware import kernel_check
from runtime import kernels

REPO = Path(__file__).resolve().parents[2]
#: Where kernels live: every ``def`` in a string constant of these files (or a function
#: decorated with ``runtime.kernel``) is a kernel, or a hostile one; both must agree.
KERNEL_HOMES = ("tests", "bench", "examples", "stress", "runtime/kernel_lib.py",
                "torch_accel/kernels")

Verdict = tuple[str, str]  # ("ok", "") or ("rejected", the message)


# --------------------------------------------------------------------------- the two paths


def _arg_type(p: dict[str, Any]) -> str:
    """A launch's argument type that fits an IR parameter (float32 where the kernel leaves
    the dtype to the launch: every operation of the language takes it)."""
    dtype = p["dtype"] or "float32"
    return f"{dtype}[{p['ndim']}d]" if p["kind"] == "buffer" else dtype


def _runtime(source: str) -> tuple[Verdict, dict[str, Any] | None]:
    try:
        ir = kernels.validate(source)
    except kernels.KernelCompileError as e:
        return ("rejected", str(e)), None
    return ("ok", ""), ir


def _firmware(source: str, like: dict[str, Any] | None) -> Verdict:
    """The firmware's check of an IR holding ``source``, with the params, shared bytes and
    argument types of the runtime's IR ``like`` when it has one (else any: a kernel the
    language rejects is rejected before the IR is bound)."""
    if like is None:
        try:
            fn = ast.parse(source).body[0]
            names = [a.arg for a in fn.args.args]  # type: ignore[attr-defined]
        except (SyntaxError, ValueError, IndexError, AttributeError, RecursionError,
                MemoryError):
            names = []
        like = {"params": [{"name": n, "kind": "scalar", "dtype": None} for n in names],
                "shared_mem": 0}
    ir = {**like, "source": source}
    try:
        kernel_check.validate(ir, tuple(_arg_type(p) for p in like["params"]))
    except kernel_check.KernelCompileError as e:
        return ("rejected", str(e))
    return ("ok", "")


def assert_same_verdict(source: str) -> Verdict:
    verdict, ir = _runtime(source)
    assert _firmware(source, ir) == verdict, source
    if ir is not None:  # what the runtime emits, the firmware takes
        assert _firmware(ir["source"], ir) == verdict, ir["source"]
    return verdict


# --------------------------------------------------------------------------- the tree's kernels


def _defs_in(text: str) -> list[str]:
    """The source of each top-level ``def`` of ``text`` (none if it is not Python)."""
    text = textwrap.dedent(text)
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError):
        return []
    return [seg for fn in tree.body if isinstance(fn, ast.FunctionDef)
            and (seg := ast.get_source_segment(text, fn))]


def _is_kernel_decorator(d: ast.expr) -> bool:
    return ast.unparse(d) in ("runtime.kernel", "kernel")


def _kernels_in_file(path: Path) -> list[str]:
    text = path.read_text()
    found: list[str] = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and "def " in node.value:
            found += _defs_in(node.value)
        elif isinstance(node, ast.FunctionDef) and any(map(_is_kernel_decorator,
                                                           node.decorator_list)):
            node.decorator_list = []
            found.append(ast.unparse(node))
    return found


#: The PyTorch backend's kernels are generated (f-strings, op-code tables): read its
#: modules' ``SOURCE`` in a child, under a bare ``torch_accel`` package, so that this
#: test imports neither torch nor the backend's C++ shim.
_GENERATED = """
import json, pkgutil, sys, types
from pathlib import Path
import runtime.kernel_lib
pkg = types.ModuleType("torch_accel")
pkg.__path__ = [str(Path(sys.argv[1]) / "torch_accel")]
sys.modules["torch_accel"] = pkg
import torch_accel.kernels as K
sources = [runtime.kernel_lib.SOURCE]
for m in pkgutil.iter_modules(K.__path__):
    mod = __import__("torch_accel.kernels." + m.name, fromlist=["SOURCE"])
    if isinstance(getattr(mod, "SOURCE", None), str):
        sources.append(mod.SOURCE)
print(json.dumps(sources))
"""


def _generated_kernels() -> list[str]:
    out = subprocess.run([sys.executable, "-c", _GENERATED, str(REPO)], cwd=REPO,
                         capture_output=True, text=True, timeout=120, check=True)
    return [d for text in json.loads(out.stdout) for d in _defs_in(text)]


def _tree_kernels() -> list[str]:
    files: list[Path] = []
    for home in KERNEL_HOMES:
        p = REPO / home
        files += sorted(p.rglob("*.py")) if p.is_dir() else [p]
    found = [k for f in files for k in _kernels_in_file(f)]
    return sorted(set(found + _generated_kernels()))


@pytest.fixture(scope="module")
def tree_kernels() -> list[str]:
    return _tree_kernels()


@pytest.mark.timeout(300)
def test_every_kernel_of_the_tree_is_judged_the_same(tree_kernels: list[str]) -> None:
    verdicts = [assert_same_verdict(k) for k in tree_kernels]
    accepted = sum(v[0] == "ok" for v in verdicts)
    # the tree holds the kernel library, the backend's kernels, and the tests' hostile
    # ones: a corpus that lost either half would prove little
    assert accepted >= 100 and len(verdicts) - accepted >= 100, (accepted, len(verdicts))


def test_the_library_and_backend_kernels_are_accepted() -> None:
    for source in _generated_kernels():
        assert assert_same_verdict(source) == ("ok", ""), source


# --------------------------------------------------------------------------- hostile kernels

_DEEP_IFS = ("".join("    " * (d + 1) + "if x[0]:\n" for d in range(80))
             + "    " * 81 + "x[0] = " + "-" * 30 + "1\n")
_DEEP_LOOPS = ("".join("    " * (d + 1) + f"for i{d} in range(1):\n" for d in range(18))
               + "    " * 19 + "x[0] = 1.0\n")

#: (source, what the message must say): each rejected, alike on both paths.
HOSTILE = [
    # names
    ("def __k__(x):\n    x[0] = 1\n", "dunder name `__k__`"),
    ("def __k(x):\n    x[0] = 1\n", "dunder name `__k`"),
    ("def k(__x):\n    __x[0] = 1\n", "dunder name `__x`"),
    ("def k(x):\n    __y = 1\n", "dunder name `__y`"),
    ("def k\u00e9(x):\n    x[0] = 1\n", "ASCII"),
    ("def " + "k" * 64 + "(x):\n    x[0] = 1\n", "1 to 63 ASCII"),
    ("def k(x, x):\n    x[0] = 1\n", "duplicate parameter `x`"),
    ("def k(x, range):\n    pass\n", "shadows a kernel built-in"),
    ("def k(x):\n    barrier = 1\n", "cannot assign to `barrier`"),
    # recursion and calls
    ("def k(x):\n    k(x)\n", "call of `k`: not a kernel built-in"),
    ("def k(x, n):\n    x[0] = 1\n    if n > 0:\n        k(x, n - 1)\n", "call of `k`"),
    ("def k(x):\n    x[0] = getattr(x, 'shape')\n", "`getattr` is not allowed"),
    ("def k(x):\n    x[0] = __import__('os')\n", "dunder name `__import__`"),
    ("def k(x):\n    r = range(3)\n", "range() is only allowed as the iterable"),
    # dunder and attribute access
    ("def k(x):\n    y = x.__class__\n", "dunder name `__class__`"),
    ("def k(x):\n    y = x._k__private\n", "attribute `._k__private`"),
    ("def k(x):\n    y = x.shape.__class__\n", "dunder name `__class__`"),
    ("def k(x):\n    x[0] = __builtins__\n", "dunder name `__builtins__`"),
    ("def k(x):\n    s = x.shape\n", "`x.shape` is not a value"),
    ("def k(x):\n    x[0] = x.T[0]\n", "attribute `.T`"),
    # huge literals and sizes
    ("def k(x):\n    x[0] = 18446744073709551616\n", "does not fit in 64 bits"),
    ("def k(x):\n    x[0] = " + "9" * 4000 + "\n", "integer constant of 13288 bits does not fit"),
    ("def k(x):\n    x[0] = " + "9" * 5000 + "\n", "syntax error"),
    ("def k(x):\n    x[0] = 1j\n", "the constant 1j"),
    ("def k(x):\n    x[0] = b'ab'\n", "the constant b'ab'"),
    ("def k(x):\n    s = shared_array(1048577, 'uint8')\n", "more than the 1048576"),
    ("def k(x):\n    s = shared_array((1 << 10, 1 << 10), 'f32')\n", "positive constant int"),
    ("def k(x):\n    s = shared_array((1024, 1024), 'f64')\n", "more than the 1048576"),
    ("def k(x):\n    s = shared_array((1,) * 9, 'u8')\n", "positive constant int"),
    ("def k(x):\n    s = shared_array((1, 1, 1, 1, 1, 1, 1, 1, 1), 'u8')\n",
     "at most 8"),
    ("def k(x):\n    x[0, 0, 0, 0, 0, 0, 0, 0, 0] = 1\n", "at most 8 dimensions"),
    ("def k(x):\n" + "    x[0] = 1.0\n" * 700, "more than 4096 syntax-tree nodes"),
    # deep nesting
    ("def k(x):\n    x[0] = " + "(" * 300 + "1" + ")" * 300 + "\n", "syntax error"),
    ("def k(x):\n    x[0] = " + "-" * 150 + "1\n", "nested deeper than 100"),
    ("def k(x):\n    x[0] = " + "-" * 20000 + "1\n", "does not parse (MemoryError)"),
    ("def k(x):\n" + _DEEP_IFS, "nested deeper than 100"),
    ("def k(x):\n" + _DEEP_LOOPS, "loops nested deeper than 16"),
    ("def k(x):\n    x[0] = 1\x00\n", "null bytes"),
    # the barrier rule
    ("def k(x, n):\n    if local_id(0) < n:\n        barrier()\n", "depends on the thread"),
    ("def k(x, n):\n    if global_id(0) >= n:\n        return\n    barrier()\n",
     "after the `return` at line 3"),
    ("def k(x, n):\n    i = 0\n    while i < x[0]:\n        barrier()\n        i += 1\n",
     "depends on the thread"),
    ("def k(x, n):\n    for i in range(n):\n        barrier()\n        i = local_id(0)\n",
     "`i`, the variable of the loop at line 2 that holds barrier()"),
    ("def k(c, a, b):\n    mma(c, a, b, local_id(0), 0, 0, 16, 16, 16, 0.0)\n",
     "differs between the threads"),
    ("def k(x):\n    y = barrier()\n", "barrier() returns nothing"),
    # syntax the language does not have
    ("def k(x):\n    match x:\n        case _:\n            pass\n", "`match`"),
    ("def k(x):\n    try:\n        pass\n    except Exception:\n        pass\n", "`try`"),
    ("def k(x):\n    with x:\n        pass\n", "`with`"),
    ("def k(x):\n    f = lambda: 1\n", "lambda"),
    ("def k(x):\n    def g():\n        pass\n", "nested functions"),
    ("def k(x):\n    class C:\n        pass\n", "class definitions"),
    ("async def k(x):\n    pass\n", "async"),
    ("def k(x):\n    yield 1\n", "`yield`"),
    ("def k(x):\n    if (y := 1):\n        pass\n", "`:=`"),
    ("def k(x):\n    x[0] = f'{x}'\n", "f-strings"),
    ("def k(x):\n    a = b = 1\n", "chained assignment"),
    ("def k(x):\n    a, b = 1, 2\n", "tuple unpacking"),
    ("def k(x):\n    a = (1, 2)\n", "tuples are only allowed"),
    ("def k(x):\n    a = 1\n    a **= 2\n", "augmented assignment `**=`"),
    ("def k(x):\n    y += 1\n", "free name `y`"),
    ("def k(x, n):\n    for n in range(3):\n        pass\n", "scalar parameter `n`"),
    ("def k(x):\n    break\n", "`break` outside a loop"),
    ("def k(x):\n    x[0:2] = 1\n", "slices"),
    ("def k(x):\n    x[0] = x[0] @ x[1]\n", "`@`"),
    ("def k(x):\n    x[0] = 1 if x[0] is None else 0\n", "`is`"),
    ("def k(x):\n    del x\n", "`del`"),
    ("def k(x):\n    global y\n", "`global`"),
    ("def k(x):\n    import os\n", "imports"),
    ("def k(x):\n    assert x[0]\n", "`assert`"),
    ("def k(x):\n    raise x\n", "`raise`"),
    ("def k(x) -> int:\n    pass\n", "return annotation"),
    ("@decorated\ndef k(x):\n    pass\n", "decorators are not part of a kernel"),
    ("def k(x, *a):\n    pass\n", "plain positional"),
    ("def k(x=1):\n    pass\n", "default values"),
    ("def k(x: 'float16'):\n    pass\n", "unknown dtype"),
    ("def k(x):\n    return 1\n", "`return` with a value"),
    ("def k(x):\n    x\n", "no effect"),
    ("def k(x):\n    'a string'\n    x[0] = 1\n    'another'\n", "string constants"),
    # atomics and the matrix unit
    ("def k(x: 'bool'):\n    atomic_add(x, 0, 1)\n", "a bool array"),
    ("def k(x):\n    atomic_add(s, 0, 1)\n    s = shared_array(4, 'bool')\n",
     "a bool array"),
    ("def k(x):\n    atomic_add(x, (0, 0), 1)\n    x[0] = 1\n", "inconsistent ndim"),
    ("def k(c: 'i32', a, b):\n    mma(c, a, b, 0, 0, 0, 16, 16, 16, 0.0)\n",
     "float32 or float64"),
]


@pytest.mark.parametrize("source,says", HOSTILE, ids=[f"{i}-{s[:24]}" for i, (_, s) in
                                                      enumerate(HOSTILE)])
def test_hostile_kernels_are_rejected_alike(source: str, says: str) -> None:
    verdict = assert_same_verdict(source)
    assert verdict[0] == "rejected" and says in verdict[1], verdict


def test_the_limits_are_the_languages() -> None:
    """The firmware's bounds are the language's (abi/kernel_lang.py), not its own."""
    assert kernel_check.MAX_NODES == kernel_lang.MAX_NODES
    assert kernel_check.SHARED_LIMIT == kernel_lang.SHARED_LIMIT
    assert kernel_check.MAX_NDIM == kernel_lang.MAX_NDIM
    at_limit = "def k(x):\n    s = shared_array(1048576, 'uint8')\n    s[0] = 1\n"
    assert assert_same_verdict(at_limit) == ("ok", "")


def test_the_firmware_binds_what_only_it_knows() -> None:
    """Past the language, the IR and the launch: a hand-made IR may lie about its source,
    and a launch may bring a bool buffer to atomic_add; the runtime cannot see either."""
    ir = kernels.validate("def k(x, n: 'int32'):\n    atomic_add(x, 0, n)\n")

    def refused(ir: dict[str, Any], types: tuple[str, ...]) -> str:
        with pytest.raises(kernel_check.KernelCompileError) as info:
            kernel_check.validate(ir, types)
        return str(info.value)

    assert kernel_check.validate(ir, ("float32[1d]", "int32")).buffers == {"x": 0}
    assert "atomic_add on a bool buffer" in refused(ir, ("bool[1d]", "int32"))
    lying = {**ir, "params": [{**ir["params"][0], "kind": "scalar"}, ir["params"][1]]}
    assert "is a scalar; the kernel's source uses it as a buffer" in refused(
        lying, ("float32", "int32"))
    unused = {**ir, "source": "def k(x, n: 'int32'):\n    pass\n"}  # either kind, then
    assert kernel_check.validate(unused, ("float32[1d]", "int32")).buffers == {"x": 0}
    assert "does not match the 16 bytes" in refused(
        kernels.validate("def k(x):\n    s = shared_array(4, 'f32')\n    s[0] = x[0]\n")
        | {"shared_mem": 0}, ("float32[1d]",))
    annotated = {**ir, "source": "def k(x, n: 'int64'):\n    atomic_add(x, 0, n)\n"}
    assert "its annotation int64" in refused(annotated, ("float32[1d]", "int32"))


# --------------------------------------------------------------------------- generated kernels

#: Mostly the language, sometimes not: a generated kernel should pass often enough that
#: the two paths are compared on accepted kernels too, not only on the first refusal.
_NAMES = st.one_of(st.sampled_from(("a", "b", "i", "c", "d")),
                   st.sampled_from(("x", "n", "__d", "np", "range", "barrier", "k", "s")))
_ATOMS = st.one_of(
    st.sampled_from(("0", "1", "2.5", "True", "n", "a", "b", "i", "x[i]", "x[a]",
                     "x.shape[0]", "x.size", "global_id(0)", "local_id(1)", "group_id(0)",
                     "local_size(0)", "num_groups(2)", "sqrt(b)", "min(a, b)", "float(n)",
                     "int(2.0)", "s[0]")),
    st.sampled_from(("18446744073709551616", "'f32'", "x.shape", "max(a)", "range(3)",
                     "x.__class__", "(1, 2)", "x[0:1]", "np.pi", "s", "k(x)", "y[0, 1]",
                     "c")))
_BINOPS = st.one_of(st.sampled_from(("+", "-", "*", "/", "//", "%", "**", "&", "|", "^",
                                     "<<", ">>", "<", "==", "and", "or")),
                    st.sampled_from(("@", "is", "in")))


@st.composite
def _expr(draw: st.DrawFn, depth: int = 0) -> str:
    if depth > 2 or draw(st.booleans()):
        return draw(_ATOMS)
    op = draw(_BINOPS)
    left, right = draw(_expr(depth + 1)), draw(_expr(depth + 1))
    return draw(st.sampled_from((f"({left} {op} {right})", f"-({left})", f"(not {left})",
                                 f"({left} if {right} else 0)", f"x[{left}]")))


@st.composite
def _block(draw: st.DrawFn, indent: int, depth: int = 0) -> str:
    pad = "    " * indent
    lines: list[str] = []
    for _ in range(draw(st.integers(1, 3))):
        name = draw(_NAMES)
        e = draw(_expr())
        kind = draw(st.integers(0, 13 if depth < 2 else 8))
        if kind == 0:
            lines.append(f"{pad}{name} = {e}")
        elif kind == 1:
            lines.append(f"{pad}{name} {draw(st.sampled_from(('+', '-', '*', '**')))}= {e}")
        elif kind == 2:
            lines.append(f"{pad}x[{draw(_expr())}] = {e}")
        elif kind == 3:
            lines.append(f"{pad}barrier()")
        elif kind == 4:
            target = draw(st.sampled_from(("x", "t", "a")))
            lines.append(f"{pad}atomic_add({target}, 0, {e})")
        elif kind == 5:
            lines.append(pad + draw(st.sampled_from(("return", "break", "continue", "pass"))))
        elif kind == 6:
            shape = draw(st.sampled_from(("8", "(4, 4)", "n")))
            dtype = draw(st.sampled_from(("'f32'", "'bool'", "'f16'")))
            lines.append(f"{pad}{name} = shared_array({shape}, {dtype})")
        elif kind == 7:
            operand = draw(st.sampled_from(("x", "y", "n")))
            lines.append(f"{pad}mma(x, y, {operand}, {e}, 0, 0, 16, 16, 16, 0.0)")
        elif kind == 8:
            lines.append(f"{pad}{e}")
        elif kind in (9, 10):
            lines.append(f"{pad}if {e}:")
            lines.append(draw(_block(indent + 1, depth + 1)))
        elif kind == 11:
            lines.append(f"{pad}for {name} in range({e}):")
            lines.append(draw(_block(indent + 1, depth + 1)))
        else:
            lines.append(f"{pad}while {e}:")
            lines.append(draw(_block(indent + 1, depth + 1)))
    return "\n".join(lines)


@st.composite
def _kernel(draw: st.DrawFn) -> str:
    params = draw(st.sampled_from(("x, y, n",) * 3 + ("x: 'f32', y: 'f32', n: 'i32'",) * 3
                                  + ("x: 'bool', y, n", "x, y, n, x", "x, __y, n")))
    return (f"def k({params}):\n    a = 0\n    b = 1.0\n    i = 0\n    c = 0\n    d = 0\n"
            f"    s = shared_array(8, 'f32')\n{draw(_block(1))}\n")


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(_kernel())
def test_generated_kernels_are_judged_the_same(source: str) -> None:
    assert_same_verdict(source)
