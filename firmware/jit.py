"""The firmware's kernel JIT: module IR -> Numba machine code, cached on disk.

docs/kernels.md is the contract. One kernel's IR (``module["kernels"][name]``) plus the
concrete argument types of a launch (``"float32[1d]"`` for a buffer, ``"float32"`` for a
scalar) and the code-generation :class:`Options` are lowered to the text of a Python
module, written to disk and imported as a real file so that numba's ``cache=True`` works
(``exec``'d code cannot be cached, ARCHITECTURE.md "Numba facts").

The pieces: firmware/kernel_check.py re-validates the IR, firmware/kernel_lower.py
generates the module (and says why it looks the way it does), firmware/intrinsics.py and
firmware/matrix.py are what the generated code calls; this module compiles, runs and
caches.

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
from dataclasses import asdict
from pathlib import Path
from typing import Any, Iterator

import llvmlite
import llvmlite.binding as llvm_binding
import numba
import numpy as np
from numba import types

from firmware import matrix
from firmware.kernel_check import ArgType, Kernel, KernelCompileError, calls_mma, validate
from firmware.kernel_lower import (ABORT_KILL, ABORT_PREEMPT, ABORT_WATCHDOG, FAULT_ABORT,
                                   FAULT_BOUNDS, Options, lower, lower_kernel)

#: The firmware's JIT compatibility boundary. Bump it whenever anything the generated code
#: depends on outside itself changes meaning (firmware/intrinsics.py, the ``_grid`` calling
#: convention, the fault-array layout): every cached entry then misses.
FIRMWARE_JIT_ABI = 3
DEFAULT_ISA = "aemu-isa 1.0"
DEFAULT_STEPPING = "A1"


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
        "options": asdict(options),
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


class CompiledKernel:
    """One kernel compiled for one set of argument types and options."""

    #: True would mean atomic_add is not a real atomic and the caller must serialise the
    #: launch's blocks; atomics here are LLVM atomicrmw, so it is always False.
    needs_serial: bool = False

    def __init__(self, key: str, name: str, params: list[str], arg_types: list[ArgType],
                 shared: list[str], dispatcher: Any, signature: tuple[Any, ...],
                 source: str, module_path: Path, blas: np.ndarray, uses_mma: bool) -> None:
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
        self.uses_mma = uses_mma
        # The native entry point skips numba's per-call type dispatch (a few us per launch);
        # run() checks the buffers itself, since it would not.
        try:
            self._entry = dispatcher.overloads[signature].entry_point
        except (KeyError, AttributeError):  # pragma: no cover - numba internals moved
            self._entry = dispatcher
        self._checks = [(i, np.dtype(t.dtype), t.ndim) for i, t in enumerate(arg_types) if t.ndim]

    def run(self, block_lo: int, block_hi: int, grid: tuple[int, int, int],
            block: tuple[int, int, int], args: list[Any], abort: np.ndarray,
            dynamic_shared: int = 0) -> int:
        """Run blocks ``[block_lo, block_hi)`` (linear ids, x fastest) of a launch of
        ``grid`` blocks of ``block`` threads, each with ``dynamic_shared`` bytes for its
        ``dynamic_shared`` arrays (the caller checks it against the device's limit).
        Returns the first block not run (``block_hi`` when all ran; less only when the
        abort word stopped it between blocks). Raises :class:`KernelFault` on a bounds miss
        or when the abort word stopped a block in the middle."""
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
        if dynamic_shared < 0:
            raise ValueError(f"negative dynamic shared memory {dynamic_shared}")
        done = self._entry(block_lo, block_hi, gx, gy, gz, bx, by, bz, abort, fault,
                           self.blas, dynamic_shared, *args)
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
        with self._lock:
            ck = self._in_memory(ir, arg_types, options)
            if ck is not None:
                return ck
            k = validate(ir, arg_types)
            inputs = self.key_inputs(ir, arg_types, options)
            source = lower_kernel(k, options)
            key = self._key(inputs, source)
            ck = self._mem.get(key)
            if ck is None:
                ck = self._get_disk(key, inputs, source, k)
                self._mem[key] = ck
            else:
                self.hits += 1
            self._fast.setdefault((ir.get("source"), arg_types, options), []).append(
                (copy.deepcopy(ir.get("params")), ir.get("shared_mem", 0), key))
            return ck

    def cached(self, ir: dict[str, Any], arg_types: tuple[str, ...],
               options: Options = Options()) -> CompiledKernel | None:
        """The compiled kernel if it is already in memory, else None (never compiles: the
        scheduler may run small launches inline only when this costs no compile)."""
        with self._lock:
            return self._in_memory(ir, tuple(arg_types), options)

    def _in_memory(self, ir: dict[str, Any], arg_types: tuple[str, ...],
                   options: Options) -> CompiledKernel | None:
        """The fast path: a kernel seen before with this exact source, params and shared
        memory, without validating or lowering it again (caller holds the lock)."""
        for p, s, key in self._fast.get((ir.get("source"), arg_types, options), ()):
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

    def _get_disk(self, key: str, inputs: dict[str, Any], source: str,
                  k: Kernel) -> CompiledKernel:
        entry = self.entry_dir(key)
        module_name = f"kernel_{key[:16]}.py"
        with self._flock(key):
            if entry.exists():
                if self._valid(entry, key, module_name, source):
                    try:
                        ck, compiled = self._load(entry, key, module_name, source, k)
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
                ck, compiled = self._load(entry, key, module_name, source, k)
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

    def _load(self, entry: Path, key: str, module_name: str, source: str,
              k: Kernel) -> tuple[CompiledKernel, int]:
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
        abort_t = types.Array(types.int64, 1, "C")
        sig = (types.int64, types.int64, types.int64, types.int64, types.int64,
               types.int64, types.int64, types.int64, abort_t, abort_t, abort_t, types.int64,
               *[t.numba_type() for t in k.arg_types])
        disp = mod._grid
        try:
            disp.compile(sig)
        except Exception as exc:  # numba typing/lowering errors are the kernel's
            sys.modules.pop(mod_name, None)
            raise KernelCompileError(f"kernel {k.fn.name!r} does not compile: "
                                     f"{str(exc).splitlines()[0] if str(exc) else exc!r}") from exc
        compiled = 1 if sum(disp.stats.cache_misses.values()) else 0
        ck = CompiledKernel(key, k.fn.name, k.params, k.arg_types, list(k.shared), disp, sig,
                            source, path, self.blas, calls_mma(k.fn.body))
        return ck, compiled

__all__ = ["ABORT_KILL", "ABORT_PREEMPT", "ABORT_WATCHDOG", "FIRMWARE_JIT_ABI",
           "CompiledKernel", "KernelCache", "KernelCompileError", "KernelFault", "Options",
           "compat_key", "lower", "validate"]
