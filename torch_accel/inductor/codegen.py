"""Inductor's code generator for accel: fused kernels in the device's kernel language.

Inductor lowers a graph to loops over buffers, fuses them (its scheduler) and asks a
device's *scheduling* to write each fused group as one kernel. This one is a
``SIMDScheduling`` (the family of Triton's and Metal's) whose kernel writes our kernel
language (docs/kernels.md): one thread per element of the pointwise range ``x``; a
reduction is a loop over its range ``r0_`` inside that thread (one thread per output row),
so pointwise work before and after it fuses into the same kernel; a sum over a short
static range is instead a block per output row, a thread per element (no loop: the
firmware runs such a kernel inline, ``should_use_persistent_reduction``). A foreach (an
optimizer's update of every parameter) is *horizontal* kernels: thread ``i`` runs the
subkernel whose range holds ``i``, as many subkernels a kernel as the firmware still runs
inline (``AccelScheduling.codegen_combo_kernel``). Index
expressions are Inductor's sympy indexing printed as Python integer arithmetic (``//``,
``%``, ``min``), every buffer is passed flat from its first element, and the firmware
bounds-checks every access (an index past a buffer is a device fault, as in eager). The
wrapper Inductor writes is its Python wrapper; each kernel there is a
``torch_accel.inductor.launcher.Generated``.

Why not OpenReg's way (Inductor's C++ scheduling on host memory): the kernels would run on
the host, outside the device's launch, memory, fault and profiler paths.

Arithmetic follows the eager kernels' rule (torch_accel/kernels/elementwise.py): float32
loads are computed in float64 where a constant or a cast meets them and rounded once at the
store, so a fused chain rounds once where eager rounds per op (results agree to float32's
precision, not bit for bit).
"""

from __future__ import annotations

import ast
import math
from typing import Any

import sympy
import torch
from torch._inductor import config
from torch._inductor.codegen.common import (
    BackendFeature,
    CSEVariable,
    DeferredLine,
    DeviceOpOverrides,
    IndentedBuffer,
    OpOverrides,
)
from torch._inductor.codegen.simd import IterationRangesEntry, SIMDKernel, SIMDScheduling
from torch._inductor.codegen.simd_kernel_features import SIMDKernelFeatures
from torch._inductor.codegen.wrapper import PythonWrapperCodegen, pexpr
from torch._inductor.utils import get_bounds_index_expr, get_fused_kernel_name, get_kernel_metadata
from torch._inductor.virtualized import V, ops
from torch.utils._ordered_set import OrderedSet
from torch.utils._sympy.printers import PythonPrinter

from torch_accel.inductor import halfbits
from torch_accel.inductor.launcher import BLOCK

DEVICE_TYPE = "accel"
#: the kernel language's longest name (abi/kernel_lang.py)
NAME_MAX = 63
#: the longest reduced range summed by a block (one thread per element) rather than a loop
BLOCK_REDUCTION_MAX = 256
#: What the firmware runs inline on its scheduler rather than hand to an engine (~0.2-1 ms
#: a hand-off on two CPUs, far more for a large launch): a loop-free kernel of at most
#: ``INLINE_NODES`` syntax-tree nodes (``firmware/kernel_check.py``, ``bounded_work``)
#: whose threads times nodes is at most ``INLINE_WORK`` and whose threads are at most
#: ``INLINE_THREADS`` (``firmware/launches.py``; docs/launch.md). A horizontal kernel
#: (``AccelScheduling._codegen_horizontal``) counts every branch's nodes for every thread,
#: so its subkernels are grouped to stay within these.
INLINE_NODES = 256
INLINE_WORK = 1 << 25
INLINE_THREADS = 1 << 20
#: float64 magnitude at and above which every double is an integer (floor is the value)
_BIG = "4503599627370496.0"
_INF = "(1e308 * 10.0)"


def _constant(value: bool | float | int, dtype: torch.dtype) -> str:
    """``value`` as a constant of the language (no string constants: inf and NaN are
    computed)."""
    if dtype == torch.bool:
        return "True" if value else "False"
    if dtype.is_floating_point:
        v = float(value)
        if math.isnan(v):
            return f"({_INF} - {_INF})"
        if math.isinf(v):
            return _INF if v > 0 else f"(-{_INF})"
        return repr(v)
    return str(int(value)) if int(value) >= 0 else f"({int(value) + 1} - 1)"


def _float_floor(x: str) -> str:
    """floor of a float that stays a float (the language's ``floor`` returns an int64;
    NaN, inf and huge values are their own floor)."""
    return f"(float(floor({x})) if abs({x}) < {_BIG} else {x})"


