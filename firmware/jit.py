"""The firmware's kernel JIT: module IR -> Numba machine code, cached on disk.

docs/kernels.md is the contract. One kernel's IR (``module["kernels"][name]``) plus the
concrete argument types of a launch (``"float32[1d]"`` for a buffer, ``"float32"`` for a
scalar) and the code-generation :class:`Options` are lowered to the text of a Python
module, written to disk and imported as a real file so that numba's ``cache=True`` works
(``exec``'d code cannot be cached, ARCHITECTURE.md "Numba facts").

Why the generated code looks the way it does
--------------------------------------------
* One entry point, ``_grid(block_lo, block_hi, gx, gy, gz, bx, by, bz, abort, fault,
  *args)``, runs a *range of blocks*, so the engines can split a launch across threads
  and preempt it between blocks: it returns the first block it did not run.
* A block's threads run as loops (the CPU-OpenCL / POCL scheme). The kernel body is cut at
  every ``barrier()`` into *phases*; each phase is its own ``@njit`` function called in a
  loop over the block's threads (LLVM inlines it). Putting a phase in a function makes a
  user ``return`` ("this thread is done") a plain ``return`` at any loop depth. Locals that
  live across phases become per-thread arrays; a ``for``/``while``/``if`` that contains a
  barrier stays at block level (it must be uniform across the block) and the phases inside
  it are thread loops.
* Bounds checks are explicit generated code, not numba's ``boundscheck`` (whose failure is
  an exception with no buffer name, and which numba's cache does not key on): a miss
  records ``fault = [1, param position, flat index]`` and stops the launch.
* Every user loop reads the abort word once per iteration with an atomic load (a plain
  load of a value the loop never writes may be hoisted out of the loop by LLVM, which would
  make a ``while True:`` kernel unkillable).
* ``atomic_add`` is a real LLVM ``atomicrmw add``/``fadd`` (a numba ``@intrinsic``):
  blocks of one launch run on several engine threads at once, so
  :attr:`CompiledKernel.needs_serial` is always False.
* ``error_model="numpy"``: a division by zero gives inf/nan/0 as on a GPU instead of
  raising inside the engine thread.
* Buffer elements are indexed with ``np.uint64`` indices: with a signed index numba emits
  Python's negative-index wraparound, which stops LLVM vectorising and made a bounds-free
  saxpy ~4x slower; here a negative index is a bounds miss (checked) or undefined
  (``boundscheck=False``, the caller's choice of an unsafe kernel).
* Cost (16 Mi float32 saxpy, 2-core machine): ``boundscheck=False`` runs as fast as a
  plain numba loop (~6.5 vs 7 ms); with checks ~18 ms, because a check that can stop the
  thread is an early exit that LLVM will not vectorise. So an access whose every index is
  affine in a thread index within a phase (``global_id(d)``/``local_id(d)`` plus/minus int
  constants or never-assigned int scalar parameters, directly or through a local assigned
  once) has its index range over the block checked once before the thread loop: in range,
  the block runs the phase's ``_phf`` variant without those checks; otherwise the checked
  ``_ph`` loop, which faults exactly as before. Checked saxpy: ~6.6-7 ms instead of ~18.
* ``shared_array``: allocated (zeroed) once per block at block level, passed to the
  phases. Bounds misses on it report the local's name as ``param``.
* Per-thread arrays for locals live across phases are float64 unless every value ever
  assigned to the local is an integer/bool (then int64): a conservative static guess,
  since the phase functions are typed by numba only after the arrays are declared.
* Loops with an ``else`` clause are rejected (the contract does not list them).

The abort word
--------------
``abort`` is an int64 array of one element, written by other threads:

* ``0`` -- run;
* :data:`ABORT_PREEMPT` (1) -- stop at the next block boundary: the running block finishes
  and :meth:`CompiledKernel.run` returns the first block not run, so the launch can resume;
* any other nonzero value (:data:`ABORT_WATCHDOG` = 2, :data:`ABORT_KILL` = 3) -- stop as
  soon as possible, also inside a running block's loops. Stopped between blocks, ``run``
  returns the resume block like a preemption; stopped inside a block (not resumable), it
  raises :class:`KernelFault` with kind ``"watchdog"`` (value 2) or ``"abort"``.

The persistent cache
--------------------
:class:`KernelCache` keys entries on sha256 of the canonical JSON of every compatibility
input (kernel source/params/shared_mem, argument types, options, :func:`compat_key`, and
the sha256 of the generated source, so a change in the lowering can never reuse stale
machine code). Each entry is ``root/<key[:2]>/<key>/`` with the generated module, a
``manifest.json`` and numba's own ``__pycache__``. Entries are built in a temporary
directory and renamed into place under an exclusive ``flock`` on ``root/<key>.lock``, so
two processes never corrupt an entry and never both compile it; a corrupt entry (manifest
unreadable, checksum mismatch, a cache file numba cannot load) is deleted and rebuilt.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import fcntl
import hashlib
import importlib.util
import json
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

import llvmlite
import llvmlite.binding as llvm_binding
import numba
import numpy as np
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from firmware import matrix
from kmod_emul import uapi

#: The firmware's JIT compatibility boundary. Bump it whenever anything the generated code
#: depends on outside itself changes meaning (the intrinsics below, the ``_grid`` calling
#: convention, the fault-array layout): every cached entry then misses.
FIRMWARE_JIT_ABI = 2
DEFAULT_ISA = "aemu-isa 1.0"
DEFAULT_STEPPING = "A1"

ABORT_PREEMPT = 1
ABORT_WATCHDOG = 2
ABORT_KILL = 3

#: fault[0] values written by generated code.
FAULT_BOUNDS = 1
FAULT_ABORT = 2

#: The language's element types and aliases are the launch ABI's (the shared uAPI header).
DTYPE_NAMES: frozenset[str] = frozenset(uapi.DTYPES)
DTYPE_ALIASES: dict[str, str] = uapi.DTYPE_ALIASES

_ID_BUILTINS = {"global_id": "_gid", "local_id": "_l", "group_id": "_g",
                "local_size": "_ls", "num_groups": "_ng"}
_MATH_BUILTINS = {"sqrt": "math.sqrt", "exp": "math.exp", "log": "math.log",
                  "sin": "math.sin", "cos": "math.cos", "tanh": "math.tanh",
                  "floor": "math.floor"}
_PLAIN_BUILTINS = {"abs", "min", "max", "float", "int"}
BUILTINS: frozenset[str] = frozenset(set(_ID_BUILTINS) | set(_MATH_BUILTINS) | _PLAIN_BUILTINS
                                     | {"barrier", "shared_array", "atomic_add", "mma"})
#: Block-collective built-ins: every thread of a block issues them together, so they
#: follow the barrier rule and are phase boundaries in the lowering.
_COLLECTIVES = frozenset({"barrier", "mma"})
#: mma(c, a, b, row, col, k0, tm, tn, tk, beta): the matrix unit (firmware/matrix.py).
_MMA_NARGS = 10
_AUG_SYMBOL: dict[type, str] = {
    ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//",
    ast.Mod: "%", ast.Pow: "**", ast.BitAnd: "&", ast.BitOr: "|", ast.BitXor: "^",
    ast.LShift: "<<", ast.RShift: ">>"}
_MAX_NDIM = 8


# --------------------------------------------------------------------------- public types


class KernelFault(Exception):
    """A launch stopped by the kernel itself (``kind="bounds"``: ``param`` is the buffer's
    name -- or a ``shared_array`` local's -- and ``index`` the flat element index) or by
    the abort word inside a block (``"watchdog"`` / ``"abort"``). ``block`` is the block
    that was running: blocks before it completed."""

    def __init__(self, kind: str, param: str | None = None, index: int | None = None,
                 message: str = "", block: int | None = None) -> None:
        self.kind = kind
        self.param = param
        self.index = index
        self.block = block
        self.message = message or (f"{kind} fault" + (f" on {param}[{index}]"
                                                      if param is not None else ""))
        super().__init__(self.message)


class KernelCompileError(ValueError):
    """The IR failed re-validation, or numba could not compile the lowered kernel."""


@dataclass(frozen=True)
class Options:
    """Code-generation options; each is part of the cache key (numba's own cache index
    does not key on them)."""

    boundscheck: bool = True
    fastmath: bool = False


def compat_key(options: Options = Options(), isa: str = DEFAULT_ISA,
               stepping: str = DEFAULT_STEPPING) -> dict[str, Any]:
    """Every input outside the kernel that decides whether cached machine code may be
    reused: interpreter, compiler and framework versions, the firmware's JIT ABI, the
    target ISA and stepping, the host CPU (numba compiles for the host; an override via
    ``NUMBA_CPU_NAME`` counts) and the code-generation options."""
    cpu = numba.config.CPU_NAME or llvm_binding.get_host_cpu_name()
    features = numba.config.CPU_FEATURES
    if features is None:
        features = llvm_binding.get_host_cpu_features().flatten()
    return {
        "python": platform.python_version(),
        "python_impl": platform.python_implementation(),
        "numba": numba.__version__,
        "llvmlite": llvmlite.__version__,
        "numpy": np.__version__,
        "firmware_jit_abi": FIRMWARE_JIT_ABI,
        "isa": isa,
        "stepping": stepping,
        "cpu": cpu,
        "cpu_features": features,
        "options": asdict(options),
    }


# --------------------------------------------------------------------------- intrinsics
# Imported by the generated modules: their meaning is covered by FIRMWARE_JIT_ABI.


@intrinsic
def _rt_abort_word(typingctx: Any, ary: Any) -> Any:
    """``abort[0]`` as an atomic (monotonic) load, so that LLVM never hoists it out of a
    loop: the watchdog writes it from another thread."""
    if not (isinstance(ary, types.Array) and ary.ndim == 1 and ary.dtype == types.int64):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        aryty = signature.args[0]
        arr = context.make_array(aryty)(context, builder, args[0])
        zero = context.get_constant(types.intp, 0)
        ptr = cgutils.get_item_pointer(context, builder, aryty, arr, [zero], wraparound=False)
        return builder.load_atomic(ptr, "monotonic", 8)

    return types.int64(ary), codegen


@intrinsic
def _rt_atomic_add(typingctx: Any, ary: Any, idx: Any, val: Any) -> Any:
    """``ary[idx] += val`` as one LLVM ``atomicrmw`` (``add`` for integers, ``fadd`` for
    floats; x86 lowers a float one to a compare-exchange loop). ``idx`` is a tuple with
    one integer per dimension, already bounds-checked by the generated code."""
    if not (isinstance(ary, types.Array) and isinstance(idx, types.BaseTuple)
            and len(idx) == ary.ndim and all(isinstance(t, types.Integer) for t in idx)
            and isinstance(ary.dtype, (types.Integer, types.Float))
            and isinstance(val, (types.Number, types.Boolean))):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        aryty, idxty, valty = signature.args
        arr = context.make_array(aryty)(context, builder, args[0])
        raw = cgutils.unpack_tuple(builder, args[1], len(idxty))
        indices = [context.cast(builder, v, t, types.intp) for v, t in zip(raw, idxty)]
        ptr = cgutils.get_item_pointer(context, builder, aryty, arr, indices,
                                       wraparound=False)
        value = context.cast(builder, args[2], valty, aryty.dtype)
        op = "fadd" if isinstance(aryty.dtype, types.Float) else "add"
        builder.atomic_rmw(op, ptr, value, "seq_cst")
        return context.get_dummy_value()

    return types.none(ary, idx, val), codegen


# --------------------------------------------------------------------------- arg types


@dataclass(frozen=True)
class ArgType:
    """One parsed ``arg_types`` entry."""

    dtype: str
    ndim: int  # 0 for a scalar

    @staticmethod
    def parse(text: str) -> "ArgType":
        if not isinstance(text, str):
            raise KernelCompileError(f"argument type {text!r} is not a string")
        name, ndim = text, 0
        if text.endswith("d]") and "[" in text:
            name, _, rest = text.partition("[")
            try:
                ndim = int(rest[:-2])
            except ValueError:
                raise KernelCompileError(f"bad argument type {text!r}") from None
            if not 1 <= ndim <= _MAX_NDIM:
                raise KernelCompileError(f"bad buffer rank in argument type {text!r}")
        name = DTYPE_ALIASES.get(name, name)
        if name not in DTYPE_NAMES:
            raise KernelCompileError(f"unknown dtype in argument type {text!r}")
        return ArgType(name, ndim)

    def numba_type(self) -> Any:
        scalar = types.boolean if self.dtype == "bool" else getattr(types, self.dtype)
        return types.Array(scalar, self.ndim, "C") if self.ndim else scalar

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
_BAD_OPS = (ast.MatMult, ast.Is, ast.IsNot, ast.In, ast.NotIn)


def _reject(node: ast.AST, reason: str) -> KernelCompileError:
    return KernelCompileError(f"line {getattr(node, 'lineno', '?')}: {reason}")


@dataclass
class _Kernel:
    """The validated kernel and what the lowering needs to know about its names."""

    fn: ast.FunctionDef
    params: list[str]
    arg_types: list[ArgType]
    buffers: dict[str, int]  # buffer param -> position
    scalars: set[str]
    locals: set[str]
    shared: dict[str, tuple[tuple[int, ...], str]] = field(default_factory=dict)
    tainted: set[str] = field(default_factory=set)  # locals that may differ between threads


def _const_int(node: ast.AST) -> int | None:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    return None


def _contains(node: ast.AST | list[ast.stmt], pred: Any) -> bool:
    nodes = node if isinstance(node, list) else [node]
    return any(pred(n) for top in nodes for n in ast.walk(top))


def _is_collective(n: ast.AST) -> bool:
    """A call of barrier() or mma(): the barrier rule applies to both."""
    return (isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
            and n.func.id in _COLLECTIVES)


def _is_mma(s: ast.stmt) -> bool:
    return (isinstance(s, ast.Expr) and isinstance(s.value, ast.Call)
            and isinstance(s.value.func, ast.Name) and s.value.func.id == "mma")


def validate(ir: dict[str, Any], arg_types: tuple[str, ...]) -> _Kernel:
    """Re-validate the IR's source against docs/kernels.md's whitelist (defence in depth:
    the firmware never trusts the runtime) and check it against the launch's types.
    Raises :class:`KernelCompileError` (a ValueError) naming the line and the reason."""
    source = ir.get("source")
    if not isinstance(source, str):
        raise KernelCompileError("kernel IR has no source")
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        raise KernelCompileError(f"kernel source does not parse: {exc}") from None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.FunctionDef):
        raise KernelCompileError("kernel source must be exactly one function definition")
    fn = tree.body[0]
    if fn.decorator_list or fn.returns is not None:
        raise _reject(fn, "decorators and return annotations are not allowed")
    a = fn.args
    if a.posonlyargs or a.kwonlyargs or a.vararg or a.kwarg or a.defaults or a.kw_defaults:
        raise _reject(fn, "only plain positional parameters are allowed")
    params = [arg.arg for arg in a.args]
    ir_params = ir.get("params")
    if not isinstance(ir_params, list) or [p.get("name") for p in ir_params] != params:
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
    k = _Kernel(fn, params, parsed, buffers, scalars, bound - set(params))

    body = fn.body
    if (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)):
        fn.body = body = body[1:] or [ast.Pass()]

    callees = {id(n.func) for n in ast.walk(fn) if isinstance(n, ast.Call)}
    for n in ast.walk(fn):  # constructs the language does not have, first
        for bad, what in _REJECT_REASONS.items():
            if isinstance(n, bad):
                raise _reject(n, f"{what} not allowed in a kernel")
    for n in ast.walk(fn):
        if isinstance(n, ast.Name) and (n.id in BUILTINS or n.id == "range") \
                and isinstance(n.ctx, ast.Load) and id(n) not in callees:
            raise _reject(n, f"built-in {n.id!r} may only be called")
        if isinstance(n, ast.FunctionDef) and n is not fn:
            raise _reject(n, "nested functions are not allowed in a kernel")
        if not isinstance(n, _ALLOWED_NODES) or isinstance(n, _BAD_OPS):
            raise _reject(n, f"{type(n).__name__} is not allowed in a kernel")
        if isinstance(n, ast.Name):
            if n.id.startswith("__"):
                raise _reject(n, f"dunder name {n.id!r}")
            if n.id in BUILTINS or n.id == "range":
                if isinstance(n.ctx, ast.Store) or n.id in params:
                    raise _reject(n, f"built-in {n.id!r} cannot be rebound")
            elif n.id not in params and n.id not in k.locals:
                raise _reject(n, f"free name {n.id!r} is not a parameter, local or built-in")
        elif isinstance(n, ast.arg) and n.arg.startswith("__"):
            raise _reject(n, f"dunder name {n.arg!r}")
        elif isinstance(n, (ast.For, ast.While)) and n.orelse:
            raise _reject(n, "loop `else` clauses are not supported")
        elif isinstance(n, ast.For):
            it = n.iter
            if not (isinstance(n.target, ast.Name) and isinstance(it, ast.Call)
                    and isinstance(it.func, ast.Name) and it.func.id == "range"
                    and 1 <= len(it.args) <= 3 and not it.keywords):
                raise _reject(n, "only `for name in range(...)` loops are allowed")
        elif isinstance(n, ast.Return) and n.value is not None:
            raise _reject(n, "kernels return nothing")
        elif isinstance(n, ast.Attribute):
            if n.attr not in ("shape", "size") or not (
                    isinstance(n.value, ast.Name) and n.value.id in buffers):
                raise _reject(n, f"attribute .{n.attr} is not allowed (only .shape/.size "
                                 "of a buffer parameter)")
        elif isinstance(n, ast.Constant):
            if isinstance(n.value, (str, bytes)) and not _is_dtype_const(n, fn):
                raise _reject(n, "string constants are only allowed as dtype names")
            if not isinstance(n.value, (bool, int, float, str)):
                raise _reject(n, f"constant {n.value!r} is not allowed")
        elif isinstance(n, ast.Call):
            _check_call(n, k)
        elif isinstance(n, ast.Subscript):
            _check_subscript(n, k)
        elif isinstance(n, ast.Expr):
            if not (isinstance(n.value, ast.Call) and isinstance(n.value.func, ast.Name)
                    and n.value.func.id in ("barrier", "atomic_add", "mma")):
                raise _reject(n, "only barrier(), atomic_add() and mma() may be used as "
                                 "statements")
        elif isinstance(n, ast.Assign):
            if isinstance(n.value, ast.Call) and isinstance(n.value.func, ast.Name) \
                    and n.value.func.id == "shared_array":
                _check_shared(n, k)
            for t in n.targets:
                elts = t.elts if isinstance(t, ast.Tuple) else [t]
                for e in elts:
                    if not isinstance(e, (ast.Name, ast.Subscript)):
                        raise _reject(n, "assignment targets are names or buf[index]")
                    if isinstance(e, ast.Name) and e.id in params:
                        raise _reject(n, f"parameter {e.id!r} cannot be assigned")
                    if isinstance(t, ast.Tuple) and isinstance(e, ast.Subscript):
                        raise _reject(n, "tuple assignment only to names")
        elif isinstance(n, ast.AugAssign):
            if isinstance(n.target, ast.Name) and n.target.id in params:
                raise _reject(n, f"parameter {n.target.id!r} cannot be assigned")
    for name in k.shared:
        stores = [n for n in ast.walk(fn) if isinstance(n, ast.Name) and n.id == name
                  and isinstance(n.ctx, ast.Store)]
        if len(stores) != 1:
            raise KernelCompileError(f"shared array {name!r} is assigned more than once")
    for name in k.locals:
        if name in k.shared:
            continue
        for n in ast.walk(fn):
            if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name) \
                    and n.value.id == name:
                raise _reject(n, f"{name!r} is not a buffer and cannot be indexed")
    k.tainted = _tainted(fn, k)
    _check_barriers(fn.body, k, uniform=set(), loop_depth_structural=False)
    return k


def _is_dtype_const(node: ast.Constant, fn: ast.FunctionDef) -> bool:
    for n in ast.walk(fn):
        if (isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                and n.func.id == "shared_array" and len(n.args) == 2 and n.args[1] is node):
            return True
    return False


def _check_call(n: ast.Call, k: _Kernel) -> None:
    if not isinstance(n.func, ast.Name):
        raise _reject(n, "only built-in functions may be called")
    name = n.func.id
    if n.keywords:
        raise _reject(n, "keyword arguments are not allowed")
    if name == "range":
        return  # position checked with the For
    if name not in BUILTINS:
        raise _reject(n, f"call of {name!r}: not a built-in")
    nargs = len(n.args)
    if name in _ID_BUILTINS:
        d = _const_int(n.args[0]) if nargs == 1 else None
        if d is None or not 0 <= d <= 2:
            raise _reject(n, f"{name}() takes one constant dimension 0..2")
    elif name == "barrier":
        if nargs:
            raise _reject(n, "barrier() takes no arguments")
    elif name == "atomic_add":
        if nargs != 3 or not (isinstance(n.args[0], ast.Name)
                              and (n.args[0].id in k.buffers or n.args[0].id in k.shared)):
            raise _reject(n, "atomic_add(buf, index, value) needs a buffer")
        t = _buffer_dtype(k, n.args[0].id)
        if t == "bool":
            raise _reject(n, "atomic_add on a bool buffer")
    elif name == "mma":
        _check_mma(n, k)
    elif name == "shared_array":
        pass  # checked with its Assign; a shared_array elsewhere fails _check_shared
    elif name in ("min", "max"):
        if nargs < 2:
            raise _reject(n, f"{name}() needs at least two arguments")
    elif nargs != 1:
        raise _reject(n, f"{name}() takes one argument")


def _check_mma(n: ast.Call, k: _Kernel) -> None:
    """mma's operands: three 2-D buffer parameters of one float dtype (the matrix unit's
    types); the other arguments are evaluated with thread 0's values (the front end
    rejects any that may differ between threads)."""
    if len(n.args) != _MMA_NARGS:
        raise _reject(n, f"mma() takes {_MMA_NARGS} arguments")
    names = [a.id if isinstance(a, ast.Name) and a.id in k.buffers else None
             for a in n.args[:3]]
    if None in names:
        raise _reject(n, "the first three arguments of mma must be buffer parameters")
    dtypes = {_buffer_dtype(k, m) for m in names if m}
    if any(_buffer_ndim(k, m) != 2 for m in names if m):
        raise _reject(n, "mma operands must be 2-D buffers")
    if len(dtypes) != 1 or not dtypes <= {"float32", "float64"}:
        raise _reject(n, "mma operands must all be float32 or all float64, not "
                         f"{', '.join(sorted(dtypes))}")


def _buffer_dtype(k: _Kernel, name: str) -> str:
    if name in k.buffers:
        return k.arg_types[k.buffers[name]].dtype
    return k.shared[name][1]


def _buffer_ndim(k: _Kernel, name: str) -> int:
    if name in k.buffers:
        return k.arg_types[k.buffers[name]].ndim
    return len(k.shared[name][0])


def _check_subscript(n: ast.Subscript, k: _Kernel) -> None:
    v = n.value
    if isinstance(v, ast.Attribute):  # buf.shape[k]
        if v.attr != "shape" or _const_int(n.slice) is None:
            raise _reject(n, "only buf.shape[constant] may be indexed")
        if not 0 <= _const_int(n.slice) < _buffer_ndim(k, v.value.id):  # type: ignore
            raise _reject(n, "shape index out of range")
        return
    if not (isinstance(v, ast.Name) and (v.id in k.buffers or v.id in k.shared)):
        if isinstance(v, ast.Name) and v.id in k.locals and v.id not in k.shared:
            raise _reject(n, f"{v.id!r} is not a buffer and cannot be indexed")
        raise _reject(n, "only buffers may be indexed")
    idx = n.slice.elts if isinstance(n.slice, ast.Tuple) else [n.slice]
    if len(idx) != _buffer_ndim(k, v.id):
        raise _reject(n, f"{v.id!r} has {_buffer_ndim(k, v.id)} dimensions, "
                         f"indexed with {len(idx)}")


def _check_shared(n: ast.Assign, k: _Kernel) -> None:
    call = n.value
    assert isinstance(call, ast.Call)
    if len(n.targets) != 1 or not isinstance(n.targets[0], ast.Name) or len(call.args) != 2:
        raise _reject(n, "shared_array(shape, dtype) must be assigned to one name")
    shape_node, dtype_node = call.args
    dims = shape_node.elts if isinstance(shape_node, ast.Tuple) else [shape_node]
    shape = tuple(_const_int(d) for d in dims)
    if not shape or len(shape) > _MAX_NDIM or any(s is None or s < 1 for s in shape):
        raise _reject(n, "shared_array shape must be positive integer constants")
    if not (isinstance(dtype_node, ast.Constant) and isinstance(dtype_node.value, str)):
        raise _reject(n, "shared_array dtype must be a dtype name")
    dtype = DTYPE_ALIASES.get(dtype_node.value, dtype_node.value)
    if dtype not in DTYPE_NAMES:
        raise _reject(n, f"unknown dtype {dtype_node.value!r}")
    k.shared[n.targets[0].id] = (shape, dtype)  # type: ignore[assignment]


def _uniform_expr(node: ast.AST, k: _Kernel, uniform: set[str]) -> bool:
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


def _tainted(fn: ast.FunctionDef, k: _Kernel) -> set[str]:
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


def _structural(stmt: ast.stmt, in_structural_loop: bool) -> bool:
    """Whether a statement must stay at block level: it holds a barrier, or it is (or
    holds) a break/continue of a block-level loop."""
    if isinstance(stmt, ast.Expr) and _is_collective(stmt.value):
        return True
    if _contains(stmt, _is_collective):
        return True
    return in_structural_loop and _binds_outer_loop(stmt)


def _check_barriers(stmts: list[ast.stmt], k: _Kernel, uniform: set[str],
                    loop_depth_structural: bool) -> None:
    for s in stmts:
        if not _structural(s, loop_depth_structural):
            continue
        if isinstance(s, ast.Expr) or isinstance(s, (ast.Break, ast.Continue)):
            continue
        if isinstance(s, ast.If):
            if not _uniform_expr(s.test, k, uniform):
                raise _reject(s, "barrier() (or a break of a loop with a barrier) under a "
                                 "condition that differs between threads")
            _check_barriers(s.body, k, uniform, loop_depth_structural)
            _check_barriers(s.orelse, k, uniform, loop_depth_structural)
        elif isinstance(s, ast.For):
            if not _uniform_expr(s.iter, k, uniform):
                raise _reject(s, "barrier() in a loop whose range differs between threads")
            var = s.target.id  # type: ignore[attr-defined]
            for n in ast.walk(s):
                if isinstance(n, ast.Name) and n.id == var and isinstance(n.ctx, ast.Store) \
                        and n is not s.target:
                    raise _reject(n, f"uniform loop variable {var!r} is assigned in its loop")
            _check_barriers(s.body, k, uniform | {var}, True)
        elif isinstance(s, ast.While):
            if not _uniform_expr(s.test, k, uniform):
                raise _reject(s, "barrier() in a loop whose condition differs between threads")
            _check_barriers(s.body, k, uniform, True)
        else:
            raise _reject(s, "barrier() may only be a statement")


# --------------------------------------------------------------------------- lowering


def _u(name: str) -> str:
    return "u_" + name


class _Rewrite(ast.NodeTransformer):
    """Expression rewriting: user names get a ``u_`` prefix (so they never collide with
    the generated code's names or modules) and built-ins become loop variables or ``math``
    calls. Buffer loads are indexed with ``np.uint64`` (numba then emits no negative-index
    wraparound, which would block vectorisation; a negative index is a bounds miss here
    anyway). With bounds checks, a load that is always evaluated is *hoisted*: its index
    goes to a temporary, checked before the statement (a miss stops the thread at once);
    a load under short-circuit evaluation (``and``/``or``, a conditional expression, the
    tail of a chained comparison) must not be hoisted, and calls a helper that records the
    miss and yields zero, the statement then checking ``fault[0]``."""

    def __init__(self, low: "_Lowering") -> None:
        self.low = low
        self.k = low.k
        self.checked = low.checked
        self.pre: list[str] | None = None  # hoisted lines, when hoisting
        self.ind = ""
        self.cond = 0
        self.cond_loads = False
        self.block_level = False

    def visit_Name(self, n: ast.Name) -> ast.AST:
        if (self.block_level and n.id in self.k.locals and n.id not in self.k.shared
                and n.id not in self.low.uniform_vars):
            self.low.block_locals.add(n.id)
            return ast.parse(f"_pt_{n.id}[0]", mode="eval").body
        return ast.copy_location(ast.Name(_u(n.id), n.ctx), n)

    def visit_Call(self, n: ast.Call) -> ast.AST:
        name = n.func.id  # type: ignore[attr-defined]
        if name in _ID_BUILTINS:
            return ast.Name(f"{_ID_BUILTINS[name]}{_const_int(n.args[0])}", ast.Load())
        args = [self.visit(a) for a in n.args]
        if name in _MATH_BUILTINS:
            return ast.Call(ast.parse(_MATH_BUILTINS[name], mode="eval").body, args, [])
        return ast.Call(ast.Name(name, ast.Load()), args, [])

    def _conditional(self, nodes: list[ast.AST]) -> list[ast.AST]:
        self.cond += 1
        try:
            return [self.visit(x) for x in nodes]
        finally:
            self.cond -= 1

    def visit_BoolOp(self, n: ast.BoolOp) -> ast.AST:
        return ast.BoolOp(n.op, [self.visit(n.values[0])] + self._conditional(n.values[1:]))

    def visit_IfExp(self, n: ast.IfExp) -> ast.AST:
        body, orelse = self._conditional([n.body, n.orelse])
        return ast.IfExp(self.visit(n.test), body, orelse)

    def visit_Compare(self, n: ast.Compare) -> ast.AST:
        left = self.visit(n.left)
        first = self.visit(n.comparators[0])
        return ast.Compare(left, n.ops, [first] + self._conditional(n.comparators[1:]))

    def visit_Attribute(self, n: ast.Attribute) -> ast.AST:
        return ast.Attribute(self.visit(n.value), n.attr, ast.Load())

    def visit_Subscript(self, n: ast.Subscript) -> ast.AST:
        if isinstance(n.value, ast.Attribute):  # buf.shape[k]
            return ast.Subscript(self.visit(n.value), n.slice, ast.Load())
        name = n.value.id  # type: ignore[attr-defined]
        idx = [self.visit(i) for i in _indices(n)]
        if self.checked and self.low.fast and getattr(n, "_aff", False):
            return _subscript(name, idx, n.ctx)  # range checked once for the block
        if self.checked and (self.cond or self.pre is None):
            self.cond_loads = True
            return ast.Call(ast.Name(f"_ld_{name}", ast.Load()),
                            [ast.Name(_u(name), ast.Load()), *idx,
                             ast.Name("fault", ast.Load())], [])
        if self.checked:
            assert self.pre is not None
            idx = [ast.Name(v, ast.Load()) for v in self.low.hoist_index(
                name, [ast.unparse(i) for i in idx], self.pre, self.ind)]
        return _subscript(name, idx, n.ctx)


def _indices(n: ast.Subscript) -> list[ast.expr]:
    return list(n.slice.elts) if isinstance(n.slice, ast.Tuple) else [n.slice]


def _subscript(name: str, idx: list[ast.expr], ctx: ast.expr_context) -> ast.Subscript:
    """``u_name[np.uint64(i), ...]``."""
    cast = [ast.Call(ast.parse("np.uint64", mode="eval").body, [i], []) for i in idx]
    sl = ast.Tuple(cast, ast.Load()) if len(cast) > 1 else cast[0]
    return ast.Subscript(ast.Name(_u(name), ast.Load()), sl, ctx)


def _names(stmts: list[ast.stmt]) -> set[str]:
    return {n.id for s in stmts for n in ast.walk(s) if isinstance(n, ast.Name)}


def _assigned(stmts: list[ast.stmt]) -> set[str]:
    return {n.id for s in stmts for n in ast.walk(s)
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}


class _Lowering:
    """Generates the module text for one validated kernel."""

    def __init__(self, k: _Kernel, options: Options) -> None:
        self.per_thread_order: list[str] = []
        self.k = k
        self.opt = options
        self.checked = options.boundscheck
        self.tmp = 0
        self.phases: list[tuple[list[ast.stmt], bool]] = []  # (stmts, inside a block loop)
        self.uniform_vars: list[str] = []
        self.block_locals: set[str] = set()  # locals read by block-level code (as thread 0's)
        self.returns = _contains(k.fn.body, lambda n: isinstance(n, ast.Return))
        self.fast = False  # generating a phase's block-range-checked variant
        self.fast_phases: set[int] = set()
        self.def_guards: dict[str, list[str]] = {}
        self.stores: dict[str, int] = {}
        for n in ast.walk(k.fn):
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                self.stores[n.id] = self.stores.get(n.id, 0) + 1

    # -- helpers --------------------------------------------------------------------------
    def fresh(self, prefix: str) -> str:
        self.tmp += 1
        return f"_{prefix}{self.tmp}"

    def expr(self, node: ast.AST) -> str:
        """A block-level (uniform) expression: no loads to check; a local is read as thread
        0's value from its per-thread array (see _uniform_expr)."""
        rw = _Rewrite(self)
        rw.block_level = True
        return ast.unparse(rw.visit(copy.deepcopy(node)))

    def hexpr(self, node: ast.AST, ind: str, out: list[str]) -> tuple[str, bool]:
        """A thread-level expression: hoisted checks go to ``out``; returns the text and
        whether it loads under short-circuit evaluation (then ``fault`` needs a check)."""
        rw = _Rewrite(self)
        rw.pre, rw.ind = out, ind
        text = ast.unparse(rw.visit(copy.deepcopy(node)))
        return text, rw.cond_loads

    def pos_of(self, name: str) -> int:
        if name in self.k.buffers:
            return self.k.buffers[name]
        return len(self.k.params) + list(self.k.shared).index(name)

    # -- phase functions: thread-level code ------------------------------------------------
    def hoist_index(self, name: str, idx: list[str], out: list[str], ind: str) -> list[str]:
        """Evaluate an access's indices into temporaries and check them (unsigned compare:
        a negative index is a miss too); a miss records the fault and stops the thread."""
        u = _u(name)
        ivars = []
        for i in idx:
            v = self.fresh("k")
            out.append(f"{ind}{v} = {i}")
            ivars.append(v)
        conds = " or ".join(f"np.uint64({v}) >= np.uint64({u}.shape[{d}])"
                            for d, v in enumerate(ivars))
        flat = ivars[0]
        for d, v in enumerate(ivars[1:], 1):
            flat = f"({flat}) * {u}.shape[{d}] + {v}"
        out += [f"{ind}if {conds}:", f"{ind}    _miss(fault, {self.pos_of(name)}, {flat})",
                f"{ind}    return 1"]
        return ivars

    def fault_check(self, ind: str) -> list[str]:
        return [f"{ind}if fault[0] != 0:", f"{ind}    return 1"]

    def abort_check(self, ind: str, ret: str) -> list[str]:
        return [f"{ind}if _rt_abort_word(abort) > {ABORT_PREEMPT}:",
                f"{ind}    fault[0] = {FAULT_ABORT}", f"{ind}    return {ret}"]

    def access(self, name: str, idx_nodes: list[ast.expr], ind: str,
               out: list[str], node: ast.AST | None = None) -> tuple[list[str], bool]:
        """The index texts of a store/atomic target (checked when bounds-checking,
        unless ``node`` is an access whose range the block checked already)."""
        texts, loads = [], False
        for i in idx_nodes:
            t, c = self.hexpr(i, ind, out)
            texts.append(t)
            loads = loads or c
        if not self.checked:
            return texts, loads
        if self.fast and getattr(node, "_aff", False):
            if loads:
                out += self.fault_check(ind)
            return texts, False
        if loads:
            out += self.fault_check(ind)
            loads = False
        return self.hoist_index(name, texts, out, ind), loads

    def target(self, t: ast.expr, ind: str, out: list[str]) -> str:
        if isinstance(t, ast.Subscript):
            name = t.value.id  # type: ignore[attr-defined]
            idx, _ = self.access(name, _indices(t), ind, out, t)
            return ast.unparse(_subscript(name, [ast.parse(i, mode="eval").body for i in idx],
                                          ast.Store()))
        return ast.unparse(_Rewrite(self).visit(copy.deepcopy(t)))

    def stmt(self, s: ast.stmt, ind: str, writeback: list[str]) -> list[str]:
        out: list[str] = []
        if isinstance(s, ast.Assign):
            value, loads = self.hexpr(s.value, ind, out)
            if loads:
                out += self.fault_check(ind)
            if len(s.targets) == 1:
                tgt = self.target(s.targets[0], ind, out)
                return out + [f"{ind}{tgt} = {value}"]
            v = self.fresh("v")
            out.append(f"{ind}{v} = {value}")
            for t in s.targets:
                tgt = self.target(t, ind, out)
                out.append(f"{ind}{tgt} = {v}")
            return out
        if isinstance(s, ast.AugAssign):
            op = _AUG_SYMBOL[type(s.op)]
            value, loads = self.hexpr(s.value, ind, out)
            if loads:
                out += self.fault_check(ind)
            tgt = self.target(s.target, ind, out)
            return out + [f"{ind}{tgt} {op}= {value}"]
        if _is_mma(s):  # its own phase, run by thread 0 (see collective())
            return self.mma(s.value, ind)  # type: ignore[arg-type]
        if isinstance(s, ast.Expr):  # atomic_add (barrier() is structural)
            call = s.value
            assert isinstance(call, ast.Call) and call.func.id == "atomic_add"  # type: ignore
            name = call.args[0].id  # type: ignore[attr-defined]
            idx_node = call.args[1]
            idx = list(idx_node.elts) if isinstance(idx_node, ast.Tuple) else [idx_node]
            if len(idx) != _buffer_ndim(self.k, name):
                raise _reject(s, f"atomic_add index of {name!r} needs "
                                 f"{_buffer_ndim(self.k, name)} components")
            value, loads = self.hexpr(call.args[2], ind, out)
            if loads:
                out += self.fault_check(ind)
            ivars, _ = self.access(name, idx, ind, out, call)
            v = self.fresh("v")
            out.append(f"{ind}{v} = {value}")
            out.append(f"{ind}_rt_atomic_add({_u(name)}, ({', '.join(ivars)},), {v})")
            return out
        if isinstance(s, ast.If):
            test, loads = self.hexpr(s.test, ind, out)
            if loads:
                c = self.fresh("c")
                out += [f"{ind}{c} = {test}"] + self.fault_check(ind)
                test = c
            out.append(f"{ind}if {test}:")
            out += self.block(s.body, ind + "    ", writeback)
            if s.orelse:
                out.append(f"{ind}else:")
                out += self.block(s.orelse, ind + "    ", writeback)
            return out
        if isinstance(s, ast.For):
            names = []
            any_loads = False
            for a in s.iter.args:  # type: ignore[attr-defined]
                text, loads = self.hexpr(a, ind, out)
                any_loads = any_loads or loads
                r = self.fresh("r")
                out.append(f"{ind}{r} = {text}")
                names.append(r)
            if any_loads:
                out += self.fault_check(ind)
            out.append(f"{ind}for {_u(s.target.id)} in range({', '.join(names)}):")  # type: ignore
            out += self.abort_check(ind + "    ", "1")
            return out + self.block(s.body, ind + "    ", writeback)
        if isinstance(s, ast.While):
            inner = ind + "    "
            out = [f"{ind}while True:"] + self.abort_check(inner, "1")
            test, loads = self.hexpr(s.test, inner, out)
            if loads:
                out += self.fault_check(inner)
            out += [f"{inner}if not ({test}):", f"{inner}    break"]
            return out + self.block(s.body, inner, writeback)
        if isinstance(s, ast.Return):
            out = [f"{ind}_done[_t] = 1"] if self.returns else []
            return out + [f"{ind}{w}" for w in writeback] + [f"{ind}return 0"]
        if isinstance(s, (ast.Break, ast.Continue, ast.Pass)):
            return [f"{ind}{type(s).__name__.lower()}"]
        raise _reject(s, f"{type(s).__name__} cannot be lowered")

    def mma(self, call: ast.Call, ind: str) -> list[str]:
        """The matrix unit's call: operands, then the seven scalar arguments evaluated
        (with thread 0's locals), then the BLAS entry point for the dtype."""
        out: list[str] = []
        names = [a.id for a in call.args[:3]]  # type: ignore[attr-defined]
        values = []
        for a in call.args[3:]:
            text, loads = self.hexpr(a, ind, out)
            if loads:
                out += self.fault_check(ind)
            values.append(text)
        slot = matrix.SLOT[_buffer_dtype(self.k, names[0])]
        args = ([_u(n) for n in names] + values
                + [f"_blas[{slot}]", "abort", "fault"] + [str(self.pos_of(n)) for n in names])
        return out + [f"{ind}if _mma({', '.join(args)}) != 0:", f"{ind}    return 1"]

    def block(self, stmts: list[ast.stmt], ind: str, writeback: list[str]) -> list[str]:
        out: list[str] = []
        for s in stmts:
            out += self.stmt(s, ind, writeback)
        return out or [f"{ind}pass"]

    # -- block-level structure ---------------------------------------------------------------
    def is_shared_decl(self, s: ast.stmt) -> bool:
        return (isinstance(s, ast.Assign) and isinstance(s.value, ast.Call)
                and isinstance(s.value.func, ast.Name) and s.value.func.id == "shared_array")

    def structure(self, stmts: list[ast.stmt], ind: str, in_loop: bool) -> list[str]:
        """Block-level code: thread loops over phases, with block-level (uniform) control
        flow around the phases that contain barriers."""
        out: list[str] = []
        pending: list[ast.stmt] = []

        def flush() -> None:
            if pending:
                out.extend(self.thread_loop(list(pending), ind, in_loop))
                pending.clear()

        for s in stmts:
            if self.is_shared_decl(s):
                continue  # hoisted: allocated per block
            if not _structural(s, in_loop):
                pending.append(s)
                continue
            flush()
            if _is_mma(s):
                out.extend(self.collective(s, ind, in_loop))
                continue
            if isinstance(s, ast.Expr):
                continue  # barrier(): the phase boundary is the barrier
            if isinstance(s, (ast.Break, ast.Continue)):
                out.append(f"{ind}{type(s).__name__.lower()}")
            elif isinstance(s, ast.If):
                out.append(f"{ind}if {self.expr(s.test)}:")
                out += self.structure(s.body, ind + "    ", in_loop) or [f"{ind}    pass"]
                if s.orelse:
                    out.append(f"{ind}else:")
                    out += self.structure(s.orelse, ind + "    ", in_loop) or [f"{ind}    pass"]
            elif isinstance(s, ast.For):
                var = s.target.id  # type: ignore[attr-defined]
                if var not in self.uniform_vars:
                    self.uniform_vars.append(var)
                rng = ", ".join(self.expr(a) for a in s.iter.args)  # type: ignore
                out.append(f"{ind}for {_u(var)} in range({rng}):")
                out += self.abort_check(ind + "    ", "_blk")
                out += self.structure(s.body, ind + "    ", True)
            elif isinstance(s, ast.While):
                out.append(f"{ind}while {self.expr(s.test)}:")
                out += self.abort_check(ind + "    ", "_blk")
                out += self.structure(s.body, ind + "    ", True)
        flush()
        return out

    def thread_loop(self, stmts: list[ast.stmt], ind: str, in_loop: bool) -> list[str]:
        idx = len(self.phases)
        self.phases.append((stmts, in_loop))
        conds = self.affine_ranges(stmts) if self.checked else []
        if not conds:
            return self.thread_loop_text(f"_ph{idx}", idx, ind)
        self.fast_phases.add(idx)
        return ([f"{ind}if {' and '.join(conds)}:"]
                + self.thread_loop_text(f"_phf{idx}", idx, ind + "    ")
                + [f"{ind}else:"]
                + self.thread_loop_text(f"_ph{idx}", idx, ind + "    "))

    def collective(self, s: ast.stmt, ind: str, in_loop: bool) -> list[str]:
        """A block-collective statement (mma) as a phase of its own that runs once per
        block, as thread 0: its arguments are uniform, so thread 0's locals are the
        block's. Skipped when the block has returned (only a uniform return can precede
        it: the barrier rule)."""
        idx = len(self.phases)
        self.phases.append(([s], in_loop))
        skip = [f"{ind}if not _done[0]:"] if self.returns and idx > 0 else []
        inner = ind + "    " if skip else ind
        return skip + [f"{inner}_l0 = 0", f"{inner}_l1 = 0", f"{inner}_l2 = 0", f"{inner}_t = 0",
                       f"{inner}if _ph{idx}(@ARGS@) != 0:", f"{inner}    return _blk"]

    def thread_loop_text(self, fn: str, idx: int, ind: str) -> list[str]:
        skip = [f"{ind}            if _done[_t]:", f"{ind}                continue"] \
            if self.returns and idx > 0 else []
        return [f"{ind}for _l2 in range(_ls2):",
                f"{ind}    for _l1 in range(_ls1):",
                f"{ind}        for _l0 in range(_ls0):",
                f"{ind}            _t = (_l2 * _ls1 + _l1) * _ls0 + _l0",
                *skip,
                f"{ind}            if {fn}(@ARGS@) != 0:",
                f"{ind}                return _blk"]

    # -- block-level range checks of affine accesses -----------------------------------------
    _OFFSET_LIMIT = 1 << 40  # |offset| bound: the range arithmetic cannot overflow int64

    def affine_offset(self, e: ast.AST, guards: dict[str, None]) -> str | None:
        """An offset that is the same for every thread of the launch: an int constant or
        an integer scalar parameter the kernel never assigns (its magnitude is checked at
        block level, ``guards``)."""
        c = _const_int(e)
        if c is not None:
            return str(c) if abs(c) < self._OFFSET_LIMIT else None
        if isinstance(e, ast.Name) and e.id in self.k.scalars and not self.stores.get(e.id):
            dt = self.k.arg_types[self.k.params.index(e.id)].dtype
            if dt in ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32"):
                lim = self._OFFSET_LIMIT
                guards[f"-{lim} < {_u(e.id)} < {lim}"] = None
                return _u(e.id)
        return None

    def affine(self, e: ast.AST, defs: dict[str, tuple[str, int, tuple[str, ...]]],
               guards: dict[str, None]) -> tuple[str, int, tuple[str, ...]] | None:
        """``(kind, d, offsets)`` when ``e`` is ``global_id(d)`` (kind "g") or
        ``local_id(d)`` ("l") plus/minus offsets, directly or through locals in ``defs``."""
        if isinstance(e, ast.Call) and isinstance(e.func, ast.Name) \
                and e.func.id in ("global_id", "local_id") and len(e.args) == 1:
            d = _const_int(e.args[0])
            if d is not None and 0 <= d <= 2:
                return ("g" if e.func.id == "global_id" else "l", d, ())
            return None
        if isinstance(e, ast.Name):
            if e.id in defs:
                for g in self.def_guards.get(e.id, ()):
                    guards[g] = None
            return defs.get(e.id)
        if isinstance(e, ast.BinOp) and isinstance(e.op, (ast.Add, ast.Sub)):
            left = self.affine(e.left, defs, guards)
            if left is not None:
                off = self.affine_offset(e.right, guards)
                if off is None:
                    return None
                return left[0], left[1], left[2] + ((off if isinstance(e.op, ast.Add)
                                                     else f"-{off}"),)
            if isinstance(e.op, ast.Add):
                right = self.affine(e.right, defs, guards)
                off = self.affine_offset(e.left, guards) if right is not None else None
                if right is not None and off is not None:
                    return right[0], right[1], right[2] + (off,)
        return None

    def affine_ranges(self, stmts: list[ast.stmt]) -> list[str]:
        """Mark the phase's accesses whose every index is affine in a thread index (and
        the same for every thread otherwise): over a block's threads such an index spans
        ``[first, first + local_size - 1]``, which the block checks once before the thread
        loop. Returns those block-level conditions (empty: no fast variant). A superset of
        the indices the threads really use is checked (guards and control flow are
        ignored), so a block that passes cannot miss; one that does not runs the
        per-element checked loop, which faults exactly as without this."""
        k = self.k
        defs: dict[str, tuple[str, int, tuple[str, ...]]] = {}
        conds: dict[str, None] = {}
        for s in stmts:
            for n in ast.walk(s):
                if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name):
                    name, idx, node = n.value.id, _indices(n), n
                elif isinstance(n, ast.Call) and isinstance(n.func, ast.Name) \
                        and n.func.id == "atomic_add" and isinstance(n.args[0], ast.Name):
                    name, node = n.args[0].id, n
                    idx = list(n.args[1].elts) if isinstance(n.args[1], ast.Tuple) \
                        else [n.args[1]]
                else:
                    continue
                if name not in k.buffers and name not in k.shared:
                    continue
                if len(idx) != _buffer_ndim(k, name):
                    continue
                guards: dict[str, None] = {}
                ranges = [self.affine(i, defs, guards) for i in idx]
                if any(r is None for r in ranges):
                    continue
                here: list[str] = list(guards)
                for dim, r in enumerate(ranges):
                    assert r is not None
                    kind, d, offs = r
                    first = " + ".join(([f"_g{d} * _ls{d}"] if kind == "g" else [])
                                       + list(offs)) or "0"
                    here.append(f"({first}) >= 0")
                    here.append(f"({first}) + _ls{d} - 1 < {_u(name)}.shape[{dim}]")
                node._aff = True  # type: ignore[attr-defined]
                for c in here:
                    conds[c] = None
            # a local assigned once in the whole kernel, here, keeps its value for the rest
            # of the phase
            if isinstance(s, ast.Assign) and len(s.targets) == 1 \
                    and isinstance(s.targets[0], ast.Name):
                v = s.targets[0].id
                if v in k.locals and self.stores.get(v) == 1:
                    guards = {}
                    r = self.affine(s.value, defs, guards)
                    if r is not None:
                        defs[v] = r
                        self.def_guards[v] = list(guards)  # for the accesses that use v
        return list(conds)

    def phase_args(self) -> str:
        return ", ".join(self.phase_params())

    def phase_params(self) -> list[str]:
        return (["_l0", "_l1", "_l2", "_g0", "_g1", "_g2", "_ls0", "_ls1", "_ls2",
                 "_ng0", "_ng1", "_ng2", "_t", "_done", "abort", "fault", "_blas"]
                + [_u(v) for v in self.uniform_vars]
                + [_u(s) for s in self.k.shared]
                + [f"_pt_{v}" for v in self.per_thread_order]
                + [_u(p) for p in self.k.params])

    # -- per-thread locals -----------------------------------------------------------------
    def per_thread(self) -> dict[str, str]:
        """Locals that must survive from one phase to another (or from one iteration of a
        block-level loop to the next) -> 'int' or 'float' (their per-thread array type)."""
        exclude = set(self.k.params) | set(self.k.shared) | set(self.uniform_vars)
        count: dict[str, int] = {}
        result: set[str] = set()
        for stmts, in_loop in self.phases:
            for name in _names(stmts) - exclude:
                if name not in self.k.locals:
                    continue
                count[name] = count.get(name, 0) + 1
                if in_loop:
                    result.add(name)
        result |= {n for n, c in count.items() if c > 1}
        result |= self.block_locals
        kinds = self.infer_kinds()
        return {n: kinds.get(n, "float") for n in sorted(result)}

    def infer_kinds(self) -> dict[str, str]:
        """'float' unless every value ever assigned to the local is an integer (or bool):
        a conservative type for per-thread arrays, iterated to a fixed point."""
        k = self.k
        kinds: dict[str, str] = {n: "int" for n in k.locals}
        assigns: list[tuple[str, ast.AST | None, ast.operator | None]] = []
        for n in ast.walk(k.fn):
            if isinstance(n, ast.Assign):
                for t in n.targets:
                    if isinstance(t, ast.Name):
                        assigns.append((t.id, n.value, None))
                    elif isinstance(t, ast.Tuple):
                        for e in t.elts:  # a, b = x, y: be conservative
                            if isinstance(e, ast.Name):
                                assigns.append((e.id, None, None))
            elif isinstance(n, ast.AugAssign) and isinstance(n.target, ast.Name):
                assigns.append((n.target.id, n.value, n.op))
        changed = True
        while changed:
            changed = False
            for name, value, op in assigns:
                kind = "float" if value is None else self.kind(value, kinds)
                if isinstance(op, (ast.Div, ast.Pow)):
                    kind = "float"
                if kind == "float" and kinds.get(name) != "float":
                    kinds[name] = "float"
                    changed = True
        return kinds

    def kind(self, e: ast.AST, kinds: dict[str, str]) -> str:
        k = self.k
        if isinstance(e, ast.Constant):
            return "float" if isinstance(e.value, float) else "int"
        if isinstance(e, ast.Name):
            if e.id in k.scalars:
                return k.arg_types[k.params.index(e.id)].kind
            return kinds.get(e.id, "int")
        if isinstance(e, ast.BinOp):
            if isinstance(e.op, (ast.Div, ast.Pow)):
                return "float"
            return _join(self.kind(e.left, kinds), self.kind(e.right, kinds))
        if isinstance(e, ast.UnaryOp):
            return "int" if isinstance(e.op, ast.Not) else self.kind(e.operand, kinds)
        if isinstance(e, ast.Compare):
            return "int"
        if isinstance(e, ast.BoolOp):
            return _join(*(self.kind(v, kinds) for v in e.values))
        if isinstance(e, ast.IfExp):
            return _join(self.kind(e.body, kinds), self.kind(e.orelse, kinds))
        if isinstance(e, ast.Subscript):
            if isinstance(e.value, ast.Attribute):
                return "int"
            return "float" if _buffer_dtype(k, e.value.id).startswith("float") else "int"  # type: ignore
        if isinstance(e, ast.Attribute):
            return "int"
        if isinstance(e, ast.Call) and isinstance(e.func, ast.Name):
            f = e.func.id
            if f in _ID_BUILTINS or f in ("int", "floor"):
                return "int"
            if f in ("abs", "min", "max"):
                return _join(*(self.kind(a, kinds) for a in e.args))
        return "float"

    # -- the module --------------------------------------------------------------------------
    def module(self) -> str:
        k = self.k
        body = [s for s in k.fn.body]
        uses_mma = _contains(body, lambda n: isinstance(n, ast.stmt) and _is_mma(n))
        block_code = self.structure(body, "        ", False)
        pt = self.per_thread()
        self.per_thread_order = list(pt)
        # Calls were emitted before the uniform loop variables and per-thread arrays were
        # all known: fill in the (now final) argument list.
        block_code = [line.replace("@ARGS@", self.phase_args()) for line in block_code]
        nj = (f"dict(nogil=True, cache=True, fastmath={self.opt.fastmath}, "
              f"boundscheck=False, error_model='numpy')")
        lines = [
            f'"""Generated by firmware.jit from kernel {k.fn.name!r}. '
            'Do not edit: the manifest checksums this file."""',
            "import math",
            "import numpy as np",
            "from numba import njit",
            "from firmware.jit import _rt_abort_word, _rt_atomic_add",
            *(["from firmware.matrix import _rt_gemm, _rt_span"] if uses_mma else []),
            "",
            f"_NJ = {nj}",
            "",
            "",
            "@njit(**_NJ)",
            "def _miss(fault, pos, flat):",
            "    if fault[0] == 0:",
            f"        fault[0] = {FAULT_BOUNDS}",
            "        fault[1] = pos",
            "        fault[2] = flat",
            "",
        ]
        if uses_mma:
            lines += matrix.helper_source(ABORT_PREEMPT, FAULT_ABORT).splitlines()
        loaded = {n.value.id for n in ast.walk(k.fn)  # type: ignore[attr-defined]
                  if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name)}
        if self.checked:
            for name in sorted(loaded):
                lines += self.load_helper(name)
        # phase functions
        for i, (stmts, _in_loop) in enumerate(self.phases):
            lines += self.phase_function(i, stmts, pt)
            if i in self.fast_phases:
                self.fast = True
                try:
                    lines += self.phase_function(i, stmts, pt, "_phf")
                finally:
                    self.fast = False
        # the grid function
        sig = ["block_lo", "block_hi", "_ng0", "_ng1", "_ng2", "_ls0", "_ls1", "_ls2",
               "abort", "fault", "_blas"] + [_u(p) for p in k.params]
        lines += ["", "@njit(**_NJ)", f"def _grid({', '.join(sig)}):",
                  "    _nt = _ls0 * _ls1 * _ls2",
                  "    _done = np.zeros(max(_nt, 1), np.uint8)"]
        for name, kind in pt.items():
            dt = "np.float64" if kind == "float" else "np.int64"
            lines.append(f"    _pt_{name} = np.zeros(max(_nt, 1), {dt})")
        for v in self.uniform_vars:
            lines.append(f"    {_u(v)} = 0")
        lines += ["    for _blk in range(block_lo, block_hi):",
                  "        if _rt_abort_word(abort) != 0:",
                  "            return _blk",
                  "        _g0 = _blk % _ng0",
                  "        _g1 = (_blk // _ng0) % _ng1",
                  "        _g2 = _blk // (_ng0 * _ng1)"]
        if self.returns and len(self.phases) > 1:
            lines.append("        _done[:] = 0")
        for name, (shape, dtype) in k.shared.items():
            np_dt = "np.bool_" if dtype == "bool" else f"np.{dtype}"
            lines.append(f"        {_u(name)} = np.zeros({shape!r}, {np_dt})")
        lines += block_code
        lines += ["    return block_hi", ""]
        return "\n".join(lines)

    def load_helper(self, name: str) -> list[str]:
        """A load under short-circuit evaluation: a miss is recorded and reads zero."""
        ndim = _buffer_ndim(self.k, name)
        dtype = _buffer_dtype(self.k, name)
        zero = "False" if dtype == "bool" else f"np.{dtype}(0)"
        ivars = [f"i{d}" for d in range(ndim)]
        conds = " or ".join(f"np.uint64({v}) >= np.uint64(a.shape[{d}])"
                            for d, v in enumerate(ivars))
        flat = ivars[0]
        for d, v in enumerate(ivars[1:], 1):
            flat = f"({flat}) * a.shape[{d}] + {v}"
        sub = ", ".join(f"np.uint64({v})" for v in ivars)
        return ["", "@njit(**_NJ)", f"def _ld_{name}(a, {', '.join(ivars)}, fault):",
                f"    if {conds}:",
                f"        _miss(fault, {self.pos_of(name)}, {flat})",
                f"        return {zero}",
                f"    return a[{sub}]", ""]

    def phase_function(self, i: int, stmts: list[ast.stmt], pt: dict[str, str],
                       prefix: str = "_ph") -> list[str]:
        used = _names(stmts) & set(pt)
        assigned = _assigned(stmts) & set(pt)
        writeback = [f"_pt_{n}[_t] = {_u(n)}" for n in sorted(assigned)]
        lines = ["", "@njit(**_NJ)", f"def {prefix}{i}({', '.join(self.phase_params())}):"]
        for d in range(3):
            lines.append(f"    _gid{d} = _g{d} * _ls{d} + _l{d}")
        for n in sorted(used):
            lines.append(f"    {_u(n)} = _pt_{n}[_t]")
        lines += self.block(stmts, "    ", writeback)
        lines += [f"    {w}" for w in writeback] + ["    return 0", ""]
        return lines


