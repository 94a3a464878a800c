"""Re-validation of a kernel's IR in the firmware, and what the lowering needs to know
about its names.

docs/kernels.md is the language. The runtime's front end (runtime/kernels.py) checks it
first, with line-and-reason messages for users; the firmware checks again with its own
code because it never trusts the runtime (defence in depth: a hand-made IR reaches here
through the driver). Where the two differ, the firmware may be stricter, never looser.

It is stricter in size: a source, its syntax tree, the tree's depth, loop nesting and a
kernel's static shared memory have firmware limits (:data:`MAX_SOURCE_CHARS`,
:data:`MAX_NODES`, :data:`MAX_DEPTH`, :data:`MAX_LOOP_NESTING`, :data:`SHARED_LIMIT`),
because the lowering and Python's compiler recurse over the tree (and Python allows 20
nested blocks), numba's compile time grows faster than linearly with it (~5 s for 1,200
nodes on the 2-core test machine), and the JIT itself must bound what a block allocates
where no driver checked the IR. :func:`validate` is total: whatever the IR holds, it
returns a :class:`Kernel` or raises :class:`KernelCompileError`. The language's types are
stricter too: an index or an integer argument of ``mma`` must be an integer (a float does
not compile; numba would convert it unchecked).
"""

from __future__ import annotations

import ast
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numba import types

from abi import kernel_lang
from firmware.managed import MANAGED_SUFFIX

#: The language itself (element types, built-ins, collectives, operators) is the
#: contract's, abi/kernel_lang.py: the runtime's front end reads the same tables.
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
BUILTINS: frozenset[str] = frozenset(kernel_lang.BUILTINS)
#: Block-collective built-ins: every thread of a block issues them together, so they
#: follow the barrier rule and are phase boundaries in the lowering.
_COLLECTIVES = kernel_lang.COLLECTIVES
#: mma(c, a, b, row, col, k0, tm, tn, tk, beta): the matrix unit (firmware/matrix.py).
_MMA_NARGS = kernel_lang.BUILTINS["mma"].nargs
#: Most dimensions of a buffer or shared array (the fault array has room for this many).
MAX_NDIM = kernel_lang.MAX_NDIM
#: Firmware limits on one kernel (see the module doc): source characters, syntax-tree
#: nodes (ast.walk's count; ~20 s of numba compile time on the 2-core test machine at the
#: limit; the kernel library's largest, gemm, has 265), and tree depth (ast.unparse and
#: copy.deepcopy in the lowering recurse ~3 frames per level; Python allows 1000 frames).
MAX_SOURCE_CHARS = 256 * 1024
MAX_NODES = 4096
MAX_DEPTH = 100
#: Most loops nested in one another: Python's compiler allows 20 nested blocks, and the
#: generated ``_grid`` puts a block loop and three thread loops around block-level ones.
MAX_LOOP_NESTING = 16
#: Most bytes of block-shared memory a kernel may declare statically (and a launch may
#: ask for dynamically): 20x this ISA's 48 KiB per block. The driver checks the IR's
#: figure against the device; this bounds what the JIT allocates per block without it.
SHARED_LIMIT = 1 << 20
#: Integer constants must fit in 64 bits (numba cannot type larger ones).
_CONST_LIMIT = 1 << 64
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


