"""The kernel language's one front end: a kernel's syntax tree -> what it declares, or a
:class:`LanguageError` naming the line and the rule it breaks.

Two parties read a kernel and neither trusts the other (docs/kernels.md): the runtime
(``runtime/kernels.py``) checks what a user wrote before it emits the module IR, and the
firmware (``firmware/kernel_check.py``) checks the IR's ``source`` again at its trust
boundary, since a process may hand the device any bytes it likes. Both run *this* checker,
so the language has one definition and a kernel is judged the same on both sides
(``tests/unit/test_kernel_frontend_differential.py``); what each adds is its own: the
runtime reads files and function objects and emits the IR, the firmware binds the IR to a
launch's argument types.

Because the firmware runs it on hostile input, the checker is total: it bounds the tree
(:data:`~abi.kernel_lang.MAX_NODES`, :data:`~abi.kernel_lang.MAX_DEPTH`) before it recurses
over it, and it is deliberately strict: a construct the contract does not list is
rejected with a reason that names it, rather than passed along to fail later, far from the
user, inside a JIT. Standard library only (``abi/`` imports no layer).
"""

from __future__ import annotations

import ast
from collections import deque
from dataclasses import dataclass
from typing import Any

from abi import kernel_lang

#: dtype name -> (launch-ABI dtype code, itemsize in bytes), and their short spellings.
DTYPES = kernel_lang.DTYPES
DTYPE_ALIASES = kernel_lang.DTYPE_ALIASES
BUILTINS: frozenset[str] = frozenset(kernel_lang.BUILTINS)


class LanguageError(ValueError):
    """A kernel that breaks the language. ``lineno`` is 1-based (in the user's file when
    the caller passed the offset of the kernel in it), ``reason`` the rule it breaks,
    ``kernel`` its name once known."""

    def __init__(self, reason: str, lineno: int, kernel: str | None = None) -> None:
        where = f"kernel {kernel}, line {lineno}" if kernel else f"line {lineno}"
        super().__init__(f"{where}: {reason}")
        self.reason = reason
        self.lineno = lineno
        self.kernel = kernel


_ID_BUILTINS = kernel_lang.builtins_of("id")
#: Built-ins whose value differs between the threads of one block.
_THREAD_IDS = kernel_lang.PER_THREAD
_UNARY_BUILTINS = kernel_lang.builtins_of("math", "convert")
_VARIADIC_BUILTINS = kernel_lang.builtins_of("minmax")
#: Block-collective built-ins (barrier, mma): every thread of a block issues them
#: together, so the barrier rule (same trip count in every thread, no thread-dependent
#: early return) applies to each of them, not only to barrier().
_COLLECTIVES = kernel_lang.COLLECTIVES
#: Built-ins that return nothing: legal only as expression statements.
_STATEMENT_BUILTINS = kernel_lang.builtins_of("statement")
_MMA_NARGS = kernel_lang.BUILTINS["mma"].nargs
_MMA_OPERANDS = kernel_lang.MMA_OPERANDS
_MMA_DTYPES = kernel_lang.MMA_DTYPES
#: Block-shared memory declarations -> their arity (see kernel_lang.BUILTINS). Each is
#: legal only as the right side of a plain ``name = ...(...)``, which binds ``name`` to a
#: block-shared array; several ``dynamic_shared`` declarations alias the same memory, as
#: in CUDA, each viewed with its own dtype (``kernel[grid, block](..., shared_mem=N)``
#: sizes it per launch).
_SHARED_DECLS: dict[str, int] = {n: kernel_lang.BUILTINS[n].nargs or 0
                                 for n in kernel_lang.builtins_of("declaration")}
#: Names a kernel can never bind (``range`` is only legal as a for loop's iterable).
_RESERVED = kernel_lang.RESERVED
#: Host built-ins that are worth a pointed message rather than "not a built-in".
_FORBIDDEN_CALLS = frozenset({"exec", "eval", "compile", "__import__", "open", "getattr",
                              "setattr", "delattr", "globals", "locals", "vars", "input"})

_AUG_OPS = tuple(getattr(ast, n) for n in kernel_lang.AUGMENTED_OPS)
_BIN_OPS = tuple(getattr(ast, n) for n in kernel_lang.BINARY_OPS)
_UNARY_OPS = tuple(getattr(ast, n) for n in kernel_lang.UNARY_OPS)
_CMP_OPS = tuple(getattr(ast, n) for n in kernel_lang.COMPARE_OPS)
_OP_SYMBOLS = {ast.Pow: "**", ast.MatMult: "@", ast.Is: "is", ast.IsNot: "is not",
               ast.In: "in", ast.NotIn: "not in"}

#: Reasons for constructs the language does not have, keyed by AST node type.
_CONSTRUCTS: dict[type, str] = {
    ast.Import: "imports are not allowed in a kernel",
    ast.ImportFrom: "imports are not allowed in a kernel",
    ast.Global: "`global` declarations are not allowed in a kernel",
    ast.Nonlocal: "`nonlocal` declarations are not allowed in a kernel",
    ast.Lambda: "lambda expressions are not allowed in a kernel",
    ast.ListComp: "list comprehensions are not allowed in a kernel",
    ast.SetComp: "set comprehensions are not allowed in a kernel",
    ast.DictComp: "dict comprehensions are not allowed in a kernel",
    ast.GeneratorExp: "generator expressions are not allowed in a kernel",
    ast.With: "`with` statements are not allowed in a kernel",
    ast.AsyncWith: "`async with` is not allowed in a kernel (no async)",
    ast.AsyncFor: "`async for` is not allowed in a kernel (no async)",
    ast.AsyncFunctionDef: "async functions are not allowed in a kernel (no async)",
    ast.Await: "`await` is not allowed in a kernel (no async)",
    ast.Try: "`try` statements are not allowed in a kernel",
    ast.Raise: "`raise` is not allowed in a kernel",
    ast.Assert: "`assert` is not allowed in a kernel",
    ast.Yield: "`yield` is not allowed in a kernel (kernels are not generators)",
    ast.YieldFrom: "`yield from` is not allowed in a kernel (kernels are not generators)",
    ast.FunctionDef: "nested functions are not allowed in a kernel",
    ast.ClassDef: "class definitions are not allowed in a kernel",
    ast.Delete: "`del` statements are not allowed in a kernel",
    ast.Starred: "starred expressions (`*x`) are not allowed in a kernel",
    ast.NamedExpr: "assignment expressions (`:=`) are not allowed in a kernel",
    ast.JoinedStr: "f-strings are not allowed in a kernel",
    ast.List: "lists are not allowed in a kernel",
    ast.Tuple: "tuples are only allowed as buffer indices and shared_array shapes",
    ast.Dict: "dicts are not allowed in a kernel",
    ast.Set: "sets are not allowed in a kernel",
    ast.Slice: "slices are not allowed in a kernel (index one element at a time)",
    ast.Match: "`match` statements are not allowed in a kernel",
    ast.AnnAssign: "annotated assignments are not allowed in a kernel (annotate parameters)",
}
if hasattr(ast, "TryStar"):  # Python 3.11+
    _CONSTRUCTS[ast.TryStar] = "`try` statements are not allowed in a kernel"