def _join(*kinds: str) -> str:
    return "float" if "float" in kinds else "int"


def lower(ir: dict[str, Any], arg_types: tuple[str, ...], options: Options) -> str:
    """Validate and lower one kernel: the text of the generated module."""
    k = validate(ir, tuple(arg_types))
    return _Lowering(k, options).module()


# --------------------------------------------------------------------------- compiled kernel


class CompiledKernel:
    """One kernel compiled for one set of argument types and options."""

    #: True would mean atomic_add is not a real atomic and the caller must serialise the
    #: launch's blocks; atomics here are LLVM atomicrmw, so it is always False.
    needs_serial: bool = False

    def __init__(self, key: str, name: str, params: list[str], arg_types: list[ArgType],
                 shared: list[str], dispatcher: Any, signature: tuple[Any, ...],
                 source: str, module_path: Path, blas: np.ndarray) -> None:
        self.key = key
        self.name = name
        self.params = params
        self.arg_types = arg_types
        self.shared = shared
        self.dispatcher = dispatcher
        self.signature = signature
        self.source = source
        self.module_path = module_path
        self.blas = blas  # the matrix unit's entry points (firmware/matrix.py)
        #: Whether it calls the matrix unit: its work then grows with the tiles, not with
        #: the thread count (the scheduler's inline heuristic).
        self.uses_mma = "\ndef _mma(" in source
        # The native entry point skips numba's per-call type dispatch (a few us per launch);
        # run() checks the buffers itself, since it would not.
        try:
            self._entry = dispatcher.overloads[signature].entry_point
        except (KeyError, AttributeError):  # pragma: no cover - numba internals moved
            self._entry = dispatcher
        self._checks = [(i, np.dtype(t.dtype), t.ndim) for i, t in enumerate(arg_types) if t.ndim]

    def run(self, block_lo: int, block_hi: int, grid: tuple[int, int, int],
            block: tuple[int, int, int], args: list[Any], abort: np.ndarray) -> int:
        """Run blocks ``[block_lo, block_hi)`` (linear ids, x fastest) of a launch of
        ``grid`` blocks of ``block`` threads. Returns the first block not run
        (``block_hi`` when all ran; less only when the abort word stopped it between
        blocks). Raises :class:`KernelFault` on a bounds miss or when the abort word
        stopped a block in the middle."""
        gx, gy, gz = grid
        bx, by, bz = block
        if not 0 <= block_lo <= block_hi <= gx * gy * gz or min(bx, by, bz) < 1:
            raise ValueError(f"blocks [{block_lo}, {block_hi}) outside grid {grid} "
                             f"or bad block {block}")
        if not (type(abort) is np.ndarray and abort.dtype == np.int64 and abort.shape == (1,)):
            raise TypeError("abort must be an int64 array of shape (1,)")
        if len(args) != len(self.params):
            raise TypeError(f"{self.name} takes {len(self.params)} arguments, got {len(args)}")
        for i, dt, nd in self._checks:
            a = args[i]
            if not (isinstance(a, np.ndarray) and a.dtype == dt and a.ndim == nd
                    and a.flags.c_contiguous):
                raise TypeError(f"argument {self.params[i]!r} must be a C-contiguous "
                                f"{dt}[{nd}d] array")
        fault = np.zeros(4, np.int64)
        done = self._entry(block_lo, block_hi, gx, gy, gz, bx, by, bz, abort, fault,
                           self.blas, *args)
        kind = int(fault[0])
        if kind == FAULT_BOUNDS:
            pos = int(fault[1])
            names = self.params + self.shared
            param = names[pos] if 0 <= pos < len(names) else f"#{pos}"
            raise KernelFault("bounds", param, int(fault[2]), block=int(done),
                              message=f"{self.name}: out-of-bounds access {param}"
                                      f"[{int(fault[2])}] in block {int(done)}")
        if kind == FAULT_ABORT:
            why = "watchdog" if int(abort[0]) == ABORT_WATCHDOG else "abort"
            raise KernelFault(why, block=int(done),
                              message=f"{self.name}: stopped by {why} in block {int(done)}")
        return int(done)