_ALLOWED_NODES: tuple[type, ...] = (
    ast.Module, ast.FunctionDef, ast.arguments, ast.arg, ast.Assign, ast.AugAssign, ast.If,
    ast.For, ast.While, ast.Break, ast.Continue, ast.Return, ast.Pass, ast.Expr, ast.Name,
    ast.Load, ast.Store, ast.Constant, ast.BinOp, ast.UnaryOp, ast.BoolOp, ast.Compare,
    ast.IfExp, ast.Call, ast.Subscript, ast.Tuple, ast.Attribute,
    ast.operator, ast.unaryop, ast.boolop, ast.cmpop,
)
_REJECT_REASONS: dict[type, str] = {
    ast.Import: "imports", ast.ImportFrom: "imports", ast.Global: "`global`",
    ast.Nonlocal: "`nonlocal`", ast.Lambda: "lambda", ast.ListComp: "comprehensions",
    ast.SetComp: "comprehensions", ast.DictComp: "comprehensions",
    ast.GeneratorExp: "generator expressions", ast.With: "`with`", ast.AsyncWith: "`with`",
    ast.Try: "`try`", ast.Raise: "`raise`", ast.Yield: "`yield`", ast.YieldFrom: "`yield`",
    ast.Await: "`await`", ast.AsyncFor: "async", ast.AsyncFunctionDef: "async",
    ast.ClassDef: "classes", ast.Delete: "`del`", ast.Starred: "starred arguments",
    ast.NamedExpr: "`:=`", ast.AnnAssign: "annotated assignments",
    ast.List: "lists", ast.Dict: "dicts", ast.Set: "sets", ast.JoinedStr: "f-strings",
    ast.Slice: "slices", ast.Assert: "`assert`",
}
_OPERATOR_NODES = (ast.operator, ast.unaryop, ast.boolop, ast.cmpop)


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
    tainted: set[str] = field(default_factory=set)  # locals that may differ between threads


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
    """Re-validate the IR's source against docs/kernels.md's whitelist (defence in depth:
    the firmware never trusts the runtime) and check it against the launch's types.
    Raises :class:`KernelCompileError` (a ValueError) naming the line and the reason, and
    nothing else, whatever the IR holds: the explicit checks reject malformed fields, and
    an error they did not foresee (a recursion or memory limit of Python's parser, a field
    of an unexpected type deep inside) is turned into one here, at the boundary."""
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


def _check_tree_size(tree: ast.AST) -> None:
    """At most MAX_NODES nodes and MAX_DEPTH levels (counted without recursion)."""
    count = 0
    todo: deque[tuple[ast.AST, int, int]] = deque([(tree, 1, 0)])
    while todo:
        node, depth, line = todo.popleft()
        line = getattr(node, "lineno", line)  # operators and contexts have none
        count += 1
        if count > MAX_NODES:
            raise KernelCompileError(f"kernel has more than the firmware's {MAX_NODES} "
                                     "syntax-tree nodes")
        if depth > MAX_DEPTH:
            raise KernelCompileError(f"line {line}: expression or statement nesting deeper "
                                     f"than the firmware's {MAX_DEPTH} levels")
        todo.extend((child, depth + 1, line) for child in ast.iter_child_nodes(node))


def _loop_nesting(stmts: list[ast.stmt]) -> int:
    """How deeply loops nest in ``stmts`` (recursion bounded by MAX_DEPTH)."""
    deepest = 0
    for s in stmts:
        inner = [b for b in (getattr(s, "body", None), getattr(s, "orelse", None))
                 if isinstance(b, list)]
        depth = max((_loop_nesting(b) for b in inner), default=0)
        deepest = max(deepest, depth + isinstance(s, (ast.For, ast.While)))
    return deepest


