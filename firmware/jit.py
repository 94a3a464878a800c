"""The firmware's kernel JIT: module IR -> Numba machine code, cached on disk.

docs/kernels.md is the contract. One kernel's IR (``module["kernels"][name]``) plus the
concrete argument types of a launch (``"float32[1d]"`` for a buffer, ``"float32"`` for a
scalar) and the code-generation :class:`Options` are lowered to the text of a Python
module, written to disk and imported as a real file so that numba's ``cache=True`` works
(``exec``'d code cannot be cached, docs/kernels.md "Numba facts").

The pieces: firmware/kernel_check.py re-validates the IR, firmware/lower/ generates the
module (a pass pipeline and a renderer, docs/compiler.md; firmware/lower/render.py says
why it looks the way it does), firmware/intrinsics.py and firmware/matrix.py are what
the generated code calls; this module compiles, runs and caches.

The persistent cache
--------------------
:class:`KernelCache` keys entries on sha256 of the canonical JSON of every compatibility
input (kernel source/params/shared_mem, argument types, options, :func:`compat_key`, and
the sha256 of the generated source, so a change in the lowering can never reuse stale
machine code). Each entry is ``root/<key[:2]>/<key>/`` with the generated module, a
``manifest.json`` and numba's own ``__pycache__``. Entries are built in a temporary
directory and renamed into place under an exclusive ``flock`` on one of 256 lock files
(``root/.locks/<key[:2]>.lock``), so two processes never corrupt an entry and never both
compile it; a corrupt entry (manifest unreadable, checksum mismatch, a cache file numba
cannot load) is deleted and rebuilt, and one that fails to compile leaves nothing. The
cache keeps at most ``MAX_CACHE_ENTRIES`` entries, the least recently used going first:
every tenant's distinct kernels land in it.

Locking within a process: a short lock guards only the in-memory tables and counters, and
one build lock is held while a kernel is validated, lowered and compiled (seconds), so
:meth:`KernelCache.cached` -- the scheduler's lookup on its control thread -- never waits
for a compile, while two threads asking for one new kernel still compile it once (numba
serialises compiles behind its own global lock anyway, so one build lock loses nothing).
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import functools
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
from collections.abc import Callable
from pathlib import Path
from typing import Any, Iterator

import llvmlite
import llvmlite.binding as llvm_binding
import numba
import numpy as np
from numba import types

from firmware import matrix
from firmware.kernel_check import (SHARED_LIMIT, ArgType, Kernel, KernelCompileError,
                                   bounded_work, calls_mma, capabilities_used, validate)
from firmware.launch_work import LoopWork
from firmware.lower import (ABORT_KILL, ABORT_PREEMPT, ABORT_WATCHDOG, FAULT_ABORT, FAULT_BOUNDS,
                            FAULT_INDEX, FAULT_NDIM, FAULT_SHAPE, FAULT_WORDS,
                            MAX_BLOCK_THREADS, MAX_DIM, Options, lower, lower_kernel)
from firmware.lower.abi import options_key

#: The firmware's JIT compatibility boundary. Bump it whenever anything the generated code
#: depends on outside itself changes meaning (firmware/intrinsics.py, the ``_grid`` calling
#: convention, the fault-array layout): every cached entry then misses.
FIRMWARE_JIT_ABI = 11
DEFAULT_ISA = "aemu-isa 1.0"
#: Entries the persistent cache keeps on disk (about 150 KB each), least recently used out.
MAX_CACHE_ENTRIES = 2048
_INT64 = np.dtype(np.int64)  # the abort word's (CompiledKernel.run)
DEFAULT_STEPPING = "A1"
#: The vendor kernel library shipped next to the firmware images (``make kernels``):
#: torch_accel's kernels compiled ahead of time, read-only (KernelCache's ``library``).
LIBRARY_DIR = Path(__file__).resolve().parent / "kernel-library"


#: The range of KernelFault.index: a flat index that does not fit is clamped to it.
INDEX_MIN = -(1 << 63)
INDEX_MAX = (1 << 63) - 1
_U64_MAX = (1 << 64) - 1


class KernelFault(Exception):
    """A launch stopped by the kernel itself or by the abort word inside a block.

    ``kind="bounds"``: ``param`` is the buffer's name (or a shared array local's) and
    ``index`` the flat, row-major element index of the access -- for ``mma`` the tile
    corner that misses (docs/kernels.md) -- as a Python int in ``[INDEX_MIN, INDEX_MAX]``.
    It is exact, computed in Python from the per-dimension indices the kernel recorded,
    except that it is clamped to that range and ``saturated`` is then True -- as it is when
    a recorded index is 2**63-1, the bound to which a uint64 index of 2**63 or more and an
    mma tile end past it saturate. A negative index (the access's start) stays negative: a
    clamp to 0 would name an element inside the buffer. The device address of the miss is
    :meth:`address`, which the caller must use (or clamp likewise) to fit a 64-bit field.
    ``"watchdog"`` / ``"abort"``: stopped by the abort word. ``"error"``: the kernel raised
    an error numba defines as an exception (a ``range()`` step of 0). ``block`` is the block
    that was running when known: blocks before it completed."""

    def __init__(self, kind: str, param: str | None = None, index: int | None = None,
                 message: str = "", block: int | None = None, saturated: bool = False) -> None:
        self.kind = kind
        self.param = param
        self.index = index
        self.saturated = saturated
        self.block = block
        self.message = message or (f"{kind} fault" + (f" on {param}[{index}]"
                                                      if param is not None else ""))
        super().__init__(self.message)

    def address(self, va: int, itemsize: int) -> int:
        """``va + index * itemsize`` (``va`` without an index) clamped to ``[0, 2**64 - 1]``:
        the device address a fault record's u64 field can hold."""
        addr = va + (self.index or 0) * itemsize
        return min(max(addr, 0), _U64_MAX)


def compat_key(options: Options = Options(), isa: str = DEFAULT_ISA,
               stepping: str = DEFAULT_STEPPING) -> dict[str, Any]:
    """Every input outside the kernel that decides whether cached machine code may be
    reused: interpreter, compiler and framework versions, the firmware's JIT ABI, the
    target ISA and stepping, the host CPU (numba compiles for the host; an override via
    ``NUMBA_CPU_NAME`` counts), the code-generation options, and the environment settings
    that change numba's code generation (``NUMBA_OPT``, ``NUMBA_BOUNDSCHECK``, the
    vectorisers, AVX, SVML, debug info): numba's own cache index does not key on those."""
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
        "options": options_key(options),
        "codegen_env": {name: _config_value(name) for name in _CODEGEN_CONFIG},
    }


