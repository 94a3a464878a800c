"""The firmware's check of a kernel's IR at its trust boundary, and what the lowering needs
to know about its names.

A process may hand the device any bytes it likes (the driver checks a module's format,
not its code), so the firmware checks every kernel again before it compiles it -- with
the language's one front end, ``abi/kernel_frontend.py``, the very checker the runtime ran
on the user's source: the two can judge a kernel differently only if they were given
different kernels. Then what only the firmware can check: that the IR describes its
source truthfully (params, kinds, ndims, dtypes, static shared bytes) and that a launch's
argument types fit it (:func:`_bind`).

:func:`validate` is total: whatever the IR holds, it returns a :class:`Kernel` or raises
:class:`KernelCompileError`. The front end bounds what the lowering and numba will see (the
language's limits, abi/kernel_lang.py); the firmware adds the size of the IR's source
(:data:`MAX_SOURCE_CHARS`), which it parses before any of that.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from typing import Any

from numba import types

from abi import kernel_frontend, kernel_lang
from abi.kernel_frontend import LanguageError
from firmware.managed import MANAGED_SUFFIX

DTYPE_NAMES: frozenset[str] = frozenset(kernel_lang.DTYPES)
DTYPE_ALIASES: dict[str, str] = kernel_lang.DTYPE_ALIASES
#: Built-ins that declare block-shared arrays: only as ``name = <call>``.
DECLARATIONS = tuple(sorted(kernel_lang.builtins_of("declaration")))
#: The shape recorded for a ``dynamic_shared`` array: 1-D, its length set by the launch
#: (its ``shared_mem`` bytes over the itemsize; every such array aliases the same bytes).
DYNAMIC_SHAPE = (-1,)
#: Thread/block id built-ins -> the generated code's variable prefix (dimension appended).
ID_BUILTINS = {"global_id": "_gid", "local_id": "_l", "group_id": "_g",
               "local_size": "_ls", "num_groups": "_ng"}
#: Math built-ins the generated code calls by another name (the rest keep theirs).
MATH_BUILTINS = {"sqrt": "math.sqrt", "exp": "math.exp", "log": "math.log",
                 "sin": "math.sin", "cos": "math.cos", "tanh": "math.tanh",
                 "floor": "_rt_floor"}  # defined for every float (firmware/intrinsics.py)
assert set(ID_BUILTINS) == kernel_lang.builtins_of("id")
assert set(MATH_BUILTINS) <= kernel_lang.builtins_of("math")
#: Block-collective built-ins: every thread of a block issues them together, so they
#: follow the barrier rule and are phase boundaries in the lowering.
_COLLECTIVES = kernel_lang.COLLECTIVES
#: The language's limits, which the lowering and the JIT rely on (abi/kernel_lang.py).
MAX_NDIM = kernel_lang.MAX_NDIM
MAX_NODES = kernel_lang.MAX_NODES
SHARED_LIMIT = kernel_lang.SHARED_LIMIT
#: Characters of an IR's source the firmware parses at all (the driver takes at most
#: ``ACCEL_KERNEL_SOURCE_MAX``; the JIT may be handed an IR no driver checked).
MAX_SOURCE_CHARS = 256 * 1024
#: A loop-free kernel body of at most this many syntax-tree nodes is "bounded work" (see
#: bounded_work): each thread evaluates each node at most once.
INLINE_MAX_NODES = 256


class KernelCompileError(ValueError):
    """The IR failed re-validation, or numba could not compile the lowered kernel."""


# --------------------------------------------------------------------------- arg types


@dataclass(frozen=True)
class ArgType:
    """One parsed ``arg_types`` entry."""

    dtype: str
    ndim: int  # 0 for a scalar
    #: a buffer in managed memory (the suffix MANAGED_SUFFIX): its accesses mark the pages
    #: they touch in an extra page-map argument (firmware/managed.py)
    managed: bool = False

    @staticmethod
    def parse(text: str) -> "ArgType":
        if not isinstance(text, str):
            raise KernelCompileError(f"argument type {text!r} is not a string")
        managed = text.endswith(MANAGED_SUFFIX)
        if managed:
            text = text[: -len(MANAGED_SUFFIX)]
            if not text.endswith("d]"):
                raise KernelCompileError(f"a managed scalar in argument type {text[:40]!r}")
        name, ndim = text, 0
        if text.endswith("d]") and "[" in text:
            name, _, rest = text.partition("[")
            try:
                ndim = int(rest[:-2])
            except ValueError:
                raise KernelCompileError(f"bad argument type {text[:40]!r}") from None
            if not 1 <= ndim <= MAX_NDIM:
                raise KernelCompileError(f"bad buffer rank in argument type {text[:40]!r}")
        name = DTYPE_ALIASES.get(name, name)
        if name not in DTYPE_NAMES:
            raise KernelCompileError(f"unknown dtype in argument type {text[:40]!r}")
        return ArgType(name, ndim, managed)

    def numba_type(self) -> Any:
        scalar = types.boolean if self.dtype == "bool" else getattr(types, self.dtype)
        return types.Array(scalar, self.ndim, "C") if self.ndim else scalar

    def extra_numba_types(self) -> tuple[Any, ...]:
        """The trailing ``_grid`` arguments this argument adds: a managed buffer's page map
        (uint8, one per 64 KiB page its bytes span) and its first byte's offset in its first
        page (int64); nothing for any other argument."""
        return (types.Array(types.uint8, 1, "C"), types.int64) if self.managed else ()

    @property
    def kind(self) -> str:
        """'int' or 'float': the per-thread-array class of a value of this type."""
        return "float" if self.dtype.startswith("float") else "int"


# --------------------------------------------------------------------------- validation


def reject(node: ast.AST, reason: str) -> KernelCompileError:
    return KernelCompileError(f"line {getattr(node, 'lineno', '?')}: {reason}")


@dataclass
class Kernel:
    """The validated kernel and what the lowering needs to know about its names."""

    fn: ast.FunctionDef
    params: list[str]
    arg_types: list[ArgType]
    buffers: dict[str, int]  # buffer param -> position
    scalars: set[str]
    locals: set[str]
    shared: dict[str, tuple[tuple[int, ...], str]] = field(default_factory=dict)


def const_int(node: ast.AST) -> int | None:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    return None


def contains(node: ast.AST | list[ast.stmt], pred: Any) -> bool:
    nodes = node if isinstance(node, list) else [node]
    return any(pred(n) for top in nodes for n in ast.walk(top))


def _is_collective(n: ast.AST) -> bool:
    """A call of barrier() or mma(): the barrier rule applies to both."""
    return (isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
            and n.func.id in _COLLECTIVES)


def is_mma(s: ast.stmt) -> bool:
    return (isinstance(s, ast.Expr) and isinstance(s.value, ast.Call)
            and isinstance(s.value.func, ast.Name) and s.value.func.id == "mma")


def calls_mma(stmts: list[ast.stmt]) -> bool:
    """Whether the kernel body issues mma() anywhere (it then gets the matrix helper)."""
    return contains(stmts, lambda n: isinstance(n, ast.stmt) and is_mma(n))


#: The device capability each built-in needs (the flags of the IR say the same, but a
#: hand-made IR may lie: the firmware reads the source).
_CAPABILITY_OF = kernel_lang.CAPABILITY_OF


def capabilities_used(k: Kernel) -> frozenset[str]:
    """The device capabilities the kernel's source uses (``matrix``, ``atomics``,
    ``shared_mem``), whatever its IR's ``uses_*`` flags claim."""
    return frozenset(_CAPABILITY_OF[n.func.id] for stmt in k.fn.body for n in ast.walk(stmt)
                     if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                     and n.func.id in _CAPABILITY_OF)