def _validate(ir: dict[str, Any], arg_types: tuple[str, ...]) -> Kernel:
    _check_ir_fields(ir, arg_types)
    try:
        tree = ast.parse(ir["source"])
    except (SyntaxError, ValueError) as exc:  # ValueError: e.g. a NUL byte
        raise KernelCompileError(f"kernel source does not parse: {exc}") from None
    _check_tree_size(tree)
    if _loop_nesting(tree.body) > MAX_LOOP_NESTING:
        raise KernelCompileError(f"loops nested deeper than the firmware's {MAX_LOOP_NESTING}")
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.FunctionDef):
        raise KernelCompileError("kernel source must be exactly one function definition")
    fn = tree.body[0]
    if fn.decorator_list or fn.returns is not None:
        raise reject(fn, "decorators and return annotations are not allowed")
    a = fn.args
    if a.posonlyargs or a.kwonlyargs or a.vararg or a.kwarg or a.defaults or a.kw_defaults:
        raise reject(fn, "only plain positional parameters are allowed")
    params = [arg.arg for arg in a.args]
    ir_params = ir["params"]
    if [p["name"] for p in ir_params] != params:
        raise KernelCompileError("IR params do not match the kernel's parameters")
    if len(arg_types) != len(params):
        raise KernelCompileError(f"{len(params)} parameters but {len(arg_types)} argument types")
    parsed = [ArgType.parse(t) for t in arg_types]
    buffers: dict[str, int] = {}
    scalars: set[str] = set()
    for pos, (p, t) in enumerate(zip(ir_params, parsed)):
        want = p.get("dtype")
        if want is not None and DTYPE_ALIASES.get(want, want) != t.dtype:
            raise KernelCompileError(f"parameter {p['name']!r} is {want} but got {t.dtype}")
        if p.get("kind") == "buffer":
            if t.ndim == 0:
                raise KernelCompileError(f"parameter {p['name']!r} is a buffer, got a scalar")
            if p.get("ndim", 1) != t.ndim:
                raise KernelCompileError(f"buffer {p['name']!r} is indexed with "
                                         f"{p.get('ndim', 1)} dimensions, got {t.ndim}")
            buffers[p["name"]] = pos
        elif p.get("kind") == "scalar":
            if t.ndim:
                raise KernelCompileError(f"parameter {p['name']!r} is a scalar, got a buffer")
            scalars.add(p["name"])
        else:
            raise KernelCompileError(f"parameter {p.get('name')!r} has an unknown kind")

    # Names bound by the body.
    bound: set[str] = set()
    for n in ast.walk(fn):
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            bound.add(n.id)
    k = Kernel(fn, params, parsed, buffers, scalars, bound - set(params))

    body = fn.body
    if (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)):
        fn.body = body = body[1:] or [ast.Pass()]

    callees = {id(n.func) for n in ast.walk(fn) if isinstance(n, ast.Call)}
    declared = {id(n.value) for n in ast.walk(fn) if isinstance(n, ast.Assign)
                and isinstance(n.value, ast.Call) and isinstance(n.value.func, ast.Name)
                and n.value.func.id in DECLARATIONS}
    for n in ast.walk(fn):  # constructs the language does not have, first
        for bad, what in _REJECT_REASONS.items():
            if isinstance(n, bad):
                raise reject(n, f"{what} not allowed in a kernel")
    for n in ast.walk(fn):
        if isinstance(n, ast.Name) and (n.id in BUILTINS or n.id == "range") \
                and isinstance(n.ctx, ast.Load) and id(n) not in callees:
            raise reject(n, f"built-in {n.id!r} may only be called")
        if isinstance(n, ast.FunctionDef) and n is not fn:
            raise reject(n, "nested functions are not allowed in a kernel")
        if not isinstance(n, _ALLOWED_NODES) or (isinstance(n, _OPERATOR_NODES)
                                                 and type(n).__name__ not in kernel_lang.OPERATORS):
            raise reject(n, f"{type(n).__name__} is not allowed in a kernel")
        if isinstance(n, ast.Name):
            if n.id.startswith("__"):
                raise reject(n, f"dunder name {n.id!r}")
            if n.id in BUILTINS or n.id == "range":
                if isinstance(n.ctx, ast.Store) or n.id in params:
                    raise reject(n, f"built-in {n.id!r} cannot be rebound")
            elif n.id not in params and n.id not in k.locals:
                raise reject(n, f"free name {n.id!r} is not a parameter, local or built-in")
        elif isinstance(n, ast.arg) and n.arg.startswith("__"):
            raise reject(n, f"dunder name {n.arg!r}")
        elif isinstance(n, (ast.For, ast.While)) and n.orelse:
            raise reject(n, "loop `else` clauses are not supported")
        elif isinstance(n, ast.For):
            it = n.iter
            if not (isinstance(n.target, ast.Name) and isinstance(it, ast.Call)
                    and isinstance(it.func, ast.Name) and it.func.id == "range"
                    and 1 <= len(it.args) <= 3 and not it.keywords):
                raise reject(n, "only `for name in range(...)` loops are allowed")
        elif isinstance(n, ast.Return) and n.value is not None:
            raise reject(n, "kernels return nothing")
        elif isinstance(n, ast.Attribute):
            if n.attr not in ("shape", "size") or not (
                    isinstance(n.value, ast.Name) and n.value.id in buffers):
                raise reject(n, f"attribute .{n.attr} is not allowed (only .shape/.size "
                                "of a buffer parameter)")
        elif isinstance(n, ast.Constant):
            if isinstance(n.value, (str, bytes)) and not _is_dtype_const(n, fn):
                raise reject(n, "string constants are only allowed as dtype names")
            if not isinstance(n.value, (bool, int, float, str)):
                raise reject(n, f"constant {n.value!r} is not allowed")
            if type(n.value) is int and n.value >= _CONST_LIMIT:
                raise reject(n, "integer constant does not fit in 64 bits")
        elif isinstance(n, ast.Call):
            _check_call(n, k, declared)
        elif isinstance(n, ast.Subscript):
            _check_subscript(n, k)
        elif isinstance(n, ast.Expr):
            if not (isinstance(n.value, ast.Call) and isinstance(n.value.func, ast.Name)
                    and n.value.func.id in ("barrier", "atomic_add", "mma")):
                raise reject(n, "only barrier(), atomic_add() and mma() may be used as "
                                "statements")
        elif isinstance(n, ast.Assign):
            if id(n.value) in declared:
                _check_shared(n, k)
            for t in n.targets:
                elts = t.elts if isinstance(t, ast.Tuple) else [t]
                for e in elts:
                    if not isinstance(e, (ast.Name, ast.Subscript)):
                        raise reject(n, "assignment targets are names or buf[index]")
                    if isinstance(e, ast.Name) and e.id in params:
                        raise reject(n, f"parameter {e.id!r} cannot be assigned")
                    if isinstance(t, ast.Tuple) and isinstance(e, ast.Subscript):
                        raise reject(n, "tuple assignment only to names")
        elif isinstance(n, ast.AugAssign):
            if isinstance(n.target, ast.Name) and n.target.id in params:
                raise reject(n, f"parameter {n.target.id!r} cannot be assigned")
    for name in k.shared:
        stores = [n for n in ast.walk(fn) if isinstance(n, ast.Name) and n.id == name
                  and isinstance(n.ctx, ast.Store)]
        if len(stores) != 1:
            raise KernelCompileError(f"shared array {name!r} is assigned more than once")
    static = sum(math.prod(shape) * np.dtype(dtype).itemsize
                 for shape, dtype in k.shared.values() if shape != DYNAMIC_SHAPE)
    if static > SHARED_LIMIT:
        raise KernelCompileError(f"the kernel's shared arrays take {static} bytes, more than "
                                 f"the firmware's {SHARED_LIMIT}")
    if ir.get("shared_mem", 0) != static:  # the driver checked the IR's figure at load
        raise KernelCompileError(f"IR shared_mem {ir.get('shared_mem')!r} does not match the "
                                 f"{static} bytes of the kernel's shared arrays")
    for name in k.locals:
        if name in k.shared:
            continue
        for n in ast.walk(fn):
            if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name) \
                    and n.value.id == name:
                raise reject(n, f"{name!r} is not a buffer and cannot be indexed")
    k.tainted = _tainted(fn, k)
    _check_barriers(fn.body, k, uniform=set(), loop_depth_structural=False)
    return k