# --------------------------------------------------------------------------- the cache


def warm_up() -> None:
    """Load numba's CPU target now: its typing and lowering registries load on first use
    (~0.1-0.2 s, importing much of numba), which would otherwise land on the first kernel
    loaded from the cache and make it cost ~10x the cache read itself."""
    from numba.core.registry import cpu_target

    cpu_target.typing_context.refresh()
    cpu_target.target_context.refresh()



def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class KernelCache:
    """Compiled kernels, in memory and persistently under ``root`` (see the module doc).

    ``hits`` counts get()s served by an existing entry (in memory or on disk), ``misses``
    those that had to build one, ``compiles`` those in which numba compiled instead of
    loading machine code from its cache."""

    def __init__(self, root: Path, isa: str = DEFAULT_ISA,
                 stepping: str = DEFAULT_STEPPING, use_blas: bool = True) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.isa = isa
        self.stepping = stepping
        #: mma's BLAS entry points; zeros make kernels run mma as plain loops (tests
        #: compare the two). Not a key input: the pointers are arguments, not code.
        self.blas = matrix.blas_pointers() if use_blas else np.zeros(len(matrix.SLOT), np.int64)
        self.hits = 0
        self.misses = 0
        self.compiles = 0
        self._lock = threading.RLock()
        self._mem: dict[str, CompiledKernel] = {}
        self._fast: dict[tuple[str, tuple[str, ...], Options], list[tuple[Any, Any, str]]] = {}

    # -- keys -------------------------------------------------------------------------------
    def key_inputs(self, ir: dict[str, Any], arg_types: tuple[str, ...],
                   options: Options) -> dict[str, Any]:
        """What the key hashes (the generated source's hash is added at build time). Only
        the kernel's own source, params and shared_mem: not its name in the module, its
        position, nor the module's other kernels."""
        return {
            "kernel": {"source": ir.get("source"), "params": ir.get("params"),
                       "shared_mem": ir.get("shared_mem", 0)},
            "arg_types": list(arg_types),
            "options": asdict(options),
            "compat": compat_key(options, self.isa, self.stepping),
        }

    def key(self, ir: dict[str, Any], arg_types: tuple[str, ...], options: Options) -> str:
        """The persistent cache key: sha256 over the inputs and the generated source."""
        inputs = self.key_inputs(ir, arg_types, options)
        source = lower(ir, tuple(arg_types), options)
        return self._key(inputs, source)

    @staticmethod
    def _key(inputs: dict[str, Any], source: str) -> str:
        return _sha(_canonical({"inputs": inputs, "generated": _sha(source.encode())}))

    def entry_dir(self, key: str) -> Path:
        return self.root / key[:2] / key

    # -- get --------------------------------------------------------------------------------
    def get(self, ir: dict[str, Any], arg_types: tuple[str, ...],
            options: Options = Options()) -> CompiledKernel:
        """The compiled kernel, from memory, from disk, or compiled now (eagerly, so the
        first launch does not pay for it). Raises :class:`KernelCompileError`."""
        arg_types = tuple(arg_types)
        fast = (ir.get("source"), arg_types, options)
        params, shared_mem = ir.get("params"), ir.get("shared_mem", 0)
        with self._lock:
            for p, s, key in self._fast.get(fast, ()):
                if p == params and s == shared_mem:
                    self.hits += 1
                    return self._mem[key]
            inputs = self.key_inputs(ir, arg_types, options)
            source = lower(ir, arg_types, options)
            key = self._key(inputs, source)
            ck = self._mem.get(key)
            if ck is None:
                ck = self._get_disk(key, inputs, source, ir, arg_types)
                self._mem[key] = ck
            else:
                self.hits += 1
            self._fast.setdefault(fast, []).append((copy.deepcopy(params), shared_mem, key))
            return ck

    def cached(self, ir: dict[str, Any], arg_types: tuple[str, ...],
               options: Options = Options()) -> CompiledKernel | None:
        """The compiled kernel if it is already in memory, else None (never compiles: the
        scheduler may run small launches inline only when this costs no compile)."""
        with self._lock:
            for p, s, key in self._fast.get((ir.get("source"), tuple(arg_types), options), ()):
                if p == ir.get("params") and s == ir.get("shared_mem", 0):
                    self.hits += 1
                    return self._mem[key]
        return None

    @contextlib.contextmanager
    def _flock(self, key: str) -> Iterator[None]:
        with open(self.root / f"{key}.lock", "a+b") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)

    def _get_disk(self, key: str, inputs: dict[str, Any], source: str, ir: dict[str, Any],
                  arg_types: tuple[str, ...]) -> CompiledKernel:
        entry = self.entry_dir(key)
        module_name = f"kernel_{key[:16]}.py"
        with self._flock(key):
            if entry.exists():
                if self._valid(entry, key, module_name, source):
                    try:
                        ck, compiled = self._load(entry, key, module_name, source, ir, arg_types)
                    except Exception:  # noqa: BLE001 - e.g. numba's cache files unreadable
                        ck = None  # rebuilt below; a real compile error shows up there
                    if ck is not None:
                        self.hits += 1
                        self.compiles += compiled
                        return ck
                shutil.rmtree(entry, ignore_errors=True)  # corrupt or half-written: rebuild
            self.misses += 1
            self._build(entry, key, inputs, module_name, source)
            try:
                ck, compiled = self._load(entry, key, module_name, source, ir, arg_types)
            except BaseException:
                shutil.rmtree(entry, ignore_errors=True)  # never keep an entry that fails
                raise
            self.compiles += compiled
            return ck

    def _valid(self, entry: Path, key: str, module_name: str, source: str) -> bool:
        """The manifest parses, names this key, and checksums the module file."""
        try:
            manifest = json.loads((entry / "manifest.json").read_text())
            data = (entry / module_name).read_bytes()
        except (OSError, ValueError):
            return False
        return (isinstance(manifest, dict) and manifest.get("key") == key
                and manifest.get("module") == module_name
                and manifest.get("source_sha256") == _sha(data)
                and data == source.encode())

    def _build(self, entry: Path, key: str, inputs: dict[str, Any], module_name: str,
               source: str) -> None:
        """Write the entry in a temporary directory and rename it into place, so a reader
        (or a crash) never sees half an entry."""
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{key[:16]}-", dir=entry.parent))
        try:
            (tmp / module_name).write_text(source)
            manifest = {"key": key, "inputs": inputs, "module": module_name,
                        "source_sha256": _sha(source.encode()), "created": time.time(),
                        "firmware_jit_abi": FIRMWARE_JIT_ABI}
            (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))
            for p in (tmp / module_name, tmp / "manifest.json"):
                with open(p, "rb") as f:
                    os.fsync(f.fileno())
            os.rename(tmp, entry)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def _load(self, entry: Path, key: str, module_name: str, source: str, ir: dict[str, Any],
              arg_types: tuple[str, ...]) -> tuple[CompiledKernel, int]:
        """Import the entry's module and compile ``_grid`` eagerly: numba loads it from its
        ``__pycache__`` when it can (returns compiled=0) or compiles and saves it (1)."""
        mod_name = f"aemu_jit_kernel_{key[:16]}"
        path = entry / module_name
        spec = importlib.util.spec_from_file_location(mod_name, path)
        if spec is None or spec.loader is None:  # pragma: no cover
            raise KernelCompileError(f"cannot import {path}")
        mod = importlib.util.module_from_spec(spec)
        # Registered before exec: numba's cache rebuilds the function's environment by
        # module name, and fails to load (silently recompiling) when it is not there.
        sys.modules[mod_name] = mod
        try:
            spec.loader.exec_module(mod)
        except BaseException:
            sys.modules.pop(mod_name, None)
            raise
        parsed = [ArgType.parse(t) for t in arg_types]
        abort_t = types.Array(types.int64, 1, "C")
        sig = (types.int64, types.int64, types.int64, types.int64, types.int64,
               types.int64, types.int64, types.int64, abort_t, abort_t, abort_t,
               *[t.numba_type() for t in parsed])
        disp = mod._grid
        try:
            disp.compile(sig)
        except Exception as exc:  # numba typing/lowering errors are the kernel's
            sys.modules.pop(mod_name, None)
            raise KernelCompileError(f"kernel {ir.get('name', '?')!r} does not compile: "
                                     f"{str(exc).splitlines()[0] if str(exc) else exc!r}") from exc
        compiled = 1 if sum(disp.stats.cache_misses.values()) else 0
        k = validate(ir, arg_types)
        ck = CompiledKernel(key, k.fn.name, k.params, parsed, list(k.shared), disp, sig,
                            source, path, self.blas)
        return ck, compiled


__all__ = ["ABORT_KILL", "ABORT_PREEMPT", "ABORT_WATCHDOG", "FIRMWARE_JIT_ABI",
           "CompiledKernel", "KernelCache", "KernelCompileError", "KernelFault", "Options",
           "compat_key", "lower", "validate"]