class AccelOverrides(OpOverrides):
    """Inductor's ops as expressions of the kernel language (Python syntax; the built-ins
    ``sqrt exp log sin cos tanh abs min max floor float int``). What is not here and has
    no decomposition in ``OpOverrides`` raises at code generation (docs/torch.md says
    which ops lower)."""

    @staticmethod
    def constant(value: bool | float | int, dtype: torch.dtype) -> str:
        return _constant(value, dtype)

    @staticmethod
    def to_dtype(x: Any, dtype: torch.dtype, src_dtype: torch.dtype | None = None,
                 use_compute_types: bool = True) -> str:
        if dtype == torch.bool:
            return f"({x} != 0)"
        if (src_dtype or getattr(x, "dtype", None)) == torch.bool:
            # the language converts no bool with float() or int() (the JIT rejects the
            # kernel): a select instead
            return f"(1.0 if {x} else 0.0)" if dtype.is_floating_point else f"(1 if {x} else 0)"
        if dtype.is_floating_point:
            return f"float({x})"
        if dtype in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
            return f"int({x})"
        raise NotImplementedError(f"accel: to_dtype {dtype}")

    @staticmethod
    def index_expr(expr: sympy.Expr, dtype: torch.dtype) -> Any:
        idx = V.kernel.index_to_str(V.kernel.prepare_indexing(expr))
        var = V.kernel.cse.generate(V.kernel.compute, idx, bounds=get_bounds_index_expr(expr),
                                    dtype=torch.int64)
        return ops.to_dtype(var, dtype) if dtype != torch.int64 else var

    @staticmethod
    def value_expr(expr: sympy.Expr, dtype: torch.dtype) -> Any:
        """A symbolic value (a size, a constant from the shape) as ``index_expr``."""
        return AccelOverrides.index_expr(expr, dtype)

    @staticmethod
    def masked(mask: CSEVariable, body: Any, other: Any) -> Any:
        """``body()`` where ``mask`` holds, else ``other``: its loads run only under the
        mask (a masked-off index may lie outside the buffer)."""
        scoped = IndentedBuffer()
        with V.kernel.swap_buffers(scoped):
            result = body()
        var = V.kernel.cse.newvar(dtype=result.dtype)
        if isinstance(other, (bool, int, float)):
            other = _constant(other, result.dtype or torch.float64)
        compute = V.kernel.compute
        compute.writeline(f"if {mask}:")
        with compute.indent():
            compute.splice(scoped)
            compute.writeline(f"{var} = {result}")
        compute.writeline("else:")
        with compute.indent():
            compute.writeline(f"{var} = {other}")
        return var

    @staticmethod
    def where(a: Any, b: Any, c: Any) -> str:
        return f"({b} if {a} else {c})"

    @staticmethod
    def maximum(a: Any, b: Any) -> str:  # NaN propagating, as torch.maximum
        return f"({a} if {a} > {b} or {a} != {a} else {b})"

    @staticmethod
    def minimum(a: Any, b: Any) -> str:
        return f"({a} if {a} < {b} or {a} != {a} else {b})"

    @staticmethod
    def abs(x: Any) -> str:
        return f"abs({x})"

    @staticmethod
    def exp(x: Any) -> str:
        return f"exp({x})"

    @staticmethod
    def log(x: Any) -> str:
        return f"log({x})"

    @staticmethod
    def sqrt(x: Any) -> str:
        return f"sqrt({x})"

    @staticmethod
    def rsqrt(x: Any) -> str:
        return f"(1.0 / sqrt({x}))"

    @staticmethod
    def sin(x: Any) -> str:
        return f"sin({x})"

    @staticmethod
    def cos(x: Any) -> str:
        return f"cos({x})"

    @staticmethod
    def tan(x: Any) -> str:
        return f"(sin({x}) / cos({x}))"

    @staticmethod
    def tanh(x: Any) -> str:
        return f"tanh({x})"

    @staticmethod
    def floor(x: Any) -> str:
        return _float_floor(str(x))

    @staticmethod
    def ceil(x: Any) -> str:
        return f"(-{_float_floor(f'(-{x})')})"

    @staticmethod
    def trunc(x: Any) -> str:
        return f"({_float_floor(str(x))} if {x} >= 0 else -{_float_floor(f'(-{x})')})"

    @staticmethod
    def round(x: Any) -> str:
        """Half to even, as torch.round."""
        f = V.kernel.cse.generate(V.kernel.compute, _float_floor(str(x)), dtype=torch.float64)
        return f"({f} + 1.0 if {x} - {f} > 0.5 or ({x} - {f} == 0.5 and " \
               f"{f} - 2.0 * float(floor({f} * 0.5)) != 0.0) else {f})"

    @staticmethod
    def neg(x: Any) -> str:
        return f"(-{x})"

    @staticmethod
    def sign(x: Any) -> str:
        """torch.sign: 0 keeps its zero, NaN stays NaN (``x * 0``), else +-1."""
        return f"({x} * 0 if {x} == 0 or {x} != {x} else (1 if {x} > 0 else -1))"

    @staticmethod
    def copysign(a: Any, b: Any) -> str:
        return f"(-abs({a}) if {AccelOverrides.signbit(b)} else abs({a}))"

    @staticmethod
    def signbit(x: Any) -> str:
        return f"({x} < 0 or ({x} == 0 and 1.0 / {x} < 0))"

    @staticmethod
    def isnan(x: Any) -> str:
        return f"({x} != {x})"

    @staticmethod
    def isinf(x: Any) -> str:
        return f"abs({x}) > 1.7976931348623157e308"

    @staticmethod
    def logical_and(a: Any, b: Any) -> str:
        return f"({a} and {b})"

    @staticmethod
    def logical_or(a: Any, b: Any) -> str:
        return f"({a} or {b})"

    @staticmethod
    def logical_xor(a: Any, b: Any) -> str:
        return f"(({a} != 0) != ({b} != 0))"

    @staticmethod
    def logical_not(a: Any) -> str:
        return f"(not {a})"

    @staticmethod
    def truediv(a: Any, b: Any) -> str:
        return f"({a} / {b})"

    @staticmethod
    def floordiv(a: Any, b: Any) -> str:  # integers: Python's floor division is torch's
        return f"({a} // {b})"

    @staticmethod
    def truncdiv(a: Any, b: Any) -> str:
        return f"({a} // {b} if ({a} < 0) == ({b} < 0) or {a} % {b} == 0 else {a} // {b} + 1)"

    @staticmethod
    def remainder(a: Any, b: Any) -> str:  # Python's % takes the divisor's sign: torch's
        return f"({a} % {b})"

    @staticmethod
    def mod(a: Any, b: Any) -> str:
        """C's remainder (the dividend's sign), which Inductor's ``mod`` means."""
        return f"({a} % {b} - ({b} if {a} % {b} != 0 and ({a} < 0) != ({b} < 0) else 0))"

    @staticmethod
    def fmod(a: Any, b: Any) -> str:
        return AccelOverrides.mod(a, b)

    @staticmethod
    def pow(a: Any, b: Any) -> str:
        return f"({a} ** {b})"