def _is_dtype_const(node: ast.Constant, fn: ast.FunctionDef) -> bool:
    for n in ast.walk(fn):
        if (isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.args
                and (n.func.id, n.args[-1]) in (("shared_array", node), ("dynamic_shared", node))):
            return True
    return False


def _check_call(n: ast.Call, k: Kernel, declared: set[int]) -> None:
    if not isinstance(n.func, ast.Name):
        raise reject(n, "only built-in functions may be called")
    name = n.func.id
    if n.keywords:
        raise reject(n, "keyword arguments are not allowed")
    if name == "range":
        return  # position checked with the For
    if name not in BUILTINS:
        raise reject(n, f"call of {name!r}: not a built-in")
    nargs = len(n.args)
    if name in ID_BUILTINS:
        d = const_int(n.args[0]) if nargs == 1 else None
        if d is None or not 0 <= d <= 2:
            raise reject(n, f"{name}() takes one constant dimension 0..2")
    elif name == "barrier":
        if nargs:
            raise reject(n, "barrier() takes no arguments")
    elif name == "atomic_add":
        if nargs != 3 or not (isinstance(n.args[0], ast.Name)
                              and (n.args[0].id in k.buffers or n.args[0].id in k.shared)):
            raise reject(n, "atomic_add(buf, index, value) needs a buffer")
        t = buffer_dtype(k, n.args[0].id)
        if t == "bool":
            raise reject(n, "atomic_add on a bool buffer")
    elif name == "mma":
        _check_mma(n, k)
    elif name in DECLARATIONS:
        if id(n) not in declared:
            raise reject(n, f"{name}() may only be the right side of `name = {name}(...)`")
    elif name in kernel_lang.builtins_of("minmax"):
        if nargs < 2:
            raise reject(n, f"{name}() needs at least two arguments")
    elif nargs != 1:
        raise reject(n, f"{name}() takes one argument")