#: numba.config settings (each from a NUMBA_* environment variable) that alter the machine
#: code of a kernel, or its behaviour (BOUNDSCHECK overrides the per-function setting).
_CODEGEN_CONFIG = ("OPT", "BOUNDSCHECK", "LOOP_VECTORIZE", "SLP_VECTORIZE", "ENABLE_AVX",
                   "USING_SVML", "DEBUGINFO_DEFAULT")


def _config_value(name: str) -> Any:
    value = getattr(numba.config, name, None)
    return value if value is None or isinstance(value, (bool, str)) else int(value)


# --------------------------------------------------------------------------- compiled kernel


@functools.lru_cache(maxsize=1024)
def _dims_in_range(gx: int, gy: int, gz: int, bx: int, by: int, bz: int) -> bool:
    """Every dimension in ``[1, MAX_DIM]`` and a block at most ``MAX_BLOCK_THREADS``
    (plain ints only: the caller checks their types, so equal keys are equal values):
    cached, since a program launches a few shapes over and over and the check cost ~1 us
    of a tiny launch."""
    return all(1 <= d <= MAX_DIM for d in (gx, gy, gz, bx, by, bz)) \
        and bx * by * bz <= MAX_BLOCK_THREADS


class CompiledKernel:
    """One kernel compiled for one set of argument types and options."""

    def __init__(self, key: str, name: str, params: list[str], arg_types: list[ArgType],
                 shared: list[str], dispatcher: Any, signature: tuple[Any, ...],
                 source: str, module_path: Path, blas: np.ndarray, uses_mma: bool,
                 work_per_thread: int | None, capabilities: frozenset[str],
                 sanitize: bool = False, loop_work: LoopWork | None = None) -> None:
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
        #: the thread count.
        self.uses_mma = uses_mma
        #: Its work per thread when that is statically bounded and small
        #: (kernel_check.bounded_work: no loops, no mma, at most INLINE_MAX_NODES nodes,
        #: each evaluated at most once), else None: a launch of a bounded number of
        #: threads is then bounded work whatever its arguments, and the scheduler may run
        #: it on its control thread, which must do bounded work per pass (a kernel with a
        #: loop could hold it until the watchdog).
        self.work_per_thread = work_per_thread
        #: For a kernel with loops (``work_per_thread`` None): its work per thread as the
        #: launch's values bound it (firmware/launch_work.py), or None when no launch's can
        #: (a ``while`` loop, ``mma``): a launch whose bound is small runs inline too.
        self.loop_work = loop_work
        #: The device capabilities its source uses (kernel_check.capabilities_used): the
        #: scheduler refuses a launch on a device that lacks one, whatever the IR claimed.
        self.capabilities = capabilities
        # The native entry point skips numba's per-call type dispatch (a few us per launch);
        # run() checks the buffers itself, since it would not.
        try:
            self._entry = dispatcher.overloads[signature].entry_point
        except (KeyError, AttributeError):  # pragma: no cover - numba internals moved
            self._entry = dispatcher
        self._checks = [(i, np.dtype(t.dtype), t.ndim) for i, t in enumerate(arg_types) if t.ndim]
        #: arguments ``run`` takes: the parameters, then each managed buffer's page map
        #: and first-page offset (firmware/managed.py), then the checked variant's hazard
        #: record (abi/hazard.py)
        self.nargs = len(params) + sum(len(t.extra_numba_types()) for t in arg_types) \
            + sanitize

    @property
    def inline_ok(self) -> bool:
        """Whether the scheduler may run a launch of it on its control thread."""
        return self.work_per_thread is not None

    def ended(self) -> None:
        """A launch of it ended (its engine reported it done, or the module loader took
        an inline launch's request): load MKL now if one of its BLAS calls asked for it
        (firmware/matrix.py), off the launch's time and watchdog."""
        if self.uses_mma:
            matrix.serve_request(self.blas)

    def mkl_asked(self) -> bool:
        """Whether one of its BLAS calls asked for MKL and no one loaded it yet."""
        return self.uses_mma and self.blas[matrix.STATE_AT] == matrix.ASKED

    def _check_buffers(self, args: list[Any]) -> None:
        """What the native entry point assumes of its buffers and would not check."""
        for i, dt, nd in self._checks:
            a = args[i]
            if not (isinstance(a, np.ndarray) and (a.dtype is dt or a.dtype == dt)
                    and a.ndim == nd and a.flags.c_contiguous):
                raise TypeError(f"argument {self.params[i]!r} must be a C-contiguous "
                                f"{dt}[{nd}d] array")

    def run(self, block_lo: int, block_hi: int, grid: tuple[int, int, int],
            block: tuple[int, int, int], args: list[Any], abort: np.ndarray,
            dynamic_shared: int = 0) -> int:
        """Run blocks ``[block_lo, block_hi)`` (linear ids, x fastest) of a launch of
        ``grid`` blocks of ``block`` threads, each with ``dynamic_shared`` bytes for its
        ``dynamic_shared`` arrays (the caller checks it against the device's limit).
        Returns the first block not run (``block_hi`` when all ran; less only when the
        abort word stopped it between blocks). Raises :class:`KernelFault` on a bounds miss,
        when the abort word stopped a block in the middle, or when the kernel raised.

        Every dimension must be in ``[1, MAX_DIM]`` and a block at most
        ``MAX_BLOCK_THREADS`` threads, ``dynamic_shared`` at most ``SHARED_LIMIT`` (the
        generated code's arithmetic relies on these; ValueError otherwise). The buffers
        must be C-contiguous arrays of the compiled types (TypeError otherwise)."""
        self._check(block_lo, block_hi, grid, block, args, abort, dynamic_shared)
        return int(self._blocks(block_lo, block_hi, grid, block, args, abort, dynamic_shared)())

    def bind(self, grid: tuple[int, int, int], block: tuple[int, int, int], args: list[Any],
             abort: np.ndarray, dynamic_shared: int = 0) -> Callable[[], int]:
        """A launch of the whole grid with these very arguments, checked once here (as
        :meth:`run` checks them); calling the result runs it as ``run`` would, raising the
        same faults. What the firmware keeps for a launch it repeats (firmware/launches.py
        ``Bound``): ``run``'s checks and argument passing were a fifth of a tiny launch.
        The launch has one fault array, cleared after each fault it raised."""
        nblocks = grid[0] * grid[1] * grid[2]
        self._check(0, nblocks, grid, block, args, abort, dynamic_shared)
        return self._blocks(0, nblocks, grid, block, args, abort, dynamic_shared)

    def _blocks(self, block_lo: int, block_hi: int, grid: tuple[int, int, int],
                block: tuple[int, int, int], args: list[Any], abort: np.ndarray,
                dynamic_shared: int) -> Callable[[], int]:
        """The native entry point over checked arguments, as a call that raises what the
        kernel's fault array says (and clears it, for the next call)."""
        fault = np.zeros(FAULT_WORDS, np.int64)
        call = functools.partial(self._entry, block_lo, block_hi, *grid, *block, abort, fault,
                                 self.blas, dynamic_shared, *args)

        def launch() -> int:
            try:
                done = call()
            except Exception as exc:  # noqa: BLE001 - raised by the kernel's code (numba's)
                raise KernelFault("error", message=f"{self.name}: {exc!r}") from exc
            if fault[0]:
                try:
                    self._raise_fault(fault, done, abort)
                finally:
                    fault[:] = 0
            return done
        return launch

    def _check(self, block_lo: int, block_hi: int, grid: tuple[int, int, int],
               block: tuple[int, int, int], args: list[Any], abort: np.ndarray,
               dynamic_shared: int) -> None:
        """What the generated code relies on and would not check (``run``'s docstring)."""
        gx, gy, gz = grid
        bx, by, bz = block
        if not (type(gx) is type(gy) is type(gz) is type(bx) is type(by) is type(bz) is int
                and _dims_in_range(gx, gy, gz, bx, by, bz)):
            raise ValueError(f"grid {grid} or block {block} outside the launch limits")
        if not 0 <= block_lo <= block_hi <= gx * gy * gz:
            raise ValueError(f"blocks [{block_lo}, {block_hi}) outside grid {grid}")
        # dtypes compare by identity first: numpy's builtin dtypes are singletons, and
        # ``==`` between dtypes costs ~0.7 us, a seventh of a small launch's run
        if not (type(abort) is np.ndarray and (abort.dtype is _INT64 or abort.dtype == _INT64)
                and abort.shape == (1,)):
            raise TypeError("abort must be an int64 array of shape (1,)")
        if len(args) != self.nargs:
            raise TypeError(f"{self.name} takes {self.nargs} arguments, got {len(args)}")
        self._check_buffers(args)
        if dynamic_shared < 0:
            raise ValueError(f"negative dynamic shared memory {dynamic_shared}")
        if dynamic_shared > SHARED_LIMIT:
            raise ValueError(f"dynamic shared memory {dynamic_shared} above {SHARED_LIMIT}")

    def _raise_fault(self, fault: np.ndarray, done: int, abort: np.ndarray) -> None:
        """The :class:`KernelFault` of a fault array the kernel wrote (``fault[0]`` set)."""
        kind = int(fault[0])
        if kind == FAULT_BOUNDS:
            pos = int(fault[1])
            names = self.params + self.shared
            param = names[pos] if 0 <= pos < len(names) else f"#{pos}"
            index, saturated = _flat_index(fault)
            where = f"[{index}{' (saturated)' if saturated else ''}]"
            raise KernelFault("bounds", param, index, block=int(done), saturated=saturated,
                              message=f"{self.name}: out-of-bounds access {param}{where} "
                                      f"in block {int(done)}")
        if kind == FAULT_ABORT:
            why = "watchdog" if int(abort[0]) == ABORT_WATCHDOG else "abort"
            raise KernelFault(why, block=int(done),
                              message=f"{self.name}: stopped by {why} in block {int(done)}")
        raise KernelFault("error", message=f"{self.name}: fault word {kind}")


