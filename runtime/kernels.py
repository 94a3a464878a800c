"""The kernel compiler: Python kernel source -> module IR (docs/kernels.md).

The language is checked by its one front end, ``abi/kernel_frontend.py``, which the
firmware runs again on the IR's ``source`` before it lowers it (it never trusts the
runtime). What is the runtime's own: reading kernels from source text, function objects
and lists of them, with the line numbers of the user's file; turning the front end's
:class:`~abi.kernel_frontend.LanguageError` into :class:`KernelCompileError` (an
:class:`InvalidValueError`, as every argument the runtime refuses); and emitting the IR.
It never runs a kernel and never imports numba, numpy or the firmware.

Public API:

- :func:`validate` -- one kernel (function object or source text) -> its IR dict;
- :func:`compile_module` -- source text / function / list of functions -> module IR;
- :func:`module_hash` -- sha256 of the canonical JSON of a module IR (cache key);
- :class:`KernelCompileError` -- with ``lineno``, ``reason`` and ``kernel``;
- :func:`source_of` -- where a compiled kernel's IR lines are in the user's file (the
  in-kernel hazard reports of ``ACCEL_SANITIZE``: runtime/sanitizer.py).
"""

from __future__ import annotations

import ast
import copy
import hashlib
import inspect
import json
import textwrap
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from abi import kernel_frontend, kernel_lang
from abi.kernel_frontend import LanguageError
from runtime.errors import InvalidValueError

FORMAT = kernel_lang.IR_FORMAT
ISA = kernel_lang.ISA
ISA_VERSION = kernel_lang.ISA_VERSION

#: dtype name -> (launch-ABI dtype code, itemsize in bytes), and their short spellings.
DTYPES = kernel_lang.DTYPES
DTYPE_ALIASES = kernel_lang.DTYPE_ALIASES
BUILTINS = kernel_frontend.BUILTINS
normalize_dtype = kernel_frontend.normalize_dtype


class KernelCompileError(LanguageError, InvalidValueError):
    """A kernel the front end rejects, as the runtime raises it: the front end's
    ``LanguageError`` (``lineno`` 1-based in the user's file -- for a function object, the
    file that defines it --, ``reason`` the rule it breaks) that is also an
    InvalidValueError, like every argument the runtime refuses."""

    @classmethod
    def of(cls, e: LanguageError) -> KernelCompileError:
        """The front end's error as the runtime raises it: an InvalidValueError, like
        every argument the runtime refuses."""
        return cls(e.reason, e.lineno, e.kernel)


# --------------------------------------------------------------------------- sources


@dataclass
class _Unit:
    """One kernel definition and the offset from its AST line numbers to the user's."""

    fn: ast.FunctionDef
    offset: int
    file: str = "<source>"  #: the user's file (a function object's), else ``<source>``


@dataclass(frozen=True)
class KernelSource:
    """Where a compiled kernel came from: the user's ``file``, the user's line of each
    line of the IR's ``source`` (``lines[i]`` for IR line ``i + 1``; 0 where no statement
    starts), and its shared arrays (name, dtype) in the front end's order, the order the
    firmware numbers them in."""

    file: str
    lines: tuple[int, ...]
    shared: tuple[tuple[str, str], ...]

    def site(self, ir_line: int) -> str:
        """``file:line`` in the user's file of IR source line ``ir_line``."""
        user = self.lines[ir_line - 1] if 0 < ir_line <= len(self.lines) else 0
        return f"{self.file}:{user or '?'}"


#: (kernel name, IR source) -> its KernelSource, for every kernel this process compiled
#: (two identical definitions in different files share an entry: the later one's)
_SOURCES: dict[tuple[str, str], KernelSource] = {}


def source_of(ir: dict[str, Any]) -> KernelSource | None:
    """The :class:`KernelSource` of an IR this process compiled, else None."""
    return _SOURCES.get((ir.get("name", ""), ir.get("source", "")))


def _parse(text: str, offset: int, file: str = "<source>") -> list[_Unit]:
    """Parse source text whose line 1 is line ``offset + 1`` of the user's file into its
    top-level kernel definitions; anything else at the top level is an error."""
    try:
        return [_Unit(fn, offset, file) for fn in kernel_frontend.definitions(text, offset)]
    except LanguageError as e:
        raise KernelCompileError.of(e) from None


def _units_of_function(fn: Callable[..., Any]) -> list[_Unit]:
    """A function object's definition, with line numbers of the file that defines it.

    ``inspect.getsource`` starts at the first decorator, and so does ``co_firstlineno``,
    so the offset is the same whether or not the function is decorated. The decorators
    go: the host applied them (``@runtime.kernel``), they are not part of the kernel."""
    fn = inspect.unwrap(fn)
    code = getattr(fn, "__code__", None)
    if code is None:
        raise KernelCompileError(f"{fn!r} is not a Python function", 0)
    if fn.__name__ == "<lambda>":
        raise KernelCompileError("a kernel must be a `def`, not a lambda",
                                 code.co_firstlineno)
    try:
        text = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError) as e:
        raise KernelCompileError(f"cannot read the source of {fn.__name__}: {e}", 0) from None
    offset = code.co_firstlineno - 1
    units = _parse(text, offset, code.co_filename)
    if len(units) != 1:  # pragma: no cover - getsource returns one definition
        raise KernelCompileError("a kernel must be exactly one `def`", 1 + offset)
    units[0].fn.decorator_list = []
    return units