def _check_mma(n: ast.Call, k: Kernel) -> None:
    """mma's operands: three 2-D buffer parameters of one float dtype (the matrix unit's
    types); the other arguments are evaluated with thread 0's values (the front end
    rejects any that may differ between threads)."""
    if len(n.args) != _MMA_NARGS:
        raise reject(n, f"mma() takes {_MMA_NARGS} arguments")
    names = [a.id if isinstance(a, ast.Name) and a.id in k.buffers else None
             for a in n.args[:3]]
    if None in names:
        raise reject(n, "the first three arguments of mma must be buffer parameters")
    dtypes = {buffer_dtype(k, m) for m in names if m}
    if any(buffer_ndim(k, m) != 2 for m in names if m):
        raise reject(n, "mma operands must be 2-D buffers")
    if len(dtypes) != 1 or not dtypes <= set(kernel_lang.MMA_DTYPES):
        raise reject(n, "mma operands must all be float32 or all float64, not "
                        f"{', '.join(sorted(dtypes))}")


def buffer_dtype(k: Kernel, name: str) -> str:
    if name in k.buffers:
        return k.arg_types[k.buffers[name]].dtype
    return k.shared[name][1]


def buffer_ndim(k: Kernel, name: str) -> int:
    if name in k.buffers:
        return k.arg_types[k.buffers[name]].ndim
    return len(k.shared[name][0])


def _check_subscript(n: ast.Subscript, k: Kernel) -> None:
    v = n.value
    if isinstance(v, ast.Attribute):  # buf.shape[k]
        if v.attr != "shape" or const_int(n.slice) is None:
            raise reject(n, "only buf.shape[constant] may be indexed")
        if not (isinstance(v.value, ast.Name) and v.value.id in k.buffers):
            raise reject(n, "only the .shape of a buffer parameter may be indexed")
        if not 0 <= const_int(n.slice) < buffer_ndim(k, v.value.id):  # type: ignore
            raise reject(n, "shape index out of range")
        return
    if not (isinstance(v, ast.Name) and (v.id in k.buffers or v.id in k.shared)):
        if isinstance(v, ast.Name) and v.id in k.locals and v.id not in k.shared:
            raise reject(n, f"{v.id!r} is not a buffer and cannot be indexed")
        raise reject(n, "only buffers may be indexed")
    idx = n.slice.elts if isinstance(n.slice, ast.Tuple) else [n.slice]
    if len(idx) != buffer_ndim(k, v.id):
        raise reject(n, f"{v.id!r} has {buffer_ndim(k, v.id)} dimensions, "
                        f"indexed with {len(idx)}")


def _check_shared(n: ast.Assign, k: Kernel) -> None:
    """``name = shared_array(shape, dtype)`` or ``name = dynamic_shared(dtype)``."""
    call = n.value
    assert isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
    what = call.func.id
    nargs = 2 if what == "shared_array" else 1
    if len(n.targets) != 1 or not isinstance(n.targets[0], ast.Name) or len(call.args) != nargs:
        sig = "shape, dtype" if nargs == 2 else "dtype"
        raise reject(n, f"{what}({sig}) must be assigned to one name")
    dtype_node = call.args[-1]
    if what == "shared_array":
        shape_node = call.args[0]
        dims = shape_node.elts if isinstance(shape_node, ast.Tuple) else [shape_node]
        shape = tuple(const_int(d) for d in dims)
        if not shape or len(shape) > MAX_NDIM or any(s is None or s < 1 for s in shape):
            raise reject(n, "shared_array shape must be positive integer constants")
    else:
        shape = DYNAMIC_SHAPE
    if not (isinstance(dtype_node, ast.Constant) and isinstance(dtype_node.value, str)):
        raise reject(n, f"{what} dtype must be a dtype name")
    dtype = DTYPE_ALIASES.get(dtype_node.value, dtype_node.value)
    if dtype not in DTYPE_NAMES:
        raise reject(n, f"unknown dtype {dtype_node.value!r}")
    k.shared[n.targets[0].id] = (shape, dtype)  # type: ignore[assignment]