def _flat_index(fault: np.ndarray) -> tuple[int, bool]:
    """The flat index of a recorded bounds miss (the fault layout of firmware/lower/abi.py),
    exact in Python ints, clamped to ``[INDEX_MIN, INDEX_MAX]``, and whether it is a bound
    (clamped, or computed from a recorded index that was itself saturated)."""
    n = int(fault[FAULT_NDIM])
    idx = [int(v) for v in fault[FAULT_INDEX:FAULT_INDEX + n]]
    shape = [int(v) for v in fault[FAULT_SHAPE:FAULT_SHAPE + n]]
    flat = 0
    for i, dim in zip(idx, shape):
        flat = flat * dim + i
    index = min(max(flat, INDEX_MIN), INDEX_MAX)
    return index, index != flat or INDEX_MAX in idx


# --------------------------------------------------------------------------- the cache


def warm_up() -> None:
    """Load numba's CPU target now: its typing and lowering registries load on first use
    (~0.1-0.2 s, importing much of numba), which would otherwise land on the first kernel
    loaded from the cache and make it cost ~10x the cache read itself."""
    from numba.core.registry import cpu_target

    cpu_target.typing_context.refresh()
    cpu_target.target_context.refresh()


def _identical(a: Any, b: Any) -> bool:
    """Equal with the same types throughout (JSON values: dicts, lists, scalars)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_identical(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_identical(x, y) for x, y in zip(a, b))
    return bool(a == b)


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
                 stepping: str = DEFAULT_STEPPING, blas: str = "auto",
                 max_entries: int = MAX_CACHE_ENTRIES, library: Path | None = None) -> None:
        self.root = Path(root)
        #: A read-only vendor kernel library (``LIBRARY_DIR``, built by ``make kernels``):
        #: entries laid out and keyed exactly as this cache's, consulted after ``root`` and
        #: before compiling. A hit is copied into ``root`` (numba's index is keyed on the
        #: module file's path and mtime, which the copy keeps) and loaded from there. The
        #: key holds the whole compatibility identity, so an entry built for another ISA,
        #: firmware JIT ABI or numba is simply never found; a corrupt one fails ``_valid``
        #: and the kernel compiles as without a library.
        self.library = Path(library) if library is not None else None
        self.library_hits = 0
        self.max_entries = max_entries
        self.root.mkdir(parents=True, exist_ok=True)
        self.isa = isa
        self.stepping = stepping
        #: mma's BLAS entry points (firmware/matrix.py ``blas_pointers``: ``auto``, the
        #: firmware's, is OpenBLAS until a big product asks for MKL; ``loops`` makes kernels
        #: run mma as plain loops; tests compare them all). Not a key input: the pointers
        #: are arguments, not code.
        self.blas = matrix.blas_pointers(blas)
        self.hits = 0
        self.misses = 0
        self.compiles = 0
        self._lock = threading.Lock()  # the tables and counters only: held for microseconds
        self._build_lock = threading.Lock()  # validating, lowering, compiling (see module doc)
        self._mem: dict[str, CompiledKernel] = {}
        self._fast: dict[tuple[str, tuple[str, ...], Options], list[tuple[Any, Any, str]]] = {}

    # -- keys -------------------------------------------------------------------------------
    def key_inputs(self, ir: dict[str, Any], arg_types: tuple[str, ...],
                   options: Options) -> dict[str, Any]:
        """What the key hashes (the generated source's hash is added at build time), for an
        IR that validated. Only the kernel's own source, params (the fields the contract
        defines) and shared_mem: not its name in the module, its position, nor the module's
        other kernels."""
        params = [{f: p.get(f) for f in ("name", "kind", "dtype", "ndim")}
                  for p in ir["params"]]
        return {
            "kernel": {"source": ir["source"], "params": params,
                       "shared_mem": ir.get("shared_mem", 0)},
            "arg_types": list(arg_types),
            "options": options_key(options),
            "compat": compat_key(options, self.isa, self.stepping),
        }

    def key(self, ir: dict[str, Any], arg_types: tuple[str, ...], options: Options) -> str:
        """The persistent cache key: sha256 over the inputs and the generated source."""
        source = lower(ir, tuple(arg_types), options)  # validates the IR first
        return self._key(self.key_inputs(ir, arg_types, options), source)

    @staticmethod
    def _key(inputs: dict[str, Any], source: str) -> str:
        return _sha(_canonical({"inputs": inputs, "generated": _sha(source.encode())}))

    def entry_dir(self, key: str) -> Path:
        return self.root / key[:2] / key

    # -- get --------------------------------------------------------------------------------
    def get(self, ir: dict[str, Any], arg_types: tuple[str, ...],
            options: Options = Options()) -> CompiledKernel:
        """The compiled kernel, from memory, from disk, or compiled now (eagerly, so the
        first launch does not pay for it). Raises :class:`KernelCompileError`, and nothing
        else for any IR."""
        arg_types = tuple(arg_types)
        ck = self.cached(ir, arg_types, options)
        if ck is not None:
            return ck
        with self._build_lock:
            ck = self.cached(ir, arg_types, options)  # built while this thread waited
            if ck is not None:
                return ck
            misses_before = self.misses
            k = validate(ir, arg_types)
            inputs = self.key_inputs(ir, arg_types, options)
            source = lower_kernel(k, options)
            key = self._key(inputs, source)
            with self._lock:
                ck = self._mem.get(key)
            if ck is None:
                ck = _on_own_thread(self._get_disk, key, inputs, source, k, options)
            else:
                self._count(hits=1)
            with self._lock:
                self._mem[key] = ck
                self._fast.setdefault((ir["source"], arg_types, options), []).append(
                    (copy.deepcopy(ir["params"]), ir.get("shared_mem", 0), key))
            if self.misses > misses_before:
                self._evict()
            return ck

    def cached(self, ir: dict[str, Any], arg_types: tuple[str, ...],
               options: Options = Options()) -> CompiledKernel | None:
        """The compiled kernel if it is already in memory, else None: never compiles, and
        never waits for a compile in progress (only the short table lock), so the
        scheduler's control thread may call it per launch."""
        source = ir.get("source") if isinstance(ir, dict) else None
        arg_types = tuple(arg_types)
        if not (isinstance(source, str) and all(isinstance(t, str) for t in arg_types)):
            return None  # not a kernel seen before (get() says why it is none at all)
        with self._lock:
            for p, s, key in self._fast.get((source, arg_types, options), ()):
                # identical, not just equal: True == 1 == 1.0, and an IR of ndim True must
                # not pass as the validated IR of ndim 1
                if _identical(p, ir.get("params")) and _identical(s, ir.get("shared_mem", 0)):
                    self.hits += 1
                    return self._mem[key]
        return None

    def _count(self, hits: int = 0, misses: int = 0, compiles: int = 0) -> None:
        with self._lock:
            self.hits += hits
            self.misses += misses
            self.compiles += compiles

    @contextlib.contextmanager
    def _flock(self, key: str) -> Iterator[None]:
        """The cross-process lock of ``key``'s entry: one of 256 lock files (by the key's
        first two hex digits, as its shard directory), so kernels that fail to compile
        cannot leave files behind without bound; keys sharing a lock file serialise."""
        locks = self.root / ".locks"
        locks.mkdir(exist_ok=True)
        with open(locks / f"{key[:2]}.lock", "a+b") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)

    def _get_disk(self, key: str, inputs: dict[str, Any], source: str,
                  k: Kernel, options: Options) -> CompiledKernel:
        entry = self.entry_dir(key)
        module_name = f"kernel_{key[:16]}.py"
        with self._flock(key):
            if entry.exists():
                if self._valid(entry, key, module_name, source):
                    try:
                        ck, compiled = self._load(entry, key, module_name, source, k, options)
                    except Exception:  # noqa: BLE001 - e.g. numba's cache files unreadable
                        ck = None  # rebuilt below; a real compile error shows up there
                    if ck is not None:
                        self._count(hits=1, compiles=compiled)
                        with contextlib.suppress(OSError):  # used: last out of the cache
                            os.utime(entry / "manifest.json")
                        return ck
                shutil.rmtree(entry, ignore_errors=True)  # corrupt or half-written: rebuild
            if self._from_library(entry, key, module_name, source):
                try:
                    ck, compiled = self._load(entry, key, module_name, source, k, options)
                except Exception:  # noqa: BLE001 - unloadable: compiled afresh below
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    with self._lock:
                        self.library_hits += 1
                    self._count(hits=1, compiles=compiled)
                    return ck
            self._count(misses=1)
            self._build(entry, key, inputs, module_name, source)
            try:
                ck, compiled = self._load(entry, key, module_name, source, k, options)
            except BaseException:
                shutil.rmtree(entry, ignore_errors=True)  # never keep an entry that fails
                with contextlib.suppress(OSError):
                    entry.parent.rmdir()  # its shard directory too, when nothing else is in it
                raise
            self._count(compiles=compiled)
            return ck

    def _from_library(self, entry: Path, key: str, module_name: str, source: str) -> bool:
        """Copy ``key``'s library entry into place (through a temporary directory, as a
        build) if the library has a valid one; whether it did."""
        if self.library is None:
            return False
        shipped = self.library / key[:2] / key
        if not shipped.is_dir() or not self._valid(shipped, key, module_name, source):
            return False
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{key[:16]}-", dir=entry.parent))
        try:
            shutil.copytree(shipped, tmp, dirs_exist_ok=True)  # copy2: mtimes kept
            os.rename(tmp, entry)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            return False
        return True

    def entries(self) -> list[Path]:
        return [e for shard in self.root.glob("??") if shard.is_dir() for e in shard.iterdir()
                if not e.name.startswith(".")]

    def _evict(self) -> None:
        """Keep at most ``max_entries`` entries on disk, dropping the least recently used
        (a load touches its manifest): every tenant's distinct kernels land here, and the
        cache must not grow without bound. An entry another process is loading just misses
        and is rebuilt there."""
        entries = self.entries()
        if len(entries) <= self.max_entries:
            return

        def last_used(e: Path) -> float:
            try:
                return (e / "manifest.json").stat().st_mtime
            except OSError:
                return 0.0

        for e in sorted(entries, key=last_used)[: len(entries) - self.max_entries]:
            shutil.rmtree(e, ignore_errors=True)

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

    def _load(self, entry: Path, key: str, module_name: str, source: str,
              k: Kernel, options: Options) -> tuple[CompiledKernel, int]:
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
        except Exception as exc:  # e.g. Python's limit of 20 nested blocks: the kernel's
            sys.modules.pop(mod_name, None)
            why = exc.msg if isinstance(exc, SyntaxError) else str(exc)
            raise KernelCompileError(f"kernel {k.fn.name!r} does not compile: "
                                     f"{type(exc).__name__}: {why}") from exc
        except BaseException:
            sys.modules.pop(mod_name, None)
            raise
        abort_t = types.Array(types.int64, 1, "C")
        sig = (types.int64, types.int64, types.int64, types.int64, types.int64,
               types.int64, types.int64, types.int64, abort_t, abort_t, abort_t, types.int64,
               *[t.numba_type() for t in k.arg_types],
               *[x for t in k.arg_types for x in t.extra_numba_types()],
               *([abort_t] if options.sanitize else []))  # the hazard record (abi/hazard.py)
        disp = mod._grid
        try:
            disp.compile(sig)
        except Exception as exc:  # numba typing/lowering errors are the kernel's
            sys.modules.pop(mod_name, None)
            raise KernelCompileError(f"kernel {k.fn.name!r} does not compile: "
                                     f"{_reason(exc)}") from exc
        compiled = 1 if sum(disp.stats.cache_misses.values()) else 0
        work = bounded_work(k)
        ck = CompiledKernel(key, k.fn.name, k.params, k.arg_types, list(k.shared), disp, sig,
                            source, path, self.blas, calls_mma(k.fn.body),
                            work, capabilities_used(k), options.sanitize,
                            LoopWork.of(k) if work is None else None)
        return ck, compiled