#: a reduction's start value per type, by whether it is a float
_INIT = {"sum": ("0.0", "0"), "prod": ("1.0", "1"), "any": ("False", "False"),
         "xor_sum": (None, "0")}


def _iinfo(dtype: torch.dtype) -> tuple[int, int]:
    """The least and greatest values of an integer (or bool) dtype: max/min's start."""
    if dtype == torch.bool:
        return 0, 1
    info = torch.iinfo(dtype)
    return info.min, info.max


class AccelKernel(SIMDKernel):
    """One fused kernel: a function of the kernel language, one thread per ``x`` index,
    looping over the reduction range ``r0_`` (``for r0_index in range(r0_numel)``) where
    there is one; or, for a short sum, one block per ``x`` index and one thread per
    ``r0_`` index (a block reduction)."""

    overrides = AccelOverrides  # type: ignore[assignment]
    kexpr = PythonPrinter().doprint
    #: the reductions ``_reduction`` writes a loop for (fallbacks.py sends the others to
    #: the eager operators)
    REDUCTIONS = frozenset({"sum", "prod", "any", "xor_sum", "max", "min", "argmax", "argmin",
                            "welford_reduce", "welford_combine"})
    sexpr = kexpr

    def __init__(self, tiling: dict[str, sympy.Expr], **kwargs: Any) -> None:
        super().__init__(tiling, **kwargs)
        #: the reduction results, defined before their loop: they outlive it
        self.outside_loop_vars: set[Any] = set()
        self.suffix = IndentedBuffer()

    def dtype_to_str(self, dtype: torch.dtype) -> str:
        """The language's dtype name (Inductor names the index dtype through it)."""
        return str(dtype).removeprefix("torch.")

    def should_use_persistent_reduction(self) -> bool:
        """Whether the reduction is a *block* one (Triton's persistent reduction): one block
        per output row, one thread per reduced element, no loop. Only sums over a static
        range of at most ``BLOCK_REDUCTION_MAX``: each thread adds its value into a
        block-shared accumulator (``atomic_add``), which needs no loop and few syntax
        nodes, so the kernel is bounded work and the firmware runs it inline on its
        scheduler instead of handing a looping kernel to an engine (an MLP's bias
        gradients: a sum over the batch). Other reductions loop in one thread."""
        rnumel = self.numels.get("r0_")
        if not self.features.is_reduction() or not isinstance(rnumel, sympy.Integer) \
                or not 2 <= int(rnumel) <= BLOCK_REDUCTION_MAX:
            return False
        return all(n.node.get_reduction_type() == "sum"
                   for n in self.features.reduction_nodes())

    def block_size(self) -> int | None:
        """Threads per block of a block reduction (the reduced range), else None (one
        thread per ``x`` index, ``launcher.BLOCK`` of them a block)."""
        return int(self.numels["r0_"]) if self.persistent_reduction else None

    def index_to_str(self, index: sympy.Expr) -> str:  # type: ignore[override]
        return self.kexpr(self.rename_indexing(index))

    # ------------------------------------------------------------------ memory
    def load(self, name: str, index: sympy.Expr) -> CSEVariable:
        var = self.args.input(name)
        dtype = V.graph.get_dtype(name)
        if V.graph.is_unspec_arg(name):  # a Python number Dynamo passes as a 0-d CPU
            return self.cse.generate(self.loads, var, dtype=dtype)  # tensor: a scalar
        index = self.prepare_indexing(index)
        line = f"{var}[{self.index_to_str(index)}]"
        if dtype not in halfbits.FORMATS:
            return self.cse.generate(self.loads, line, dtype=dtype)
        bits = self.cse.generate(self.loads, line, dtype=torch.int32)
        return self.cse.generate(self.loads, halfbits.decode(str(bits), halfbits.FORMATS[dtype]),
                                 dtype=torch.float32)

    def _store_lines(self, name: str, index: sympy.Expr, value: Any) -> list[Any]:
        """The statements storing ``value`` at ``index`` of ``name`` (16-bit floats as
        their rounded bits); the store itself is deferred (dropped if the buffer is)."""
        var = self.args.output(name)
        target = f"{var}[{self.index_to_str(self.prepare_indexing(index))}]"
        fmt = halfbits.FORMATS.get(V.graph.get_dtype(name))
        if fmt is None:
            return [DeferredLine(name, f"{target} = {value}")]
        bits = self.cse.newvar(dtype=torch.int32)
        return [*halfbits.encode(str(value), str(bits), fmt, str(bits)),
                DeferredLine(name, f"{target} = {bits}")]

    def _by_one_thread(self, lines: list[Any]) -> list[Any]:
        """In a block reduction, a store of a value of the row (not of one reduced element)
        by the row's first thread only (its other threads hold the same value): the store,
        dropped with its buffer, is a one-line ``if``."""
        if not self.persistent_reduction:
            return lines
        *rest, store = lines
        return [*rest, DeferredLine(store.name, f"if r0_index == 0: {store.line}")]

    def store(self, name: str, index: sympy.Expr, value: CSEVariable, mode: Any = None) -> None:
        if mode == "atomic_add" and V.graph.get_dtype(name) not in halfbits.FORMATS:
            var = self.args.output(name)
            idx = self.index_to_str(self.prepare_indexing(index))
            self.stores.writeline(DeferredLine(name, f"atomic_add({var}, {idx}, {value})"))
            return
        if mode is not None:
            raise NotImplementedError(f"accel: store mode {mode} on {V.graph.get_dtype(name)}")
        lines = self._store_lines(name, index, value)
        if not self.inside_reduction:  # a value of the row, after the reduction
            lines = self._by_one_thread(lines)
        self.stores.writelines(lines)

    def store_reduction(self, name: str, index: sympy.Expr, value: CSEVariable) -> None:
        self.suffix.writelines(self._by_one_thread(self._store_lines(name, index, value)))

    def check_bounds(self, expr: sympy.Expr, size: sympy.Expr, lower: bool, upper: bool
                     ) -> None:
        """Nothing to add: the firmware checks every access against its buffer and faults
        the launch on a miss, as it does for eager kernels."""

    # ------------------------------------------------------------------ reductions
    def _acc(self, init: str, dtype: torch.dtype) -> CSEVariable:
        var = self.cse.newvar(dtype=dtype)
        self.body.writeline(f"{var} = {init}")
        self.outside_loop_vars.add(var)
        return var

    def reduction(self, dtype: torch.dtype, src_dtype: torch.dtype, reduction_type: str,
                  value: Any) -> Any:
        key = (src_dtype, reduction_type, value)
        if key in self.cse.reduction_cache:
            return self.cse.reduction_cache[key]
        result = self._reduction(dtype, src_dtype, reduction_type, value)
        self.cse.reduction_cache[key] = result
        return result

    def _reduction(self, dtype: torch.dtype, src_dtype: torch.dtype, kind: str,
                   value: Any) -> Any:
        assert self.inside_reduction
        floating = src_dtype.is_floating_point
        out = self.compute
        if self.persistent_reduction:
            return self._block_sum(dtype, floating, kind, value)
        if kind in ("sum", "prod", "any", "xor_sum"):
            init = _INIT[kind][0 if floating else 1]
            if init is None:
                raise NotImplementedError(f"accel: {kind} of {src_dtype}")
            acc = self._acc(init, dtype)
            op = {"sum": "{a} + {v}", "prod": "{a} * {v}", "any": "{a} or ({v} != 0)",
                  "xor_sum": "{a} ^ {v}"}[kind]
            out.writeline(f"{acc} = {op.format(a=acc, v=value)}")
            return acc
        if kind in ("max", "min"):
            if floating:
                init = f"(-{_INF})" if kind == "max" else _INF
            else:
                lo, hi = _iinfo(src_dtype)
                init = _constant(lo if kind == "max" else hi, torch.int64)
            acc = self._acc(init, dtype)
            cmp = ">" if kind == "max" else "<"
            out.writeline(f"{acc} = {value} if {value} {cmp} {acc} or {value} != {value} "
                          f"else {acc}")
            return acc
        if kind in ("argmax", "argmin"):
            best = self._acc(f"(-{_INF})" if kind == "argmax" else _INF, torch.float64) \
                if floating else self._acc(_constant(_iinfo(src_dtype)[
                    0 if kind == "argmax" else 1], torch.int64), torch.int64)
            idx = self._acc("0", torch.int64)
            first = self._acc("True", torch.bool)
            cmp = ">" if kind == "argmax" else "<"
            out.writeline(f"if {first} or {value} {cmp} {best} or "
                          f"({value} != {value} and {best} == {best}):")
            with out.indent():
                out.writelines([f"{best} = {value}", f"{idx} = r0_index", f"{first} = False"])
            return idx
        if kind == "welford_reduce":
            mean, m2, weight = (self._acc("0.0", torch.float64) for _ in range(3))
            delta = self.cse.newvar(dtype=torch.float64)
            out.writelines([f"{weight} = {weight} + 1.0", f"{delta} = {value} - {mean}",
                            f"{mean} = {mean} + {delta} / {weight}",
                            f"{m2} = {m2} + {delta} * ({value} - {mean})"])
            return mean, m2, weight
        if kind == "welford_combine":
            vmean, vm2, vweight = value
            mean, m2, weight = (self._acc("0.0", torch.float64) for _ in range(3))
            delta, total, frac = (self.cse.newvar(dtype=torch.float64) for _ in range(3))
            out.writelines([
                f"{delta} = {vmean} - {mean}", f"{total} = {weight} + {vweight}",
                f"{frac} = {vweight} / {total} if {total} != 0 else 0.0",
                f"{mean} = {mean} + {delta} * {frac}",
                f"{m2} = {m2} + {vm2} + {delta} * {delta} * {weight} * {frac}",
                f"{weight} = {total}"])
            return mean, m2, weight
        raise NotImplementedError(f"accel: reduction {kind}")

    def _block_sum(self, dtype: torch.dtype, floating: bool, kind: str, value: Any) -> Any:
        """A block reduction's sum: the row's first thread zeroes a block-shared
        accumulator before any element is computed (``self.body`` precedes the loads),
        every thread adds its element, and after a barrier each thread reads the total.
        The accumulator is float64 (int64), as the looping reduction's is."""
        if kind != "sum":  # should_use_persistent_reduction admits only sums
            raise NotImplementedError(f"accel: block reduction {kind}")
        part, acc = self.cse.newvar(dtype=dtype), self.cse.newvar(dtype=dtype)
        self.body.writelines([
            f"{part} = shared_array(1, {'float64' if floating else 'int64'!r})",
            f"if r0_index == 0: {part}[0] = {_INIT[kind][0 if floating else 1]}",
            "barrier()"])
        self.compute.writelines([f"atomic_add({part}, 0, {value})", "barrier()",
                                 f"{acc} = {part}[0]"])
        return acc

    # ------------------------------------------------------------------ indexing
    def codegen_iteration_ranges_entry(self, entry: IterationRangesEntry) -> None:
        line = f"{entry.name} = {self.kexpr(self.rename_indexing(entry.expr))}"
        if entry.root.is_loop:
            self.indexing_code.writeline(line)
        else:
            self.body.writeline(line)  # per thread, outside the reduction loop

    def iteration_ranges_codegen_header(self, entry: Any, code: IndentedBuffer) -> None:
        """Nothing: a range here has no block offset or mask to set up (one thread per
        ``x`` index, a plain loop over ``r0_``); its index variables are written per
        entry (``codegen_iteration_ranges_entry``)."""

    def codegen_body(self) -> None:
        """Flush what was generated since the last flush into ``self.body``: inside a
        reduction, as one loop over ``r0_`` followed by the reduction's stores."""
        if not (self.indexing_code or self.loads or self.compute or self.stores
                or self.suffix):
            return
        loops = [t for t in self.range_trees if t.is_loop]
        if self.inside_reduction and loops:
            (tree,) = loops
            self.body.writeline(f"for {tree.prefix}index in range("
                                f"{self.kexpr(self.rename_indexing(tree.numel))}):")
            with self.body.indent():
                for buf in (self.indexing_code, self.loads, self.compute, self.stores):
                    self.body.splice(buf)
                if not (self.indexing_code or self.loads or self.compute or self.stores):
                    self.body.writeline("pass")
            self.cse.invalidate(self.outside_loop_vars)
            tree.cache_clear()
        else:
            for buf in (self.indexing_code, self.loads, self.compute, self.stores):
                self.body.splice(buf)
        self.body.splice(self.suffix)
        for buf in (self.indexing_code, self.loads, self.compute, self.stores, self.suffix):
            buf.clear()

    def signature(self, removed: set[str] | frozenset[str] = frozenset()) -> str:
        """``def KERNEL_NAME(...):`` over this kernel's buffers and scalars (and those of
        the subkernels sharing its ``args``, a horizontal kernel's), ``xnumel`` last."""
        argdefs, _, _, _ = self.args.python_argdefs()
        dropped = self.removed_buffers | removed
        params = [a.name for a in argdefs if a.name not in dropped]
        scalars = dict.fromkeys(self.args.sizevars.values(), "int64")
        scalars.update({inner: "float64" if V.graph.get_dtype(outer).is_floating_point
                        else "int64" for outer, inner in self.args.input_buffers.items()
                        if V.graph.is_unspec_arg(outer)})
        params = [f"{p}: {scalars[p]!r}" if p in scalars else p for p in params]
        return f"def KERNEL_NAME({', '.join([*params, 'xnumel: ' + repr('int64')])}):"

    def codegen_kernel(self, name: str | None = None) -> str:
        """The kernel's source; its name is ``KERNEL_NAME`` until the scheduling names
        it."""
        self.codegen_body()
        code = IndentedBuffer()
        code.writeline(self.signature())
        with code.indent():
            if self.persistent_reduction:  # a block per row: its threads return together
                code.writelines(["xindex = group_id(0)", "r0_index = local_id(0)"])
            else:
                code.writeline("xindex = global_id(0)")
            code.writeline("if xindex >= xnumel:")
            with code.indent():
                code.writeline("return")
            code.splice(self.indexing_code)
            code.splice(self.body)
        return code.getvalue()

    def call_kernel(self, name: str, node: Any = None, deallocate_ws: bool = True,
                    numel: sympy.Expr | None = None) -> None:
        """The wrapper's call: the buffers and scalars, then ``numel`` threads (by default
        the ``x`` range's)."""
        wrapper = V.graph.wrapper_code
        _, call_args, _, _ = self.args.python_argdefs()
        for v in self.args.sizevars:
            wrapper.ensure_size_computed(v)
        if numel is None:
            numel = next(t for t in self.range_trees if t.prefix == "x").numel
        wrapper.writeline(wrapper.wrap_kernel_call(name, [*map(str, call_args), pexpr(numel)]))


