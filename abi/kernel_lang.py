"""The kernel language, defined once: element types, built-ins, collectives, operators.

A kernel is a Python function in a restricted language (docs/kernels.md). Two parties read
it and neither trusts the other: the runtime (``runtime/kernels.py``) checks what a user
wrote and emits the module IR; the firmware (``firmware/kernel_check.py``) checks that IR
again before it compiles anything, because a process may hand the device any bytes it
likes. Both run the one checker of the language, ``abi/kernel_frontend.py``, which reads
the tables and limits below.

Operators are named by their ``ast`` node class (``"Add"``, ``"Eq"``), which is how both
checkers meet them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final, Literal

#: The instruction set this device model runs (a module must name it), and the version of
#: the module IR (``{"format": IR_FORMAT, "isa": ..., "kernels": {...}}``).
ISA: Final = "aemu-isa"
ISA_VERSION: Final = "1.0"
IR_FORMAT: Final = 1

# --- element types --------------------------------------------------------------------------
#: name -> (argument-record code of a LAUNCH, itemsize). Codes are docs/kernels.md's.
DTYPES: Final[dict[str, tuple[int, int]]] = {
    "int8": (1, 1), "uint8": (2, 1), "int16": (3, 2), "uint16": (4, 2),
    "int32": (5, 4), "uint32": (6, 4), "int64": (7, 8), "uint64": (8, 8),
    "float32": (9, 4), "float64": (10, 8), "bool": (11, 1),
}
#: Short spellings users may write in annotations and ``shared_array``.
DTYPE_ALIASES: Final[dict[str, str]] = {
    "i8": "int8", "u8": "uint8", "i16": "int16", "u16": "uint16",
    "i32": "int32", "u32": "uint32", "i64": "int64", "u64": "uint64",
    "f32": "float32", "f64": "float64",
}
DTYPE_CODES: Final[dict[str, int]] = {name: code for name, (code, _) in DTYPES.items()}
DTYPE_NAMES: Final[dict[int, str]] = {code: name for name, code in DTYPE_CODES.items()}
#: Most dimensions of a buffer or a shared array (the fault record has room for this many).
MAX_NDIM: Final = 8

# --- limits of one kernel ---------------------------------------------------------------------
#: A kernel's name: what KERNEL_GET's name field holds (the driver refuses other names).
KERNEL_NAME: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")
#: Syntax-tree nodes of one kernel (ast.walk's count): numba's compile time grows faster
#: than linearly with it; the kernel library's largest, gemm, has 265.
MAX_NODES: Final = 4096
#: Levels of the syntax tree: ast.unparse and copy.deepcopy in the firmware's lowering
#: recurse a few frames per level, and Python allows 1000 frames.
MAX_DEPTH: Final = 100
#: Loops nested in one another: Python's compiler allows 20 nested blocks, and the
#: firmware's generated ``_grid`` puts a block loop and three thread loops around
#: block-level ones.
MAX_LOOP_NESTING: Final = 16
#: Bytes of block-shared memory a kernel may declare statically (and a launch may ask for
#: dynamically): 20x this ISA's 48 KiB per block. The driver checks the IR's figure
#: against the device; this bounds what the JIT allocates per block without it.
SHARED_LIMIT: Final = 1 << 20
#: Integer constants must fit in 64 bits (numba cannot type larger ones).
INT_LIMIT: Final = 1 << 64

# --- built-ins ------------------------------------------------------------------------------
BuiltinKind = Literal["id", "math", "convert", "minmax", "statement", "declaration"]


@dataclass(frozen=True)
class Builtin:
    """One built-in function of the language.

    ``kind``: ``id`` (thread/block coordinates, one constant dimension 0..2), ``math`` and
    ``convert`` (one argument), ``minmax`` (two or more), ``statement`` (returns nothing:
    legal only as an expression statement), ``declaration`` (declares a block-shared array:
    legal only as the right side of ``name = ...``; its dtype name is the last argument).
    """

    name: str
    kind: BuiltinKind
    #: positional arguments it takes; None: two or more (``minmax``)
    nargs: int | None
    #: every thread of a block issues it together: the barrier rule applies (the same trip
    #: count in every thread, no thread-dependent early return before it)
    collective: bool = False
    #: its value differs between the threads of one block
    per_thread: bool = False
    #: the device capability it needs (``accel_device_info.capabilities``, by name)
    capability: str | None = None


BUILTINS: Final[dict[str, Builtin]] = {b.name: b for b in (
    Builtin("global_id", "id", 1, per_thread=True),
    Builtin("local_id", "id", 1, per_thread=True),
    Builtin("group_id", "id", 1),
    Builtin("local_size", "id", 1),
    Builtin("num_groups", "id", 1),
    *(Builtin(n, "math", 1) for n in ("sqrt", "exp", "log", "sin", "cos", "tanh", "abs",
                                      "floor")),
    Builtin("float", "convert", 1),
    Builtin("int", "convert", 1),
    Builtin("min", "minmax", None),
    Builtin("max", "minmax", None),
    Builtin("barrier", "statement", 0, collective=True, capability="shared_mem"),
    #: atomic_add(buf, index, value): buf a buffer parameter or a shared array
    Builtin("atomic_add", "statement", 3, capability="atomics"),
    #: mma(c, a, b, row, col, k0, tm, tn, tk, beta[, ta[, tb]]): the matrix unit, once
    #: per block, ``c[row:row+tm, col:col+tn] = beta * c[...] + a[row:row+tm, k0:k0+tk] @
    #: b[k0:k0+tk, col:col+tn]``, where a nonzero ``ta`` (``tb``) reads ``a``'s (``b``'s)
    #: tile transposed from ``a[k0:k0+tk, row:row+tm]`` (``b[col:col+tn, k0:k0+tk]``); the
    #: operands are 2-D buffer parameters of one dtype of MMA_DTYPES, the rest uniform
    #: scalars (at most MMA_MAX_NARGS arguments)
    Builtin("mma", "statement", 10, collective=True, capability="matrix"),
    #: shared_array(shape, dtype): static; its bytes count in the IR's ``shared_mem``
    Builtin("shared_array", "declaration", 2, capability="shared_mem"),
    #: dynamic_shared(dtype): CUDA's ``extern __shared__``, 1-D over the launch's dynamic
    #: shared bytes; every such array of a kernel aliases the same memory
    Builtin("dynamic_shared", "declaration", 1, capability="shared_mem"),
)}


def builtins_of(*kinds: BuiltinKind) -> frozenset[str]:
    """Names of the built-ins of these kinds."""
    return frozenset(n for n, b in BUILTINS.items() if b.kind in kinds)


COLLECTIVES: Final = frozenset(n for n, b in BUILTINS.items() if b.collective)
PER_THREAD: Final = frozenset(n for n, b in BUILTINS.items() if b.per_thread)
#: built-in -> the device capability it needs
CAPABILITY_OF: Final[dict[str, str]] = {n: b.capability for n, b in BUILTINS.items()
                                        if b.capability}
#: Names a kernel can never bind (``range`` is only legal as a for loop's iterable).
RESERVED: Final = frozenset(BUILTINS) | {"range"}
MMA_OPERANDS: Final = 3
#: mma's arguments with both optional layout flags (``ta``, ``tb``) written
MMA_MAX_NARGS: Final = 12
#: mma's tile sizes (tm, tn, tk) by argument position: what bounds its work
MMA_TILE_SIZES: Final = (6, 7, 8)
MMA_DTYPES: Final = ("float32", "float64")
#: What each flag of a kernel's IR says it needs of the device (MODULE_LOAD refuses a
#: module the device cannot run with EOPNOTSUPP; the firmware reads the source as well,
#: since a hand-made IR may lie).
KERNEL_FLAG_CAPS: Final[tuple[tuple[str, str], ...]] = (
    ("uses_atomics", "atomics"), ("uses_barrier", "shared_mem"), ("uses_mma", "matrix"))

# --- operators (ast node class names) ---------------------------------------------------------
#: ``x op= y`` (``**=`` is not: the front end refuses it, a power's type depends on values)
AUGMENTED_OPS: Final = ("Add", "Sub", "Mult", "Div", "FloorDiv", "Mod", "BitAnd", "BitOr",
                        "BitXor", "LShift", "RShift")
BINARY_OPS: Final = (*AUGMENTED_OPS, "Pow")
UNARY_OPS: Final = ("UAdd", "USub", "Not", "Invert")
COMPARE_OPS: Final = ("Eq", "NotEq", "Lt", "LtE", "Gt", "GtE")
BOOL_OPS: Final = ("And", "Or")
#: Every operator of the language; ``@``, ``is`` and ``in`` are not.
OPERATORS: Final = frozenset((*BINARY_OPS, *UNARY_OPS, *COMPARE_OPS, *BOOL_OPS))