def validate(ir: dict[str, Any], arg_types: tuple[str, ...]) -> Kernel:
    """Check the IR's source with the language's front end (the firmware never trusts the
    runtime), the IR against its source, and both against the launch's types. Raises
    :class:`KernelCompileError` (a ValueError) naming the line and the reason, and nothing
    else, whatever the IR holds: the explicit checks reject malformed fields, and an error
    they did not foresee (a field of an unexpected type deep inside) is turned into one
    here, at the boundary."""
    try:
        return _validate(ir, arg_types)
    except KernelCompileError:
        raise
    except (RecursionError, MemoryError, TypeError, AttributeError, KeyError, IndexError,
            ValueError, OverflowError) as exc:
        raise KernelCompileError(f"malformed kernel IR ({type(exc).__name__}: "
                                 f"{str(exc)[:200]})") from None


def _check_ir_fields(ir: Any, arg_types: Any) -> None:
    """The IR's fields have the types docs/kernels.md gives them (the driver checked some at
    load; a hand-made IR may reach the JIT without it)."""
    if not isinstance(ir, dict):
        raise KernelCompileError("kernel IR is not an object")
    source = ir.get("source")
    if not isinstance(source, str):
        raise KernelCompileError("kernel IR has no source")
    if len(source) > MAX_SOURCE_CHARS:
        raise KernelCompileError(f"kernel source of {len(source)} characters exceeds the "
                                 f"firmware's {MAX_SOURCE_CHARS}")
    params = ir.get("params")
    if not isinstance(params, list):
        raise KernelCompileError("IR params is not a list")
    for p in params:
        if not (isinstance(p, dict) and isinstance(p.get("name"), str)):
            raise KernelCompileError(f"IR parameter {str(p)[:60]} is not an object with a name")
        if p.get("kind") not in ("buffer", "scalar"):
            raise KernelCompileError(f"parameter {p['name']!r} has an unknown kind")
        if not (p.get("dtype") is None or isinstance(p.get("dtype"), str)):
            raise KernelCompileError(f"parameter {p['name']!r} has a malformed dtype")
        ndim = p.get("ndim", 1)
        if p["kind"] == "buffer" and not (type(ndim) is int and 1 <= ndim <= MAX_NDIM):
            raise KernelCompileError(f"buffer {p['name']!r} has a malformed ndim")
    shared = ir.get("shared_mem", 0)
    if not (type(shared) is int and 0 <= shared <= SHARED_LIMIT):
        raise KernelCompileError(f"IR shared_mem {str(shared)[:40]} is not a byte count of at "
                                 f"most {SHARED_LIMIT}")
    if not (isinstance(arg_types, (tuple, list)) and all(isinstance(t, str) for t in arg_types)):
        raise KernelCompileError("argument types must be a sequence of strings")