def _body_text(kernel: AccelKernel) -> str:
    """A pointwise kernel's statements, one thread's (what follows its ``xindex``)."""
    kernel.codegen_body()
    return kernel.indexing_code.getvalue() + kernel.body.getvalue()


def _horizontal_source(signature: str, branches: list[tuple[str, int]]) -> str:
    """A horizontal kernel: thread ``i`` runs the branch whose range holds ``i``, as
    index ``i`` less the ranges before it (``branches``: each one's statements and
    threads)."""
    code = IndentedBuffer()
    code.writeline(signature)
    with code.indent():
        code.writelines(["xindex = global_id(0)", "if xindex >= xnumel:", "    return"])
        start = 0
        for body, numel in branches:
            code.writeline(f"{'if' if start == 0 else 'elif'} xindex < {start + numel}:")
            with code.indent():
                if start:
                    code.writeline(f"xindex = xindex - {start}")
                code.splice(body)
            start += numel
    return code.getvalue()


def _runs_inline(source: str, numel: int) -> bool:
    """Whether the firmware runs a launch of this loop-free kernel over ``numel``
    elements (``launcher.BLOCK`` threads a block) inline: ``INLINE_NODES``,
    ``INLINE_WORK``, its nodes counted as ``kernel_check.bounded_work`` counts them."""
    fn = ast.parse(source).body[0]
    assert isinstance(fn, ast.FunctionDef)
    nodes = sum(1 for stmt in fn.body for _ in ast.walk(stmt))
    threads = -(-numel // BLOCK) * BLOCK
    return nodes <= INLINE_NODES and threads <= INLINE_THREADS \
        and threads * nodes <= INLINE_WORK


class AccelScheduling(SIMDScheduling):
    """Inductor's SIMD fusion (pointwise chains, pointwise into reductions) with one
    pointwise range per kernel: ``x`` (one thread per element) and at most one reduction
    range ``r0_``."""

    kernel_type = AccelKernel  # type: ignore[assignment]

    @classmethod
    def get_tiling_and_scores(cls, node_schedule: Any, numel: sympy.Expr,
                              reduction_numel: sympy.Expr = sympy.S.One,
                              coalesce_analysis: Any = None) -> tuple[Any, None]:
        return cls.create_tiling([numel], [reduction_numel]), None

    def define_kernel(self, src_code: str, node_schedule: Any, kernel: AccelKernel) -> str:
        wrapper = V.graph.wrapper_code
        if src_code in wrapper.src_to_kernel:
            return wrapper.src_to_kernel[src_code]
        fused = get_fused_kernel_name(node_schedule, config.triton.descriptive_names)
        suffix = f"_{wrapper.next_kernel_suffix()}"
        name = ("accel_" + fused)[: NAME_MAX - len(suffix)] + suffix
        wrapper.src_to_kernel[src_code] = name
        source = src_code.replace("KERNEL_NAME", name)
        origins, detailed = get_kernel_metadata(node_schedule, wrapper)
        block = kernel.block_size()
        wrapper.header.writeline(f"{name} = Generated({name!r}, '''")
        wrapper.header.writelines(source.rstrip("\n").split("\n"))
        wrapper.header.writeline("''')" if block is None else f"''', block={block})")
        return name

    def get_backend_features(self, device: torch.device) -> OrderedSet[BackendFeature]:
        """``FOREACH``: a foreach op (SGD's update of every parameter) reaches the
        scheduling as one combo node, written as one kernel (``codegen_combo_kernel``)
        rather than a launch per tensor."""
        return OrderedSet([BackendFeature.FOREACH])

    def codegen_combo_kernel(self, combo_kernel_node: Any) -> None:
        """A foreach's subkernels: the pointwise ones of static size as few horizontal
        kernels as the firmware still runs inline (``_codegen_horizontal``), any other (a
        reduction, a dynamic size) as its own kernel."""
        pointwise: list[tuple[list[Any], int]] = []
        for sub in combo_kernel_node.get_subkernel_nodes():
            nodes = [n for n in sub.get_nodes() if n.get_name() not in self.scheduler.removed_ops]
            if not nodes:
                continue
            _, (numel, rnumel) = max(nodes, key=lambda n: int(n.is_reduction())).group
            if rnumel == 1 and isinstance(numel, sympy.Integer):
                pointwise.append((nodes, int(numel)))
            else:
                self._codegen_alone(nodes)
        groups: list[list[tuple[list[Any], int]]] = []
        branches: list[tuple[str, int]] = []
        for item in pointwise:
            # the subkernel's body written once to count its nodes (written again in its
            # group: the probe's names are its own)
            probe = self._pointwise_kernel(*item)
            self.codegen_node_schedule_with_kernel(probe.features.node_schedule, probe)
            branch = (_body_text(probe), item[1])
            candidate = [*branches, branch]
            if groups and _runs_inline(_horizontal_source("def k(xnumel):", candidate),
                                       sum(numel for _, numel in candidate)):
                groups[-1].append(item)
                branches.append(branch)
            else:
                groups.append([item])
                branches = [branch]
        for group in groups:
            if len(group) == 1:
                self._codegen_alone(group[0][0])
            else:
                self._codegen_horizontal(group)
        self.free_buffers_in_scheduler()

    def _codegen_alone(self, nodes: list[Any]) -> None:
        """One subkernel of a foreach as a kernel of its own. Not ``codegen_node``, which
        frees the buffers whose last reader the combo node is once its first subkernel
        is written, before the others read them."""
        _, (numel, rnumel) = max(nodes, key=lambda n: int(n.is_reduction())).group
        schedule = self.generate_node_schedule(nodes, numel, rnumel)
        tiling, _ = self.get_tiling_and_scores(schedule, numel, rnumel)
        kernel = self.kernel_type(tiling, features=SIMDKernelFeatures(schedule, numel, rnumel))
        self.process_kernel(kernel, schedule)
        with V.set_kernel_handler(kernel):
            source = kernel.codegen_kernel()
        name = self.define_kernel(source, schedule, kernel)
        self.codegen_comment(nodes, name)
        kernel.call_kernel(name)

    def _pointwise_kernel(self, nodes: list[Any], numel: int) -> AccelKernel:
        schedule = self.generate_node_schedule(nodes, sympy.Integer(numel), sympy.S.One)
        return self.kernel_type(self.create_tiling([sympy.Integer(numel)], [sympy.S.One]),
                                features=SIMDKernelFeatures(schedule, sympy.Integer(numel),
                                                            sympy.S.One))

    def _codegen_horizontal(self, group: list[tuple[list[Any], int]]) -> None:
        """One kernel for independent pointwise subkernels (``_horizontal_source``). The
        subkernels share one ``args`` (so their buffers have distinct names) and one
        counter of temporaries."""
        kernels: list[AccelKernel] = []
        for nodes, numel in group:
            kernel = self._pointwise_kernel(nodes, numel)
            if kernels:
                kernel.args = kernels[0].args
                kernel.iter_vars_count = kernels[0].iter_vars_count
                kernel.cse.iter_buffer_ids = kernels[0].cse.iter_buffer_ids
            self.process_kernel(kernel, kernel.features.node_schedule)
            kernels.append(kernel)
        first = kernels[0]
        signature = first.signature(set().union(*(k.removed_buffers for k in kernels)))
        source = _horizontal_source(signature, [(_body_text(k), numel)
                                                for k, (_, numel) in zip(kernels, group)])
        nodes = [n for sub_nodes, _ in group for n in sub_nodes]
        name = self.define_kernel(source, nodes, first)
        self.codegen_comment(nodes, name)
        first.call_kernel(name, numel=sympy.Integer(sum(numel for _, numel in group)))

    def benchmark_fused_nodes(self, nodes: Any) -> Any:  # no autotuning on accel
        raise NotImplementedError("accel: no benchmarking")


class AccelDeviceOpOverrides(DeviceOpOverrides):
    """What the Python wrapper writes to import, select and synchronize the device."""

    def import_get_raw_stream_as(self, name: str) -> str:
        return f"from torch_accel.inductor.launcher import get_raw_stream as {name}"

    def set_device(self, device_idx: int) -> str:
        return f"torch.accel.set_device({device_idx})"

    def synchronize(self) -> str:
        return "torch.accel.synchronize()"

    def device_guard(self, device_idx: int) -> str:
        return f"torch.accel.device({device_idx})"


class AccelWrapper(PythonWrapperCodegen):
    """Inductor's Python wrapper, importing the launcher of generated kernels."""

    def write_header(self) -> None:
        super().write_header()
        self.imports.writeline("from torch_accel.inductor.launcher import Generated, "
                               "product as accel_product")

    def make_allocation(self, name: str, device: torch.device, dtype: torch.dtype,
                        shape: Any, stride: Any, allocation_shape: Any = None,
                        is_pinned: bool = False) -> str:
        """Allocations name their device's index: Inductor writes device guards only for
        the GPU types it knows, and without one ``device='accel'`` is the current device,
        not the graph's (a graph on accel:1 allocated its outputs on accel:0)."""
        line = super().make_allocation(name, device, dtype, shape, stride, allocation_shape,
                                       is_pinned)
        if device.type == DEVICE_TYPE and device.index is not None:
            line = line.replace(f"device='{DEVICE_TYPE}'",
                                f"device='{DEVICE_TYPE}:{device.index}'", 1)
        return line

    @staticmethod
    def create(is_subgraph: bool, subgraph_name: str | None, parent_wrapper: Any,
               partition_signatures: Any = None) -> AccelWrapper:
        if is_subgraph:  # its kernels are defined in the parent's module, which imports
            return PythonWrapperCodegen.create(is_subgraph, subgraph_name, parent_wrapper,
                                               partition_signatures)
        return AccelWrapper()