def _uniform_expr(node: ast.AST, k: Kernel, uniform: set[str]) -> bool:
    """Whether every thread of a block computes the same value (the barrier rule): no thread
    ids, no loaded values, no locals tainted by either. Block-level code reads a uniform
    local as thread 0's value."""
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            if not (n.id in k.scalars or n.id in uniform or n.id in k.buffers
                    or (n.id in k.locals and n.id not in k.tainted)
                    or n.id in BUILTINS or n.id == "range"):
                return False
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Name):
            if n.func.id in ("global_id", "local_id"):
                return False
        elif isinstance(n, ast.Subscript):
            if not isinstance(n.value, ast.Attribute):
                return False  # a loaded value
    return True


def _tainted(fn: ast.FunctionDef, k: Kernel) -> set[str]:
    """Locals that may differ between the threads of a block: assigned from thread ids,
    loaded values or tainted locals, or under control flow that depends on those (the
    front end's analysis, repeated: the firmware does not trust the runtime)."""
    tainted: set[str] = set(k.shared)

    def varying(e: ast.AST) -> bool:
        return not _uniform_expr(e, k, set())

    def walk(stmts: list[ast.stmt], ctx: bool) -> None:
        for s in stmts:
            if isinstance(s, (ast.Assign, ast.AugAssign)):
                targets = s.targets if isinstance(s, ast.Assign) else [s.target]
                if ctx or varying(s.value) or isinstance(s, ast.AugAssign) and varying(s.target):
                    tainted.update(n.id for t in targets for n in ast.walk(t)
                                   if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store))
            elif isinstance(s, (ast.If, ast.While, ast.For)):
                cond = s.iter if isinstance(s, ast.For) else s.test
                inner = ctx or varying(cond)
                if isinstance(s, ast.For) and inner:
                    tainted.add(s.target.id)  # type: ignore[attr-defined]
                walk(s.body, inner)
                walk(s.orelse, inner)

    k.tainted = tainted
    while True:
        before = len(tainted)
        walk(fn.body, False)
        if len(tainted) == before:
            return tainted


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


def _check_barriers(stmts: list[ast.stmt], k: Kernel, uniform: set[str],
                    loop_depth_structural: bool) -> None:
    for s in stmts:
        if not structural(s, loop_depth_structural):
            continue
        if isinstance(s, ast.Expr) or isinstance(s, (ast.Break, ast.Continue)):
            continue
        if isinstance(s, ast.If):
            if not _uniform_expr(s.test, k, uniform):
                raise reject(s, "barrier() (or a break of a loop with a barrier) under a "
                                "condition that differs between threads")
            _check_barriers(s.body, k, uniform, loop_depth_structural)
            _check_barriers(s.orelse, k, uniform, loop_depth_structural)
        elif isinstance(s, ast.For):
            if not _uniform_expr(s.iter, k, uniform):
                raise reject(s, "barrier() in a loop whose range differs between threads")
            var = s.target.id  # type: ignore[attr-defined]
            for n in ast.walk(s):
                if isinstance(n, ast.Name) and n.id == var and isinstance(n.ctx, ast.Store) \
                        and n is not s.target:
                    raise reject(n, f"uniform loop variable {var!r} is assigned in its loop")
            _check_barriers(s.body, k, uniform | {var}, True)
        elif isinstance(s, ast.While):
            if not _uniform_expr(s.test, k, uniform):
                raise reject(s, "barrier() in a loop whose condition differs between threads")
            _check_barriers(s.body, k, uniform, True)
        else:
            raise reject(s, "barrier() may only be a statement")


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