def _validate(ir: dict[str, Any], arg_types: tuple[str, ...]) -> Kernel:
    _check_ir_fields(ir, arg_types)
    try:
        defs = kernel_frontend.definitions(ir["source"])
        if len(defs) != 1:
            raise KernelCompileError(f"line {defs[1].lineno}: an IR's source is one kernel "
                                     "definition")
        fn = defs[0]
        info = kernel_frontend.check(fn)
    except LanguageError as exc:  # the language's own words: the user's line and reason
        raise KernelCompileError(str(exc)) from None
    k = _bind(fn, info, ir, arg_types)
    fn.body = kernel_frontend.strip_docstring(fn.body) or [ast.Pass()]
    fn.returns = None
    for arg in fn.args.args:  # the IR's params and the launch's types carry the dtypes
        arg.annotation = None
    return k


def _bind(fn: ast.FunctionDef, info: kernel_frontend.KernelInfo, ir: dict[str, Any],
          arg_types: tuple[str, ...]) -> Kernel:
    """The firmware's own checks, past the language: the IR says what the source does
    (its params, their kinds, ndims and dtypes, its static shared bytes: a hand-made IR
    may lie), and the launch's argument types fit the kernel."""
    params = list(info.params)
    ir_params = ir["params"]
    if [p["name"] for p in ir_params] != params:
        raise KernelCompileError("IR params do not match the kernel's parameters")
    named = {n.id for stmt in fn.body for n in ast.walk(stmt) if isinstance(n, ast.Name)}
    for p in ir_params:
        name, kind = p["name"], p["kind"]
        # a parameter the body never names may be either (the runtime calls it a scalar)
        used_as = "buffer" if name in info.buffers else "scalar"
        if kind != used_as and name in named:
            raise KernelCompileError(f"IR parameter {name!r} is a {kind}; the kernel's source "
                                     f"uses it as a {used_as}")
        if name in info.buffers and p.get("ndim", 1) != info.buffers[name]:
            raise KernelCompileError(f"IR buffer {name!r} has {p.get('ndim', 1)} dimensions, "
                                     f"the kernel indexes it with {info.buffers[name]}")
        annotated, want = info.params[name], p.get("dtype")
        if annotated is not None and DTYPE_ALIASES.get(want, want) != annotated:
            raise KernelCompileError(f"IR parameter {name!r} is {want}, its annotation "
                                     f"{annotated}")
    if ir.get("shared_mem", 0) != info.shared_mem:  # the driver checked the IR's figure
        raise KernelCompileError(f"IR shared_mem {ir.get('shared_mem')!r} does not match the "
                                 f"{info.shared_mem} bytes of the kernel's shared arrays")
    if len(arg_types) != len(params):
        raise KernelCompileError(f"{len(params)} parameters but {len(arg_types)} argument types")
    parsed = [ArgType.parse(t) for t in arg_types]
    buffers: dict[str, int] = {}
    scalars: set[str] = set()
    for pos, (p, t) in enumerate(zip(ir_params, parsed)):
        want = p.get("dtype")
        if want is not None and DTYPE_ALIASES.get(want, want) != t.dtype:
            raise KernelCompileError(f"parameter {p['name']!r} is {want} but got {t.dtype}")
        if p["kind"] == "buffer":
            if t.ndim == 0:
                raise KernelCompileError(f"parameter {p['name']!r} is a buffer, got a scalar")
            if p.get("ndim", 1) != t.ndim:
                raise KernelCompileError(f"buffer {p['name']!r} is indexed with "
                                         f"{p.get('ndim', 1)} dimensions, got {t.ndim}")
            buffers[p["name"]] = pos
        else:
            if t.ndim:
                raise KernelCompileError(f"parameter {p['name']!r} is a scalar, got a buffer")
            scalars.add(p["name"])
    shared = {name: (DYNAMIC_SHAPE if shape is None else shape, dtype)
              for name, (shape, dtype) in info.shared.items()}
    k = Kernel(fn, params, parsed, buffers, scalars, info.locals, shared)
    for n in ast.walk(fn):  # the dtypes the launch set, where the source named none
        if not (isinstance(n, ast.Call) and isinstance(n.func, ast.Name)):
            continue
        arrays = [a.id for a in n.args if isinstance(a, ast.Name)]  # checked: they lead
        if n.func.id == "atomic_add" and buffer_dtype(k, arrays[0]) == "bool":
            raise reject(n, "atomic_add on a bool buffer")
        if n.func.id == "mma":
            dtypes = {buffer_dtype(k, a) for a in arrays[:kernel_lang.MMA_OPERANDS]}
            if len(dtypes) != 1 or not dtypes <= set(kernel_lang.MMA_DTYPES):
                raise reject(n, "mma operands must all be float32 or all float64, not "
                                f"{', '.join(sorted(dtypes))}")
    return k