def _units(source: Any) -> list[_Unit]:
    if isinstance(source, str):
        return _parse(textwrap.dedent(source), 0)
    if isinstance(source, (list, tuple)):
        return [u for item in source for u in _units(item)]
    if callable(source):
        return _units_of_function(source)
    raise InvalidValueError(
        f"a kernel is a function, source text or a list of functions, not {type(source).__name__}")


def _ir(unit: _Unit) -> dict[str, Any]:
    """One kernel's IR (docs/kernels.md, "Module IR"), once the front end accepts it."""
    try:
        info = kernel_frontend.check(unit.fn, unit.offset)
    except LanguageError as e:
        raise KernelCompileError.of(e) from None
    source, lines = _clean_source(unit.fn, unit.offset)
    _SOURCES[info.name, source] = KernelSource(
        unit.file, lines, tuple((n, dtype) for n, (_, dtype) in info.shared.items()))
    return {
        "name": info.name,
        "params": info.ir_params(),
        "source": source,
        "shared_mem": info.shared_mem,
        "uses_barrier": info.uses_barrier,
        "uses_atomics": info.uses_atomics,
        "uses_mma": info.uses_mma,
        "dynamic_shared": info.dynamic_shared,
    }


def _clean_source(fn: ast.FunctionDef, offset: int) -> tuple[str, tuple[int, ...]]:
    """The validated function re-printed: no decorators, annotations or docstring, and
    the dtypes of shared_array and dynamic_shared spelled canonically ("f32" ->
    "float32"); and the user's line of each of its lines (``offset`` + the line in the
    parsed text) where a statement starts: the re-printed text parses to the same tree,
    so its statements pair with the original's in walk order."""
    fn = copy.deepcopy(fn)
    fn.decorator_list = []
    fn.returns = None
    fn.type_comment = None
    for arg in fn.args.args:
        arg.annotation = None
        arg.type_comment = None
    fn.body = kernel_frontend.strip_docstring(fn.body) or [ast.Pass()]
    for node in ast.walk(fn):  # the firmware need not know the dtype aliases
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in kernel_lang.builtins_of("declaration")):
            node.args[-1].value = normalize_dtype(node.args[-1].value)  # checked: a name
    source = ast.unparse(ast.fix_missing_locations(fn))
    lines = [0] * (source.count("\n") + 1)
    printed = ast.parse(source).body[0]
    for old, new in zip(ast.walk(fn), ast.walk(printed)):
        if isinstance(new, ast.stmt) and not lines[new.lineno - 1]:
            lines[new.lineno - 1] = old.lineno + offset
    return source, tuple(lines)


# --------------------------------------------------------------------------- public API


def validate(source: str | Callable[..., Any], name: str | None = None) -> dict[str, Any]:
    """The IR of one kernel (docs/kernels.md), with its ``name``.

    ``source`` is a function object or source text. Source text with several ``def``\\ s
    needs ``name`` to pick one (every definition is validated); otherwise use
    :func:`compile_module`. Raises :class:`KernelCompileError`."""
    units = _units(source)
    irs = [_ir(u) for u in units]
    if name is not None:
        for ir in irs:
            if ir["name"] == name:
                return ir
        raise KernelCompileError(f"no kernel named {name!r} in the source", 1)
    if len(irs) != 1:
        names = ", ".join(ir["name"] for ir in irs)
        raise KernelCompileError(f"the source defines {len(irs)} kernels ({names}); pass "
                                 "name= or use compile_module", units[1].fn.lineno
                                 + units[1].offset)
    return irs[0]


def compile_module(source_or_functions: str | Callable[..., Any]
                   | Iterable[str | Callable[..., Any]]) -> dict[str, Any]:
    """The module IR of every kernel in a source string, a function or a list of them."""
    src = source_or_functions
    if not isinstance(src, (str, list, tuple)) and not callable(src):
        src = list(src)
    kernels: dict[str, dict[str, Any]] = {}
    for unit in _units(src):
        ir = _ir(unit)
        if ir["name"] in kernels:
            raise KernelCompileError(f"a kernel named {ir['name']!r} is defined twice",
                                     unit.fn.lineno + unit.offset, ir["name"])
        kernels[ir["name"]] = ir
    return {"format": FORMAT, "isa": ISA, "isa_version": ISA_VERSION, "kernels": kernels}


def canonical_json(module_ir: dict[str, Any]) -> bytes:
    """One byte string per IR: sorted keys, no whitespace, UTF-8."""
    return json.dumps(module_ir, sort_keys=True, separators=(",", ":"),
                      ensure_ascii=False).encode()


def module_hash(module_ir: dict[str, Any]) -> str:
    """sha256 (hex) of the module IR's canonical JSON: a cache key for loaded modules."""
    return hashlib.sha256(canonical_json(module_ir)).hexdigest()


__all__ = ["BUILTINS", "DTYPES", "DTYPE_ALIASES", "KernelCompileError", "canonical_json",
           "compile_module", "module_hash", "normalize_dtype", "validate"]