def normalize_dtype(name: str) -> str | None:
    """The canonical dtype name for ``name`` ("f32" -> "float32"), None if unknown."""
    name = DTYPE_ALIASES.get(name, name)
    return name if name in DTYPES else None


def _is_dunder(name: str) -> bool:
    """``__x`` as well as ``__x__``: Python mangles the one and gives the other meaning;
    a kernel needs neither."""
    return name.startswith("__")


def _shared_decl_name(node: ast.AST) -> str | None:
    """The shared-memory declaration built-in ``node`` calls (shared_array or
    dynamic_shared), or None."""
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id in _SHARED_DECLS):
        return node.func.id
    return None


def _is_const_int(node: ast.AST) -> bool:
    return (isinstance(node, ast.Constant) and isinstance(node.value, int)
            and not isinstance(node.value, bool))



def strip_docstring(body: list[ast.stmt]) -> list[ast.stmt]:
    """``body`` without its docstring (the only string statement a kernel may have)."""
    if (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)):
        return body[1:]
    return body


# --------------------------------------------------------------------------- sources


#: Top-level statements worth a pointed reason rather than "only kernel definitions".
_TOP_LEVEL_REASONS = {
    ast.Import: "imports are not allowed in a kernel",
    ast.ImportFrom: "imports are not allowed in a kernel",
    ast.AsyncFunctionDef: "async functions are not allowed in a kernel (no async)",
}


def definitions(text: str, offset: int = 0) -> list[ast.FunctionDef]:
    """The kernel definitions of source text whose line 1 is line ``offset + 1`` of the
    user's file: its top level holds kernel ``def``s and at most a docstring. Total: anything
    Python's parser refuses (a syntax error, a NUL byte, nesting past its own limits) is a
    :class:`LanguageError` too."""
    try:
        tree = ast.parse(text)
    except SyntaxError as e:
        raise LanguageError(f"syntax error: {e.msg}", (e.lineno or 1) + offset) from None
    except (ValueError, RecursionError, MemoryError) as e:  # ValueError: a NUL byte
        raise LanguageError(f"the source does not parse ({type(e).__name__})",
                            1 + offset) from None
    defs: list[ast.FunctionDef] = []
    for i, stmt in enumerate(tree.body):
        if isinstance(stmt, ast.FunctionDef):
            defs.append(stmt)
        elif i == 0 and not strip_docstring([stmt]):
            continue  # a module docstring
        elif type(stmt) in _TOP_LEVEL_REASONS:
            raise LanguageError(_TOP_LEVEL_REASONS[type(stmt)], stmt.lineno + offset)
        else:
            raise LanguageError("only kernel definitions (`def`) are allowed at the top level "
                                f"of kernel source, not {type(stmt).__name__}",
                                stmt.lineno + offset)
    if not defs:
        raise LanguageError("no kernel definition (`def`) in the source", 1 + offset)
    return defs


def _check_size(fn: ast.FunctionDef, offset: int) -> None:
    """At most MAX_NODES syntax-tree nodes, MAX_DEPTH levels and MAX_LOOP_NESTING nested
    loops, counted without recursion: everything after this (the checker, ast.unparse in
    its messages, the firmware's lowering) recurses over the tree."""
    count = 0
    todo: deque[tuple[ast.AST, int, int, int]] = deque([(fn, 1, 0, fn.lineno)])
    while todo:
        node, depth, loops, line = todo.popleft()
        line = getattr(node, "lineno", line)  # operators and contexts have none
        count += 1
        if count > kernel_lang.MAX_NODES:
            raise LanguageError(f"the kernel has more than {kernel_lang.MAX_NODES} "
                                "syntax-tree nodes", fn.lineno + offset, fn.name)
        if depth > kernel_lang.MAX_DEPTH:
            raise LanguageError(f"expressions or statements nested deeper than "
                                f"{kernel_lang.MAX_DEPTH} levels", line + offset, fn.name)
        loops += isinstance(node, (ast.For, ast.While))
        if loops > kernel_lang.MAX_LOOP_NESTING:
            raise LanguageError(f"loops nested deeper than {kernel_lang.MAX_LOOP_NESTING}",
                                line + offset, fn.name)
        todo.extend((child, depth + 1, loops, line) for child in ast.iter_child_nodes(node))


# --------------------------------------------------------------------------- checker


@dataclass
class KernelInfo:
    """What a valid kernel declares: everything the IR says of it, and the names the
    firmware's lowering needs."""

    name: str
    #: parameter -> its annotated dtype (None: set by the launch), in order
    params: dict[str, str | None]
    #: buffer parameter -> its number of dimensions (how it is indexed, else 1)
    buffers: dict[str, int]
    #: block-shared array -> (shape, dtype); shape None for a dynamic_shared array
    shared: dict[str, tuple[tuple[int, ...] | None, str]]
    #: names the body binds (shared arrays and loop variables included)
    locals: set[str]
    shared_mem: int
    uses_barrier: bool
    uses_atomics: bool
    uses_mma: bool
    dynamic_shared: bool

    def ir_params(self) -> list[dict[str, Any]]:
        """The IR's ``params`` (docs/kernels.md, "Module IR")."""
        return [{"name": n, "kind": "buffer", "dtype": d, "ndim": self.buffers[n]}
                if n in self.buffers else {"name": n, "kind": "scalar", "dtype": d}
                for n, d in self.params.items()]