def buffer_dtype(k: Kernel, name: str) -> str:
    if name in k.buffers:
        return k.arg_types[k.buffers[name]].dtype
    return k.shared[name][1]


def buffer_ndim(k: Kernel, name: str) -> int:
    if name in k.buffers:
        return k.arg_types[k.buffers[name]].ndim
    return len(k.shared[name][0])


def _binds_outer_loop(stmt: ast.stmt) -> bool:
    """Whether ``stmt`` contains a break/continue of the loop it sits in."""
    if isinstance(stmt, (ast.Break, ast.Continue)):
        return True
    if isinstance(stmt, (ast.For, ast.While)):
        return False
    if isinstance(stmt, ast.If):
        return any(_binds_outer_loop(s) for s in stmt.body + stmt.orelse)
    return False


def structural(stmt: ast.stmt, in_structural_loop: bool) -> bool:
    """Whether a statement must stay at block level: it holds a barrier, or it is (or
    holds) a break/continue of a block-level loop."""
    if isinstance(stmt, ast.Expr) and _is_collective(stmt.value):
        return True
    if contains(stmt, _is_collective):
        return True
    return in_structural_loop and _binds_outer_loop(stmt)


def bounded_work(k: Kernel) -> int | None:
    """The number of syntax-tree nodes of the kernel's body when its work per thread is
    statically bounded and small, else None: no ``for`` or ``while`` anywhere (so no
    barrier in a loop either), no ``mma`` (its work grows with its tiles) and at most
    :data:`INLINE_MAX_NODES` nodes. Such a body evaluates each node at most once per
    thread (each built-in is bounded too: ``**`` on integers by 63 squarings), so a launch
    of T threads costs O(T * nodes) whatever its arguments; the scheduler may run it on
    its control thread, which must do bounded work per pass."""
    nodes = 0
    for stmt in k.fn.body:
        for n in ast.walk(stmt):
            if isinstance(n, (ast.For, ast.While)) or (isinstance(n, ast.stmt) and is_mma(n)):
                return None
            nodes += 1
    return nodes if nodes <= INLINE_MAX_NODES else None