def _on_own_thread(fn: Callable[..., CompiledKernel], *args: Any) -> CompiledKernel:
    """``fn(*args)`` on a thread of its own, returning or raising what it did. numba keeps
    what a failed typing raised (its dispatcher's failed-compile cache, and tracebacks of
    the errors it collected), and a traceback keeps the frames it passed through, each
    with its caller's. Compiled in the caller's thread, that chain went up to the engine
    job that asked for the kernel, whose launch holds a tenant's buffers: a pinned
    buffer's mapping and its descriptor outlived their context until the cyclic garbage
    collector happened to run (docs/containment.md, finding 25). On its own thread the
    chain ends at that thread's first frame. A compile takes ~0.1 s or more and a load
    from the disk cache ~10 ms: the thread is noise."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            box["error"] = exc

    t = threading.Thread(target=run, name="jit-build", daemon=True)
    t.start()
    t.join()
    if "error" in box:
        raise box.pop("error")  # not kept in ``box``, which the compile thread's frame holds
    return box.pop("value")


def _reason(exc: Exception) -> str:
    """The line of a numba error that says what failed: the signature it found no
    implementation for (e.g. ``_rt_index(float64)``: a float used as an index), else its
    first line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    for line in lines:
        if line.startswith(">>> "):
            return f"no implementation of {line[4:]}"
    return lines[0] if lines else repr(exc)


__all__ = ["ABORT_KILL", "ABORT_PREEMPT", "ABORT_WATCHDOG", "FIRMWARE_JIT_ABI", "INDEX_MAX",
           "INDEX_MIN", "CompiledKernel", "KernelCache", "KernelCompileError", "KernelFault",
           "Options", "compat_key", "lower", "validate"]