def check(fn: ast.FunctionDef, offset: int = 0) -> KernelInfo:
    """Check one kernel definition against the language (docs/kernels.md); ``offset`` is
    the line of the user's file before its source's line 1. Raises :class:`LanguageError`
    and nothing else, whatever the tree holds."""
    _check_size(fn, offset)
    return _Checker(fn, offset).run()


class _Checker:
    """Validates one kernel definition and describes it.

    Passes: a pre-scan that classifies names (buffer parameters, shared arrays, locals),
    a structural pass in source order that enforces the whitelist and the built-ins'
    signatures (barrier, atomic_add, mma, shared_array, dynamic_shared, the id and math
    built-ins), then the checks that need the whole body: shape ranges, atomics on bool
    arrays, and the placement and argument uniformity of the block-collective built-ins
    (barrier() and mma())."""

    def __init__(self, fn: ast.FunctionDef, offset: int) -> None:
        self.fn = fn
        self.offset = offset
        self.name = fn.name
        self.params: dict[str, str | None] = {}   # name -> dtype (None: at launch)
        self.buffers: set[str] = set()            # params used as arrays
        self.shared: dict[str, int] = {}          # shared array local -> ndim
        self.shared_decls: dict[str, tuple[tuple[int, ...] | None, str]] = {}
        self.atomics: list[tuple[str, ast.Call]] = []  # (array, call) of atomic_add
        self.shared_lines: dict[str, int] = {}    # shared array local -> defining line
        self.locals: set[str] = set()             # assigned names that are not params
        self.ndims: dict[str, tuple[int, int]] = {}  # buffer -> (ndim, first line)
        self.shape_refs: list[tuple[str, int, ast.AST]] = []
        self.shared_mem = 0                       # static shared bytes (shared_array)
        self.dynamic_shared = False               # declares dynamic_shared(...)
        self.uses_barrier = False
        self.uses_atomics = False
        self.uses_mma = False
        self.loop_depth = 0

    # -- helpers ---------------------------------------------------------------

    def fail(self, node: ast.AST, reason: str) -> None:
        raise LanguageError(reason, getattr(node, "lineno", self.fn.lineno) + self.offset,
                            self.name)

    def line(self, node: ast.AST) -> int:
        return node.lineno + self.offset

    def reject(self, node: ast.AST) -> None:
        reason = _CONSTRUCTS.get(type(node))
        self.fail(node, reason or f"`{type(node).__name__}` is not allowed in a kernel")

    @property
    def arrays(self) -> set[str]:
        return self.buffers | set(self.shared)

    # -- driver ------------------------------------------------------------------

    def run(self) -> KernelInfo:
        if not kernel_lang.KERNEL_NAME.fullmatch(self.name):
            self.fail(self.fn, f"kernel name `{self.name}` is not 1 to 63 ASCII letters, "
                               "digits and underscores")
        if _is_dunder(self.name):
            self.fail(self.fn, f"dunder name `{self.name}` is not allowed as a kernel name")
        if self.fn.decorator_list:
            self.fail(self.fn.decorator_list[0], "decorators are not part of a kernel "
                      "(the runtime strips those of a function object)")
        body = strip_docstring(self.fn.body)
        self._signature()
        self._prescan(body)
        self._stmts(body)
        self._check_shape_refs()
        self._check_atomics()
        self._check_collectives(body)
        return KernelInfo(
            self.name, self.params,
            {p: self.ndims.get(p, (1, 0))[0] for p in self.params if p in self.buffers},
            self.shared_decls, self.locals, self.shared_mem,
            self.uses_barrier, self.uses_atomics, self.uses_mma, self.dynamic_shared)

    def _signature(self) -> None:
        a = self.fn.args
        if a.posonlyargs or a.kwonlyargs or a.vararg or a.kwarg:
            self.fail(self.fn, "kernel parameters must be plain positional names "
                               "(no *args, **kwargs, keyword-only or positional-only)")
        if a.defaults:
            self.fail(a.defaults[0], "kernel parameters cannot have default values")
        r = self.fn.returns
        if r is not None and not (isinstance(r, ast.Constant) and r.value is None):
            self.fail(r, "a kernel returns nothing: its return annotation can only be None")
        for arg in a.args:
            if _is_dunder(arg.arg):
                self.fail(arg, f"dunder name `{arg.arg}` is not allowed")
            if arg.arg in _RESERVED:
                self.fail(arg, f"parameter `{arg.arg}` shadows a kernel built-in")
            if arg.arg in self.params:
                self.fail(arg, f"duplicate parameter `{arg.arg}`")
            self.params[arg.arg] = self._annotation(arg)

    def _annotation(self, arg: ast.arg) -> str | None:
        ann = arg.annotation
        if ann is None:
            return None
        if not (isinstance(ann, ast.Constant) and isinstance(ann.value, str)):
            self.fail(ann, f"the annotation of `{arg.arg}` must be a dtype name string "
                           "such as \"float32\"")
        dtype = normalize_dtype(ann.value)
        if dtype is None:
            self.fail(ann, f"unknown dtype \"{ann.value}\" in the annotation of `{arg.arg}` "
                           f"(known: {', '.join(DTYPES)})")
        return dtype

    def _prescan(self, body: list[ast.stmt]) -> None:
        """Classify names before the ordered pass, so a use can be judged by what the
        name is anywhere in the kernel (a parameter indexed anywhere is a buffer).

        An mma operand makes its parameter a buffer too, unless the kernel also uses that
        parameter as a plain scalar value: then the operand is the likelier mistake
        (``mma(c, a, n, ...)``), and mma's own check names it at the call rather than
        the scalar use being reported as a misused array somewhere else."""
        array_uses: set[int] = set()  # id() of the Name nodes in an array position
        operands: list[str] = []      # parameters named as mma operands
        names: list[ast.Name] = []
        for node in (n for s in body for n in ast.walk(s)):
            bases: list[ast.expr] = []
            if isinstance(node, (ast.Subscript, ast.Attribute)):
                bases = [node.value]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                if node.func.id == "atomic_add":
                    bases = node.args[:1]
                elif node.func.id == "mma":
                    for a in node.args[:_MMA_OPERANDS]:
                        if isinstance(a, ast.Name):
                            array_uses.add(id(a))
                            operands.append(a.id)
            elif isinstance(node, ast.Name):
                names.append(node)
            for base in bases:
                if isinstance(base, ast.Name):
                    array_uses.add(id(base))
                    if base.id in self.params:
                        self.buffers.add(base.id)
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets = node.targets
                decl = _shared_decl_name(node.value)
                if len(targets) == 1 and isinstance(targets[0], ast.Name) and decl:
                    # ndim 0: not known until the declaration is checked (dynamic: 1-D)
                    self.shared.setdefault(targets[0].id, int(decl == "dynamic_shared"))
            elif isinstance(node, ast.For):
                targets = [node.target]
            for t in targets:
                if isinstance(t, ast.Name) and t.id not in self.params:
                    self.locals.add(t.id)
        scalars = {n.id for n in names if id(n) not in array_uses}
        self.buffers.update(p for p in operands if p in self.params and p not in scalars)

    # -- statements ------------------------------------------------------------

    def _stmts(self, stmts: list[ast.stmt]) -> None:
        for s in stmts:
            method = getattr(self, "_stmt_" + type(s).__name__, None)
            if method is None:
                self.reject(s)
            method(s)

    def _stmt_Assign(self, s: ast.Assign) -> None:
        if len(s.targets) != 1:
            self.fail(s, "chained assignment (`a = b = ...`) is not allowed; "
                         "assign one target per statement")
        target = s.targets[0]
        value = s.value
        if not isinstance(target, (ast.Name, ast.Subscript)):
            self._store(target, is_shared=False)  # rejects it with its own reason
        decl = _shared_decl_name(value)
        is_shared = decl is not None
        if is_shared:
            if not isinstance(target, ast.Name):
                self._misplaced_shared_decl(s, decl)
            self._shared_decl(target, value, decl)
        else:
            self._expr(value)
        self._store(target, is_shared=is_shared)

    def _stmt_AugAssign(self, s: ast.AugAssign) -> None:
        if not isinstance(s.op, _AUG_OPS):
            sym = _OP_SYMBOLS.get(type(s.op), type(s.op).__name__)
            self.fail(s, f"augmented assignment `{sym}=` is not allowed; "
                         f"write `x = x {sym} y`")
        if isinstance(s.target, ast.Name):
            self._load_name(s.target)  # `x += 1` reads x: it must already be a scalar
        self._expr(s.value)
        self._store(s.target, is_shared=False)

    def _store(self, target: ast.expr, is_shared: bool) -> None:
        if isinstance(target, ast.Name):
            self._store_name(target, is_shared)
        elif isinstance(target, ast.Subscript):
            self._subscript(target)
        elif isinstance(target, (ast.Tuple, ast.List)):
            self.fail(target, "tuple unpacking is not allowed; assign one name per statement")
        elif isinstance(target, ast.Attribute):
            self._attribute_chain_names(target)
            self.fail(target, f"cannot assign to `{ast.unparse(target)}`: assignment to an "
                              "attribute is not allowed")
        else:
            self.reject(target)

    def _store_name(self, t: ast.Name, is_shared: bool) -> None:
        name = t.id
        if _is_dunder(name):
            self.fail(t, f"dunder name `{name}` is not allowed")
        if name in _RESERVED:
            self.fail(t, f"cannot assign to `{name}`: it is a kernel built-in")
        if name in self.buffers:
            self.fail(t, f"cannot rebind buffer parameter `{name}`")
        if name in self.params and not is_shared:  # a scalar is the launch's, one value
            self.fail(t, f"cannot assign to scalar parameter `{name}`; copy it to a local "
                         "first")
        if is_shared:
            if name in self.params:
                self.fail(t, f"parameter `{name}` cannot be bound to a shared array")
            if name in self.shared_lines:
                self.fail(t, f"shared array `{name}` is already defined at line "
                             f"{self.shared_lines[name]}")
            self.shared_lines[name] = self.line(t)
        elif name in self.shared:
            self.fail(t, f"cannot rebind shared array `{name}`")

    def _stmt_If(self, s: ast.If) -> None:
        self._expr(s.test)
        self._stmts(s.body)
        self._stmts(s.orelse)

    def _stmt_For(self, s: ast.For) -> None:
        if s.orelse:
            self.fail(s, "`for ... else` is not allowed in a kernel")
        if not isinstance(s.target, ast.Name):
            self.fail(s.target, "a for loop's variable must be a single name")
        it = s.iter
        if not (isinstance(it, ast.Call) and isinstance(it.func, ast.Name)
                and it.func.id == "range"):
            self.fail(it, "a kernel's for loop must iterate over range(...)")
        self._call_shape(it, "range")
        if not 1 <= len(it.args) <= 3:
            self.fail(it, f"range() takes 1 to 3 arguments, not {len(it.args)}")
        for arg in it.args:
            self._expr(arg)
        self._store_name(s.target, is_shared=False)
        self._loop_body(s.body)

    def _stmt_While(self, s: ast.While) -> None:
        if s.orelse:
            self.fail(s, "`while ... else` is not allowed in a kernel")
        self._expr(s.test)
        self._loop_body(s.body)

    def _loop_body(self, body: list[ast.stmt]) -> None:
        self.loop_depth += 1
        try:
            self._stmts(body)
        finally:
            self.loop_depth -= 1

    def _stmt_Break(self, s: ast.Break) -> None:
        if not self.loop_depth:
            self.fail(s, "`break` outside a loop")

    def _stmt_Continue(self, s: ast.Continue) -> None:
        if not self.loop_depth:
            self.fail(s, "`continue` outside a loop")

    def _stmt_Return(self, s: ast.Return) -> None:
        if s.value is not None:
            self.fail(s, "`return` with a value is not allowed: a kernel returns nothing "
                         "(write results to a buffer)")

    def _stmt_Pass(self, s: ast.Pass) -> None:
        pass

    def _stmt_Expr(self, s: ast.Expr) -> None:
        v = s.value
        if isinstance(v, ast.Call):
            name = self._call(v, statement=True)
            if name not in _STATEMENT_BUILTINS:
                self.fail(s, f"the result of {name}() is unused; only barrier(), "
                             "atomic_add(...) and mma(...) may stand alone as statements")
            return
        if isinstance(v, ast.Constant) and isinstance(v.value, str):
            self.fail(s, "string constants are only allowed as dtype names (a docstring "
                         "must be the first statement)")
        self._expr(v)
        self.fail(s, "an expression statement has no effect; only barrier(), "
                     "atomic_add(...) and mma(...) may stand alone as statements")

    # -- expressions -------------------------------------------------------------

    def _expr(self, e: ast.expr) -> None:
        method = getattr(self, "_expr_" + type(e).__name__, None)
        if method is None:
            self.reject(e)
        method(e)

    def _expr_Constant(self, e: ast.Constant) -> None:
        v = e.value
        if isinstance(v, bool) or isinstance(v, float):
            return
        if isinstance(v, int):
            if v >= kernel_lang.INT_LIMIT:  # a literal is never negative (-1 is USub)
                shown = v if v.bit_length() <= 128 else f"of {v.bit_length()} bits"
                self.fail(e, f"integer constant {shown} does not fit in 64 bits")
            return
        if isinstance(v, str):
            self.fail(e, "string constants are only allowed as dtype names "
                         "(the dtype of shared_array or dynamic_shared)")
        self.fail(e, f"the constant {v!r} is not allowed in a kernel "
                     "(only int, float and bool constants)")

    def _expr_Name(self, e: ast.Name) -> None:
        self._load_name(e)

    def _load_name(self, e: ast.Name) -> None:
        name = e.id
        if _is_dunder(name):
            self.fail(e, f"dunder name `{name}` is not allowed")
        if name in _RESERVED:
            self.fail(e, f"built-in `{name}` can only be called")
        if name in self.arrays:
            self.fail(e, f"array `{name}` can only be indexed (`{name}[i]`), passed to "
                         "atomic_add or mma, or used through .shape[k]/.size")
        if name not in self.params and name not in self.locals:
            self._free_name(e)

    def _free_name(self, e: ast.Name) -> None:
        self.fail(e, f"free name `{e.id}`: a kernel can only use its parameters, its locals "
                     "and the kernel built-ins (no globals, closures or host objects)")

    def _expr_BinOp(self, e: ast.BinOp) -> None:
        if not isinstance(e.op, _BIN_OPS):
            sym = _OP_SYMBOLS.get(type(e.op), type(e.op).__name__)
            self.fail(e, f"the operator `{sym}` is not allowed in a kernel")
        self._expr(e.left)
        self._expr(e.right)

    def _expr_UnaryOp(self, e: ast.UnaryOp) -> None:
        if not isinstance(e.op, _UNARY_OPS):  # pragma: no cover - Python has no others
            self.fail(e, f"the operator {type(e.op).__name__} is not allowed in a kernel")
        self._expr(e.operand)

    def _expr_BoolOp(self, e: ast.BoolOp) -> None:
        for v in e.values:
            self._expr(v)

    def _expr_Compare(self, e: ast.Compare) -> None:
        for op in e.ops:
            if not isinstance(op, _CMP_OPS):
                sym = _OP_SYMBOLS.get(type(op), type(op).__name__)
                self.fail(e, f"the comparison `{sym}` is not allowed in a kernel "
                             "(use == != < <= > >=)")
        self._expr(e.left)
        for c in e.comparators:
            self._expr(c)

    def _expr_IfExp(self, e: ast.IfExp) -> None:
        self._expr(e.test)
        self._expr(e.body)
        self._expr(e.orelse)

    def _expr_Subscript(self, e: ast.Subscript) -> None:
        self._subscript(e)

    def _expr_Attribute(self, e: ast.Attribute) -> None:
        param = self._attribute(e)
        if e.attr == "shape":
            self.fail(e, f"`{param}.shape` is not a value; use `{param}.shape[k]` "
                         "with a constant k")

    def _expr_Call(self, e: ast.Call) -> None:
        self._call(e, statement=False)

    # -- indexing and attributes ----------------------------------------------------

    def _subscript(self, e: ast.Subscript) -> None:
        """``buf[i]``, ``buf[i, j]`` (load or store) and ``param.shape[k]`` (load)."""
        base = e.value
        if isinstance(base, ast.Attribute) and base.attr == "shape":
            param = self._attribute(base)
            if not isinstance(e.ctx, ast.Load):
                self.fail(e, f"cannot assign to `{param}.shape`")
            k = e.slice
            if not _is_const_int(k) or k.value < 0:
                self.fail(e, f"`{param}.shape[k]` needs a constant non-negative int k")
            self.shape_refs.append((param, k.value, e))
            return
        if isinstance(base, ast.Attribute):
            self._attribute(base)
            self.fail(e, f"`{ast.unparse(base)}` cannot be indexed")
        if not isinstance(base, ast.Name):
            self._expr(base)  # a call, a constant...: its own reason first, if any
            self.fail(e, "only buffer parameters and shared arrays can be indexed")
        if base.id not in self.arrays:
            if base.id in self.params or base.id in self.locals:
                self.fail(e, f"`{base.id}` is a scalar, not an array: it cannot be indexed")
            self._load_name(base)  # builtins, dunders, free names: their own reasons
        self._record_ndim(base.id, self._index(e.slice), e)

    def _index(self, idx: ast.expr) -> int:
        """Validate an index (one expression or a tuple of them); return its length."""
        if isinstance(idx, ast.Tuple):
            if not idx.elts:
                self.fail(idx, "an empty index `[()]` is not allowed")
            for elt in idx.elts:
                self._expr(elt)
            return len(idx.elts)
        self._expr(idx)
        return 1

    def _record_ndim(self, name: str, ndim: int, node: ast.AST) -> None:
        if ndim > kernel_lang.MAX_NDIM:
            self.fail(node, f"`{name}` is indexed with {ndim} indices; an array has at most "
                            f"{kernel_lang.MAX_NDIM} dimensions")
        if name in self.shared:
            want = self.shared[name]
            if want and ndim != want:
                self.fail(node, f"shared array `{name}` has {want} dimension(s) but is "
                                f"indexed with {ndim}")
            return
        seen = self.ndims.get(name)
        if seen is None:
            self.ndims[name] = (ndim, self.line(node))
        elif seen[0] != ndim:
            self.fail(node, f"inconsistent ndim for buffer `{name}`: indexed with {ndim} "
                            f"index(es) here but with {seen[0]} at line {seen[1]}")

    def _attribute_chain_names(self, e: ast.Attribute) -> list[ast.Attribute]:
        """The attributes of ``a.b.c`` innermost first, after rejecting dunders anywhere."""
        chain: list[ast.Attribute] = []
        node: ast.expr = e
        while isinstance(node, ast.Attribute):
            chain.append(node)
            node = node.value
        chain.reverse()
        for a in chain:
            if _is_dunder(a.attr):
                self.fail(a, f"dunder name `{a.attr}` is not allowed "
                             f"(`{ast.unparse(a)}`)")
        return chain

    def _attribute(self, e: ast.Attribute) -> str:
        """Accept ``param.shape`` / ``param.size`` only; return the parameter's name."""
        chain = self._attribute_chain_names(e)
        inner = chain[0]
        base = inner.value
        if (isinstance(base, ast.Name) and base.id not in self.params
                and base.id not in self.locals and base.id not in _RESERVED
                and not _is_dunder(base.id)):
            self._free_name(base)  # `np.pi`, `os.sep`: a host object, say so
        if inner.attr not in ("shape", "size"):
            self.fail(inner, f"attribute `.{inner.attr}` is not allowed "
                             f"(`{ast.unparse(inner)}`): only `.shape[k]` and `.size` of a "
                             "buffer parameter")
        if not isinstance(base, ast.Name):
            self.fail(inner, f"`.{inner.attr}` is only allowed on a buffer parameter")
        if base.id not in self.params:
            self.fail(inner, f"`.{inner.attr}` is only allowed on a buffer parameter, "
                             f"not on `{base.id}`")
        if len(chain) > 1:
            outer = chain[1]
            self.fail(outer, f"attribute `.{outer.attr}` is not allowed "
                             f"(`{ast.unparse(outer)}`): only `.shape[k]` and `.size` of a "
                             "buffer parameter")
        if not isinstance(e.ctx, ast.Load):
            self.fail(e, f"cannot assign to `{ast.unparse(e)}`")
        return base.id

    def _check_shape_refs(self) -> None:
        for param, k, node in self.shape_refs:
            ndim = self.ndims.get(param, (1, 0))[0]
            if k >= ndim:
                self.fail(node, f"`{param}.shape[{k}]` is out of range: `{param}` is a "
                                f"{ndim}-d buffer (its ndim comes from how it is indexed)")

    # -- calls -------------------------------------------------------------------

    def _call_shape(self, c: ast.Call, name: str) -> None:
        """Reject keyword and starred arguments, whatever the callee."""
        if c.keywords:
            kw = c.keywords[0]
            what = f"`{kw.arg}=`" if kw.arg else "`**` unpacking"
            self.fail(c, f"keyword arguments are not allowed ({what} in {name}())")
        for a in c.args:
            if isinstance(a, ast.Starred):
                self.fail(a, f"starred arguments (`*args`) are not allowed (in {name}())")

    def _callee(self, c: ast.Call) -> str:
        """The built-in a call names; everything else is rejected with its own reason."""
        f = c.func
        if isinstance(f, ast.Attribute):
            self._attribute_chain_names(f)
            self.fail(c, f"calling `{ast.unparse(f)}` is not allowed: only kernel "
                         "built-ins can be called")
        if not isinstance(f, ast.Name):
            self.fail(c, "only kernel built-ins can be called")
        name = f.id
        if _is_dunder(name):
            self.fail(c, f"dunder name `{name}` is not allowed")
        if name in _FORBIDDEN_CALLS:
            self.fail(c, f"`{name}` is not allowed in a kernel")
        if name == "range":
            self.fail(c, "range() is only allowed as the iterable of a for loop")
        if name not in BUILTINS:
            if name in self.params or name in self.locals:
                self.fail(c, f"`{name}` is not callable: only kernel built-ins can be called")
            self.fail(c, f"call of `{name}`: not a kernel built-in (a kernel can call only "
                         f"{', '.join(sorted(BUILTINS))})")
        return name

    def _nargs(self, c: ast.Call, name: str, lo: int, hi: int | None = None) -> None:
        n = len(c.args)
        hi = lo if hi is None else hi
        if n < lo or (hi >= 0 and n > hi):
            want = (f"{lo}" if lo == hi else f"at least {lo}" if hi < 0 else f"{lo} to {hi}")
            self.fail(c, f"{name}() takes {want} argument(s), not {n}")

    def _call(self, c: ast.Call, statement: bool) -> str:
        name = self._callee(c)
        self._call_shape(c, name)
        if name in _ID_BUILTINS:
            self._nargs(c, name, 1)
            d = c.args[0]
            if not _is_const_int(d) or not 0 <= d.value <= 2:
                self.fail(c, f"{name}(d) needs a constant dimension d in 0..2, "
                             f"not `{ast.unparse(d)}`")
        elif name == "barrier":
            self._nargs(c, name, 0)
            if not statement:
                self.fail(c, "barrier() returns nothing; call it as a statement")
            self.uses_barrier = True
        elif name == "atomic_add":
            self._atomic_add(c, statement)
        elif name == "mma":
            self._mma(c, statement)
        elif name in _SHARED_DECLS:
            self._misplaced_shared_decl(c, name)
        elif name in _VARIADIC_BUILTINS:
            self._nargs(c, name, 2, -1)
            for a in c.args:
                self._expr(a)
        else:
            self._nargs(c, name, 1)
            self._expr(c.args[0])
        return name

    def _atomic_add(self, c: ast.Call, statement: bool) -> None:
        self._nargs(c, "atomic_add", 3)
        if not statement:
            self.fail(c, "atomic_add() returns nothing; call it as a statement")
        arr, index, value = c.args
        if not isinstance(arr, ast.Name):
            self.fail(c, "the first argument of atomic_add must be a buffer parameter "
                         "or a shared array")
        if arr.id not in self.arrays:
            if arr.id not in self.locals:
                self._load_name(arr)
            self.fail(c, f"the first argument of atomic_add must be a buffer parameter or a "
                         f"shared array, not `{arr.id}`")
        self._record_ndim(arr.id, self._index(index), c)
        self._expr(value)
        self.atomics.append((arr.id, c))
        self.uses_atomics = True

    def _check_atomics(self) -> None:
        """No atomic_add on a bool array (there is no atomic add of bools): known here
        for an annotated buffer or a shared array, after the whole body (an atomic_add may
        precede the declaration it names, in a loop); the firmware checks a buffer whose
        dtype the launch sets when it binds the launch's arguments."""
        for name, c in self.atomics:
            dtype = self.shared_decls[name][1] if name in self.shared_decls \
                else self.params.get(name)
            if dtype == "bool":
                self.fail(c, f"atomic_add on `{name}`, a bool array: there is no atomic add "
                             "of bools")

    def _mma(self, c: ast.Call, statement: bool) -> None:
        """mma(c, a, b, row, col, k0, tm, tn, tk, beta[, ta[, tb]]): the operands must be 2-D float
        buffer parameters of one dtype (the matrix unit reads and writes global memory
        only, in float32 or float64). The scalar arguments are checked here as
        expressions; that they are uniform across the block needs the whole body's taint
        analysis, so :meth:`_check_collectives` does it."""
        self._nargs(c, "mma", _MMA_NARGS, kernel_lang.MMA_MAX_NARGS)
        if not statement:
            self.fail(c, "mma() returns nothing; call it as a statement")
        operands = c.args[:_MMA_OPERANDS]
        for arg in operands:
            if not (isinstance(arg, ast.Name) and arg.id in self.buffers):
                if (isinstance(arg, ast.Name) and arg.id not in self.arrays
                        and arg.id not in self.locals):
                    self._load_name(arg)  # free names, built-ins, dunders: their reasons
                self.fail(c, "the first three arguments of mma must be buffer parameters, "
                             f"not `{ast.unparse(arg)}`")
        names = [arg.id for arg in operands if isinstance(arg, ast.Name)]
        dtypes: set[str] = set()
        for name in names:
            dtype = self.params[name]
            if dtype is not None and dtype not in _MMA_DTYPES:
                self.fail(c, f"mma() operands must be float32 or float64 buffers, "
                             f"`{name}` is {dtype}")
            if dtype is not None:
                dtypes.add(dtype)
        if len(dtypes) > 1:
            self.fail(c, "mma() operands must share one dtype")
        for name in names:
            self._record_ndim(name, 2, c)
        for arg in c.args[_MMA_OPERANDS:]:
            self._expr(arg)
        self.uses_mma = True

    def _misplaced_shared_decl(self, node: ast.AST, name: str) -> None:
        self.fail(node, f"{name}(...) is only allowed as the right side of a plain "
                        f"`name = {name}(...)`")

    def _shared_decl(self, target: ast.Name, c: ast.Call, name: str) -> None:
        """``target = shared_array(shape, dtype)`` or ``target = dynamic_shared(dtype)``
        (see _SHARED_DECLS): bind ``target`` to a block-shared array. A static one adds
        its bytes to ``shared_mem``; a dynamic one is 1-D, adds nothing (the launch
        sizes it) and may alias other dynamic_shared declarations."""
        self._call_shape(c, name)
        self._nargs(c, name, _SHARED_DECLS[name])
        dims: list[ast.expr] | None = None
        if name == "shared_array":
            shape = c.args[0]
            dims = shape.elts if isinstance(shape, ast.Tuple) else [shape]
            if not dims or not all(_is_const_int(d) and d.value > 0 for d in dims):
                self.fail(c, "the shape of shared_array must be a positive constant int or "
                             f"a tuple of them, not `{ast.unparse(shape)}`")
            if len(dims) > kernel_lang.MAX_NDIM:
                self.fail(c, f"shared_array has {len(dims)} dimensions; an array has at most "
                             f"{kernel_lang.MAX_NDIM}")
        dtype = c.args[-1]
        if not (isinstance(dtype, ast.Constant) and isinstance(dtype.value, str)):
            self.fail(c, f"the dtype of {name} must be a dtype name string such as "
                         f"\"float32\", not `{ast.unparse(dtype)}`")
        canonical = normalize_dtype(dtype.value)
        if canonical is None:
            self.fail(c, f"unknown dtype \"{dtype.value}\" in {name} "
                         f"(known: {', '.join(DTYPES)})")
        if dims is None:
            self.dynamic_shared = True
            self.shared[target.id] = 1
            self.shared_decls[target.id] = (None, canonical)
            return
        count = 1
        for d in dims:
            count *= d.value
        self.shared_mem += count * DTYPES[canonical][1]
        if self.shared_mem > kernel_lang.SHARED_LIMIT:
            self.fail(c, f"the kernel's shared arrays take {self.shared_mem} bytes with this "
                         f"one, more than the {kernel_lang.SHARED_LIMIT} a kernel may declare")
        self.shared[target.id] = len(dims)
        self.shared_decls[target.id] = (tuple(d.value for d in dims), canonical)

    # -- block-collective uniformity ---------------------------------------------------

    def _varying(self, e: ast.AST | None, tainted: set[str]) -> str | None:
        """Why ``e`` may differ between the threads of a block, or None if uniform.

        Uniform inputs are constants, scalar parameters, ``.shape``/``.size``,
        local_size, num_groups, group_id and locals computed from those only."""
        if e is None:
            return None
        arrays = self.arrays
        for n in ast.walk(e):
            if (isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                    and n.func.id in _THREAD_IDS):
                return f"uses {n.func.id}()"
            if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name) \
                    and n.value.id in arrays:
                return f"reads `{n.value.id}[...]` (a loaded value)"
            if isinstance(n, ast.Name) and n.id in tainted:
                return f"uses `{n.id}`, which depends on the thread"
        return None

    def _loop_exit(self, loop: ast.For | ast.While, tainted: set[str]) -> str | None:
        """Why the loop may run a different number of iterations in different threads
        (a break/continue of this loop under thread-dependent control), or None."""
        def scan(stmts: list[ast.stmt], why: str | None) -> str | None:
            for s in stmts:
                if isinstance(s, (ast.Break, ast.Continue)) and why:
                    kw = "break" if isinstance(s, ast.Break) else "continue"
                    return f"has a `{kw}` at line {self.line(s)} that {why}"
                if isinstance(s, ast.If):
                    r = self._varying(s.test, tainted)
                    sub = why or (f"depends on the thread (the `if` at line {self.line(s)} "
                                  f"{r})" if r else None)
                    found = scan(s.body, sub) or scan(s.orelse, sub)
                    if found:
                        return found
            return None  # breaks in nested loops belong to those loops
        return scan(loop.body, None)

    def _control_reason(self, s: ast.stmt, tainted: set[str]) -> str | None:
        """Why the compound statement ``s`` steers threads differently, or None."""
        kind = {ast.If: "if", ast.While: "while", ast.For: "for"}[type(s)]
        if isinstance(s, ast.For):
            why = next((w for a in s.iter.args if (w := self._varying(a, tainted))), None)
        else:
            why = self._varying(s.test, tainted)
        if why is None and not isinstance(s, ast.If):
            why = self._loop_exit(s, tainted)
        return f"the `{kind}` at line {self.line(s)} {why}" if why else None

    def _taint(self, body: list[ast.stmt]) -> set[str]:
        """Names whose value may differ between threads: assigned from thread ids, loaded
        values or other such names, or assigned under thread-dependent control flow.
        Flow-insensitive and iterated to a fixpoint (loops carry taint backwards)."""
        tainted: set[str] = set()

        def walk(stmts: list[ast.stmt], ctx: bool) -> None:
            for s in stmts:
                if isinstance(s, (ast.Assign, ast.AugAssign)):
                    targets = s.targets if isinstance(s, ast.Assign) else [s.target]
                    if ctx or self._varying(s.value, tainted):
                        tainted.update(t.id for t in targets if isinstance(t, ast.Name))
                elif isinstance(s, (ast.If, ast.While, ast.For)):
                    inner = ctx or self._control_reason(s, tainted) is not None
                    if isinstance(s, ast.For) and inner:
                        tainted.add(s.target.id)
                    walk(s.body, inner)
                    walk(s.orelse, inner)

        while True:
            before = len(tainted)
            walk(body, False)
            if len(tainted) == before:
                return tainted

    def _check_collectives(self, body: list[ast.stmt]) -> None:
        """The barrier rule, for every block-collective built-in (barrier() and mma()):
        every thread of a block reaches each of them equally often, with the same
        arguments.

        A collective under thread-dependent control flow is rejected, and so is one that
        can run after a thread-dependent ``return`` (earlier in the body, or in a loop
        that also holds it): the returned threads would never arrive. mma's scalar
        arguments must be uniform too: the block issues one matrix operation."""
        if not (self.uses_barrier or self.uses_mma):
            return
        tainted = self._taint(body)
        collectives: list[tuple[int, ast.stmt, tuple[int, ...], str]] = []
        returns: list[tuple[int, ast.stmt, tuple[int, ...]]] = []

        def walk(stmts: list[ast.stmt], ctx: str | None, loops: tuple[int, ...]) -> None:
            for s in stmts:
                if (isinstance(s, ast.Expr) and isinstance(s.value, ast.Call)
                        and isinstance(s.value.func, ast.Name)
                        and s.value.func.id in _COLLECTIVES):
                    name = s.value.func.id
                    if ctx:
                        self.fail(s, f"{name}() under control flow that depends on the "
                                     f"thread: {ctx}")
                    if name == "mma":
                        self._check_mma_uniform(s.value, tainted)
                    collectives.append((len(collectives) + len(returns), s, loops, name))
                elif isinstance(s, ast.Return) and ctx:
                    returns.append((len(collectives) + len(returns), s, loops))
                elif isinstance(s, (ast.If, ast.While, ast.For)):
                    if isinstance(s, ast.For):
                        self._check_block_loop_variable(s)
                    inner = ctx or self._control_reason(s, tainted)
                    inner_loops = loops if isinstance(s, ast.If) else loops + (id(s),)
                    walk(s.body, inner, inner_loops)
                    walk(s.orelse, inner, inner_loops)

        walk(body, None, ())
        for c_order, c, c_loops, name in collectives:
            for r_order, r, r_loops in returns:
                if r_order < c_order or set(c_loops) & set(r_loops):
                    self.fail(c, f"{name}() can run after the `return` at line "
                                 f"{self.line(r)}, which depends on the thread: the "
                                 "threads that returned would never reach it")

    def _check_block_loop_variable(self, loop: ast.For) -> None:
        """The variable of a ``for`` loop that holds a collective is not assigned in it:
        such a loop runs once for the whole block (the firmware's lowering keeps one
        variable for it, not one per thread), so every thread must see the same value."""
        collective = next((n for n in ast.walk(loop) if isinstance(n, ast.Call)
                           and isinstance(n.func, ast.Name) and n.func.id in _COLLECTIVES),
                          None)
        if collective is None:
            return
        var = loop.target.id  # type: ignore[attr-defined]  # a name: checked before
        for n in ast.walk(loop):
            if (isinstance(n, ast.Name) and n.id == var and isinstance(n.ctx, ast.Store)
                    and n is not loop.target):
                self.fail(n, f"`{var}`, the variable of the loop at line {self.line(loop)} "
                             f"that holds {collective.func.id}(), is assigned in the loop: "
                             "every thread of the block must see the same value")

    def _check_mma_uniform(self, c: ast.Call, tainted: set[str]) -> None:
        """mma's scalar arguments (tile origin, sizes, beta) must be the same in every
        thread of the block: the matrix unit runs one operation for the whole block, so
        a per-thread value has no meaning there."""
        for i, arg in enumerate(c.args[_MMA_OPERANDS:], start=_MMA_OPERANDS):
            why = self._varying(arg, tainted)
            if why:
                self.fail(c, f"mma() argument {i + 1} (`{ast.unparse(arg)}`) differs "
                             f"between the threads of a block: {why}")
