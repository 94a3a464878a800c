"""The accel-emu user-space ABI: every command of the device node and its struct.

This module is the emulator's ``include/uapi/drm/accel_emu.h``. The driver
(``kmod_emul``) and the runtime (``runtime``) both import it and nothing else
defines a command number or a struct layout; what a process shares with the firmware
directly (rings, packets, the doorbell page) is :mod:`abi.userq`. It imports only the
standard library, so importing it never pulls in the driver, pyfuse3 or numba.

Transport (pyfuse3 has no ioctl, so a command is a write/read transaction on the
open device node, see docs/uapi.md):

* ``pwrite(fd, accel_cmd_hdr + payload, 0)`` runs the command. The header names the
  command (encoded like Linux ``_IOWR``: direction, struct size, type, number) and a
  caller-chosen ``tag``. A command that fails makes the write fail with its errno.
* Commands with the READ direction bit leave a reply: exactly the command's struct,
  updated, fetched with ``pread(fd, size, tag)``. Replies are keyed by tag, so threads
  that share one fd each get their own reply without a lock.

Conventions from the Linux accel uAPIs (ivpu, habanalabs, kfd): fixed-width fields,
explicit padding, ``flags`` and ``reserved`` that must be zero, count/size pairs, an
unknown command answers ENOTTY and a malformed one EINVAL.
"""

from __future__ import annotations

import ctypes
import enum
import errno
import os
import struct
from dataclasses import dataclass
from functools import cached_property
from typing import Final

from abi._struct import Struct

# --- ABI version --------------------------------------------------------------------
#: Bumped when a command or struct changes incompatibly. The driver refuses a context
#: whose runtime speaks another major (EPROTO); minors are backward compatible.
ACCEL_ABI_MAJOR: Final = 2
#: 2.1: DEVICE_RESET. 2.2: DEVICE_QUERY reports max_queues_per_process and
#: max_queue_depth (in what was reserved). 2.3: a queue's ring may name its argument arena
#: (abi/userq.py RING_ARGS_VA) and a LAUNCH then names no address; a runtime of 2.3 does,
#: so a driver (and firmware) of 2.2 must refuse it. 2.4: CTX_CREATE names a schedule
#: (``schedule``, ``schedule_fd``, ``seed``, in what was reserved; abi/schedule.py). 2.5:
#: the schedule table holds injected faults (``FAULT`` entries, the ``SCHED_AT`` word and
#: the driver's fault region; abi/schedule.py): a driver of 2.4 would neither record nor
#: replay them. 2.6: the stream memory operations, WAIT_VALUE and WRITE_VALUE packets
#: (abi/userq.py): a firmware of 2.5 faults them as unknown opcodes, so a driver of 2.5
#: must refuse a runtime that may queue them.
ACCEL_ABI_MINOR: Final = 6

# --- _IOC encoding, as in include/uapi/asm-generic/ioctl.h ---------------------------
_IOC_NRBITS, _IOC_TYPEBITS, _IOC_SIZEBITS = 8, 8, 14
_IOC_NRSHIFT = 0
_IOC_TYPESHIFT = _IOC_NRSHIFT + _IOC_NRBITS
_IOC_SIZESHIFT = _IOC_TYPESHIFT + _IOC_TYPEBITS
_IOC_DIRSHIFT = _IOC_SIZESHIFT + _IOC_SIZEBITS
IOC_NONE, IOC_WRITE, IOC_READ = 0, 1, 2

#: The command type byte of this driver ('a' for accel).
ACCEL_IOCTL_BASE: Final = ord("a")


def _ioc(direction: int, nr: int, struct: type[ctypes.Structure]) -> int:
    size = ctypes.sizeof(struct)
    assert size < (1 << _IOC_SIZEBITS), struct
    return (
        (direction << _IOC_DIRSHIFT)
        | (size << _IOC_SIZESHIFT)
        | (ACCEL_IOCTL_BASE << _IOC_TYPESHIFT)
        | (nr << _IOC_NRSHIFT)
    )


def ioc_dir(cmd: int) -> int:
    return (cmd >> _IOC_DIRSHIFT) & 0x3


def ioc_size(cmd: int) -> int:
    return (cmd >> _IOC_SIZESHIFT) & ((1 << _IOC_SIZEBITS) - 1)


def ioc_type(cmd: int) -> int:
    return (cmd >> _IOC_TYPESHIFT) & ((1 << _IOC_TYPEBITS) - 1)


def ioc_nr(cmd: int) -> int:
    return (cmd >> _IOC_NRSHIFT) & ((1 << _IOC_NRBITS) - 1)




# --- transaction header ---------------------------------------------------------------
class accel_cmd_hdr(Struct):
    """Precedes every command's payload in the write."""

    _fields_ = [
        ("cmd", ctypes.c_uint32),  # _IOC-encoded command
        ("flags", ctypes.c_uint32),  # must be 0
        ("tag", ctypes.c_uint64),  # pread offset of the reply; < ACCEL_TAG_LIMIT
    ]


#: The header as the runtime packs it and the driver reads it, in one call: cmd, flags, tag.
CMD_HDR = struct.Struct("<IIQ")
assert CMD_HDR.size == ctypes.sizeof(accel_cmd_hdr)
#: Tags must stay below this so that ``pread(fd, n, tag)`` is a valid offset.
ACCEL_TAG_LIMIT: Final = 1 << 62
#: A context may hold this many unread replies; one more write answers EBUSY.
ACCEL_MAX_PENDING_REPLIES: Final = 256
#: ``pread(fd, buf, n, ACCEL_LAST_ERROR_OFFSET)`` reads why this open file's last refused
#: command was refused: one line of text, ``<COMMAND> <ERRNO>: <reason>\n`` (``write`` for
#: a write refused before its command was known), empty before any refusal, truncated to
#: ``n`` bytes. Reading it takes nothing away. The offset is the first one no tag may use,
#: so it is never a reply's. A raw client's strerror(errno) says which rule it broke; this
#: says how ("doorbell page: 64 bytes, 12288 needed"), as a kernel driver's dmesg line would.
ACCEL_LAST_ERROR_OFFSET: Final = ACCEL_TAG_LIMIT
#: The longest reason kept (longer ones are cut).
ACCEL_LAST_ERROR_MAX: Final = 512

# --- device identity ------------------------------------------------------------------


class DeviceState(enum.IntEnum):
    """Lifecycle of a device as the driver reports it (sysfs ``state``)."""

    BOOTING = 1
    OPERATIONAL = 2
    IN_RESET = 3
    FAILED = 4

    @property
    def label(self) -> str:
        return self.name.lower()


class Cap(enum.IntFlag):
    """Capability bits of ``accel_device_info.capabilities`` (sysfs ``capabilities``)."""

    NOOP = 1 << 0
    COPY = 1 << 1
    COMPUTE = 1 << 2
    FP64 = 1 << 3
    ATOMICS = 1 << 4
    SHARED_MEM = 1 << 5
    TIMESTAMPS = 1 << 6
    EXCLUSIVE_MODE = 1 << 7
    MULTI_CONTEXT = 1 << 8
    #: A matrix unit: kernels may use mma() (float32/float64 tiles, firmware/matrix.py).
    MATRIX = 1 << 9


_CAP_BITS: Final[dict[str, int]] = {c.name.lower(): int(c) for c in Cap if c.name}


def caps_to_names(caps: int) -> list[str]:
    return [name for name, bit in _CAP_BITS.items() if caps & bit]


def names_to_caps(names: list[str]) -> int:
    return sum(_CAP_BITS[name] for name in set(names))


_S = ctypes.c_char


class accel_version(Struct):
    """ACCEL_CMD_GET_VERSION: the driver's ABI and build."""

    _fields_ = [
        ("abi_major", ctypes.c_uint32),
        ("abi_minor", ctypes.c_uint32),
        ("driver_version", _S * 32),
        ("reserved", ctypes.c_uint64 * 4),
    ]


class accel_device_info(Struct):
    """ACCEL_CMD_DEVICE_QUERY: identity, versions, capabilities, limits and state."""

    _fields_ = [
        ("index", ctypes.c_uint32),
        ("state", ctypes.c_uint32),  # DeviceState
        ("numa_node", ctypes.c_int32),
        ("package_id", ctypes.c_uint32),
        ("partition_id", ctypes.c_uint32),
        ("compute_engines", ctypes.c_uint32),
        ("copy_engines", ctypes.c_uint32),
        ("max_threads_per_block", ctypes.c_uint32),
        ("max_shared_mem_per_block", ctypes.c_uint32),
        ("max_contexts", ctypes.c_uint32),  # contexts on the device, all processes
        ("capabilities", ctypes.c_uint64),  # Cap
        ("memory_total", ctypes.c_uint64),
        ("memory_used", ctypes.c_uint64),
        ("name", _S * 64),
        ("uuid", _S * 48),
        ("serial", _S * 32),
        ("pci_bus_id", _S * 16),
        ("fabric_endpoint", _S * 32),
        ("driver_version", _S * 16),
        ("firmware_version", _S * 16),
        ("isa_version", _S * 16),
        ("isa_stepping", _S * 8),
        # --- enforced limits (docs/containment.md): one tenant cannot take the device ---
        ("max_contexts_per_process", ctypes.c_uint32),
        ("max_queues_per_context", ctypes.c_uint32),
        ("max_queues", ctypes.c_uint32),  # queues on the device, all contexts
        ("max_modules_per_context", ctypes.c_uint32),
        ("max_pinned_bytes_per_process", ctypes.c_uint64),  # host-pinned + managed
        ("max_pinned_bytes", ctypes.c_uint64),  # ... on the device, all processes
        ("max_host_allocations_per_process", ctypes.c_uint32),
        ("max_module_bytes_per_context", ctypes.c_uint32),
        ("max_queues_per_process", ctypes.c_uint32),  # 2.2
        #: packets the firmware admits on one queue past what it has taken (2.2; 0 from
        #: an older driver, whose rings hold userq.RING_SLOTS)
        ("max_queue_depth", ctypes.c_uint32),
        ("reserved", ctypes.c_uint64 * 7),
    ]


_INFO_STATE, _INFO_STATE_OFF = struct.Struct("<I"), accel_device_info.state.offset
_INFO_MEMORY_USED = struct.Struct("<Q")
_INFO_MEMORY_USED_OFF = accel_device_info.memory_used.offset


def device_info_now(static: bytes, state: int, memory_used: int) -> bytes:
    """``static`` (an ``accel_device_info``'s bytes) with the two fields that change after
    boot set: the driver's DEVICE_QUERY answer, written into a copy of the bytes (building
    the struct per query cost 2.5 us, an eighth of the driver's part of the round trip)."""
    info = bytearray(static)
    _INFO_STATE.pack_into(info, _INFO_STATE_OFF, state)
    _INFO_MEMORY_USED.pack_into(info, _INFO_MEMORY_USED_OFF, memory_used)
    return bytes(info)


# --- contexts -------------------------------------------------------------------------

#: ``accel_ctx_create.flags``: hold the device exclusively (like a partition owned by one
#: tenant): refused with EBUSY while another process has it open, and while held every
#: other process's open answers EBUSY.
ACCEL_CTX_EXCLUSIVE: Final = 1 << 0
#: ``accel_ctx_create.flags``: the context is a diagnostic's (``accel-diag``), which faults
#: on purpose: its fault records carry ``origin`` "diag" and the tenant fault counters
#: (sysfs ``faults``, ``accel_faults_total``) leave them out, as ``dcgmi diag`` leaves no
#: XIDs. Only root may set it (EPERM, counted in ``isolation/``): a tenant must not hide
#: its own faults by claiming to be a diagnostic.
ACCEL_CTX_DIAGNOSTIC: Final = 1 << 1
ACCEL_CTX_FLAGS_MASK: Final = ACCEL_CTX_EXCLUSIVE | ACCEL_CTX_DIAGNOSTIC


class accel_ctx_create(Struct):
    """ACCEL_CMD_CTX_CREATE: turn this open file into a context (one open = one context).

    The process brings the context's three shared objects itself, as file descriptors of
    its own that the driver imports (docs/containment.md, "Client memory"): the read end
    of a pipe it writes one byte to when the firmware sleeps (``doorbell_fd``), the write
    end of a pipe the device writes one byte to when something a waiter armed happened
    (``event_fd``), and the doorbell page (``db_page_fd``, a sealed memfd of
    ``userq.ACCEL_DB_PAGE_SIZE`` bytes, laid out as :mod:`abi.userq` says). The process may close
    its copies of the two pipe ends the driver took once this returns.
    """

    _fields_ = [
        ("abi_major", ctypes.c_uint32),  # in: the runtime's ACCEL_ABI_MAJOR
        ("abi_minor", ctypes.c_uint32),  # in
        ("flags", ctypes.c_uint32),  # in: ACCEL_CTX_*
        ("doorbell_fd", ctypes.c_int32),  # in: pipe read end
        ("event_fd", ctypes.c_int32),  # in: pipe write end
        ("db_page_fd", ctypes.c_int32),  # in: sealed memfd, userq.ACCEL_DB_PAGE_SIZE bytes
        ("ctx_id", ctypes.c_uint64),  # out: unique on the device, never reused
        #: in (2.4): the context's schedule, abi.schedule.Mode | SCHED_RECORD (0: the
        #: default); ``schedule_fd`` the decision table (a sealed memfd of
        #: abi.schedule.SCHED_FILE_SIZE bytes), read only when the schedule is a replay or
        #: records; ``seed`` the adversarial schedule's (docs/schedule.md)
        ("schedule", ctypes.c_uint32),
        ("schedule_fd", ctypes.c_int32),
        ("seed", ctypes.c_uint64),
    ]


class accel_ctx_destroy(Struct):
    """ACCEL_CMD_CTX_DESTROY: tear the context down; the fd may create a new one."""

    _fields_ = [
        ("ctx_id", ctypes.c_uint64),
        ("flags", ctypes.c_uint32),
        ("pad", ctypes.c_uint32),
    ]


class accel_device_reset(Struct):
    """ACCEL_CMD_DEVICE_RESET: reset the device this context holds exclusively.

    A reset destroys every context on the device, so only a context made with
    ``ACCEL_CTX_EXCLUSIVE`` may ask for one (EPERM otherwise): while it lives no other
    process can have the device open, so the only state lost is the caller's own process's.
    Returns once the reset is requested, as a sysfs ``reset`` write does: the device reads
    ``in_reset`` until the reset's boot is done, and the caller's context is lost like
    every other (its next command answers ENODEV).
    """

    _fields_ = [
        ("ctx_id", ctypes.c_uint64),
        ("flags", ctypes.c_uint32),
        ("pad", ctypes.c_uint32),
    ]


# --- submission -------------------------------------------------------------------------


class accel_submit_noop(Struct):
    """ACCEL_CMD_SUBMIT_NOOP: queue a no-op on the firmware; returns its fence seqno."""

    _fields_ = [
        ("ctx_id", ctypes.c_uint64),  # in: must be this fd's context
        ("flags", ctypes.c_uint32),
        ("pad", ctypes.c_uint32),
        ("seqno", ctypes.c_uint64),  # out: completes when the firmware has run it
    ]


class accel_wait(Struct):
    """ACCEL_CMD_WAIT: has the context's default queue (the one SUBMIT_NOOP uses)
    completed ``seqno``? It never blocks: a FUSE request holds the device node for every
    tenant while it runs (docs/containment.md), so waiting happens in the caller. Answers
    0 once complete; ETIME when not yet, after arming the queue's interrupt, so the
    context's event pipe gets a byte once it completes (poll it, then ask again); EINVAL
    for a seqno never submitted; ENODEV if the context was lost. A packet that faulted
    does not fail the wait: the reply's ``error_*`` fields name it (the error surfaces at
    the synchronisation point). The queues a process makes itself it waits on in shared
    memory (their rings), never here.
    """

    _fields_ = [
        ("ctx_id", ctypes.c_uint64),
        ("seqno", ctypes.c_uint64),
        ("flags", ctypes.c_uint32),
        ("pad", ctypes.c_uint32),
        ("completed", ctypes.c_uint64),  # out: the queue's completed seqno
        ("timestamp_ns", ctypes.c_uint64),  # out: device time that seqno completed
        ("error_seqno", ctypes.c_uint64),  # out: first faulted packet's seqno, 0 if none
        ("error_code", ctypes.c_uint32),  # out: its errno (EFAULT, EINVAL, ...)
        ("error_opcode", ctypes.c_uint32),  # out: its packet opcode
        ("error_addr", ctypes.c_uint64),  # out: the faulting device address, where one
    ]


# --- memory ---------------------------------------------------------------------------------


class MemKind(enum.IntEnum):
    """Allocation classes (``accel_mem_alloc.kind``)."""

    #: Device-local: never mapped into a host process; reached by copies and kernels.
    DEVICE = 0
    #: Host memory pinned for the copy engines: mapped into the process and the device.
    HOST_PINNED = 1
    #: Managed (unified): host- and device-visible; the device migrates pages on access,
    #: may hold more than device memory (oversubscription), and reports what that cost.
    MANAGED = 2


#: Device virtual addresses: bits 44.. name the device (index + 1), so an address is unique
#: across the devices of a process and a peer access can be told from a local one.
ACCEL_VA_DEVICE_SHIFT: Final = 44
#: Allocations are placed (and sized, in the device's books) at this granularity.
ACCEL_PAGE_SIZE: Final = 4096



class accel_mem_alloc(Struct):
    """ACCEL_CMD_MEM_ALLOC: allocate ``size`` bytes of ``kind`` in the context.

    Device-local memory comes from the device (``fd`` must be -1). Host-visible kinds are
    the caller's own memory, *pinned* for the device (cudaHostRegister, KFD userptr): a
    memfd of at least ``size`` bytes sealed with ``ACCEL_SEALS_PINNED`` (so no one can
    shrink it under the device), which the driver imports and the device maps.
    """

    _fields_ = [
        ("ctx_id", ctypes.c_uint64),
        ("size", ctypes.c_uint64),
        ("kind", ctypes.c_uint32),  # MemKind
        ("flags", ctypes.c_uint32),
        ("fd", ctypes.c_int32),  # host kinds: the sealed memfd; device-local: -1
        ("pad", ctypes.c_uint32),
        ("handle", ctypes.c_uint64),  # out
        ("va", ctypes.c_uint64),  # out
    ]


class accel_mem_free(Struct):
    """ACCEL_CMD_MEM_FREE: release an allocation (or an import) of the context."""

    _fields_ = [
        ("ctx_id", ctypes.c_uint64),
        ("handle", ctypes.c_uint64),
    ]


class accel_mem_export(Struct):
    """ACCEL_CMD_MEM_EXPORT: make a device-local allocation importable; returns the secret
    token. Host memory is the caller's own and is shared with the OS's means (EINVAL).

    The IPC handle another process needs is (device uuid, ``export_id``, ``token``).
    Lifetime (like dma-buf): the memory lives while the exporter or any importer holds it;
    an exporter that frees or dies leaves importers' mappings valid.
    """

    _fields_ = [
        ("ctx_id", ctypes.c_uint64),
        ("handle", ctypes.c_uint64),
        ("token", ctypes.c_uint64),  # out: the secret an importer must present
        ("export_id", ctypes.c_uint64),  # out: names the memory itself on the device
    ]


class accel_mem_import(Struct):
    """ACCEL_CMD_MEM_IMPORT: map another context's exported allocation into this one."""

    _fields_ = [
        ("ctx_id", ctypes.c_uint64),
        ("export_handle", ctypes.c_uint64),
        ("token", ctypes.c_uint64),
        ("handle", ctypes.c_uint64),  # out: this context's handle for it
        ("va", ctypes.c_uint64),  # out
        ("size", ctypes.c_uint64),  # out
        ("kind", ctypes.c_uint32),  # out
        ("pad", ctypes.c_uint32),
    ]


class accel_mem_info(Struct):
    """ACCEL_CMD_MEM_INFO: free and total device memory, and what this caller holds."""

    _fields_ = [
        ("ctx_id", ctypes.c_uint64),
        ("free", ctypes.c_uint64),  # out: device memory not allocated or resident
        ("total", ctypes.c_uint64),  # out
        ("context_bytes", ctypes.c_uint64),  # out: device-local bytes this context holds
        ("process_bytes", ctypes.c_uint64),  # out: ... that this process holds (all contexts)
        ("process_limit", ctypes.c_uint64),  # out: per-process cap, 0 if none
        ("managed_resident", ctypes.c_uint64),  # out: managed bytes resident on the device
        ("pending_free", ctypes.c_uint64),  # out: freed by this process, not yet back
        ("pinned_bytes", ctypes.c_uint64),  # out: host memory this process pinned here
        ("reserved", ctypes.c_uint64 * 2),
    ]


class accel_peer_enable(Struct):
    """ACCEL_CMD_PEER_ENABLE: let this context's work reach device ``peer_index``'s memory.

    The caller's process must hold a context on the peer; that context's device-local
    allocations (now and later) become reachable from this one's queues.
    """

    _fields_ = [
        ("ctx_id", ctypes.c_uint64),
        ("peer_index", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
    ]


# --- modules and kernels ------------------------------------------------------------------------
ACCEL_KERNEL_NAME_MAX: Final = 64
#: Most bytes a module's IR may have, and characters a kernel's source in it. Both are parsed by
#: code that holds the interpreter lock of the driver and of the firmware, so their size
#: bounds how long one tenant's load can hold them (docs/containment.md).
ACCEL_MODULE_MAX: Final = 1 << 20
ACCEL_KERNEL_SOURCE_MAX: Final = 64 << 10


class accel_module_load(Struct):
    """ACCEL_CMD_MODULE_LOAD: load a device module (its IR, JSON, docs/kernels.md).

    The module is the first ``size`` bytes of a memfd of the caller's sealed with
    ``ACCEL_SEALS_IMMUTABLE``, so no one can change it after the driver checked it. The
    driver checks the format, the target and the capabilities the kernels need and hands
    it to the firmware, which validates the kernels again before compiling them.
    """

    _fields_ = [
        ("ctx_id", ctypes.c_uint64),
        ("size", ctypes.c_uint64),
        ("fd", ctypes.c_int32),
        ("flags", ctypes.c_uint32),
        ("kernel_count", ctypes.c_uint32),  # out
        ("pad", ctypes.c_uint32),
        ("module_id", ctypes.c_uint64),  # out
    ]


class accel_module_unload(Struct):
    """ACCEL_CMD_MODULE_UNLOAD: its kernel handles die with it."""

    _fields_ = [
        ("ctx_id", ctypes.c_uint64),
        ("module_id", ctypes.c_uint64),
    ]


class accel_kernel_get(Struct):
    """ACCEL_CMD_KERNEL_GET: resolve a kernel by name in a loaded module (a symbol)."""

    _fields_ = [
        ("ctx_id", ctypes.c_uint64),
        ("module_id", ctypes.c_uint64),
        ("name", _S * ACCEL_KERNEL_NAME_MAX),
        ("handle", ctypes.c_uint64),  # out: what LAUNCH packets name
        ("param_count", ctypes.c_uint32),  # out
        ("shared_mem", ctypes.c_uint32),  # out: static block-shared bytes
    ]


# --- queues (their layout, packets and doorbells: abi.userq) ----------------------------------
#: ``accel_queue_create.priority``: the firmware takes a high-priority queue's packets first
#: and preempts low-priority engine work for them between chunks and time slices.
ACCEL_QUEUE_PRIORITY_LOW: Final = 0
ACCEL_QUEUE_PRIORITY_HIGH: Final = 1


class accel_queue_create(Struct):
    """ACCEL_CMD_QUEUE_CREATE: a user-mode hardware queue (a stream's backing).

    The ring is the caller's memory, as KFD's are: a memfd of ``userq.RING_FILE_SIZE``
    bytes sealed with ``ACCEL_SEALS_PINNED`` (``ring_fd``), laid out as :mod:`abi.userq` says. The
    caller writes packets and advances ``wptr``, then writes ``wptr`` into its slot
    ``doorbell`` of the context's doorbell page and bumps the page's sequence word; the
    firmware consumes the packets and writes the fence, timestamps and the first fault.
    Submitting takes no system call unless the firmware sleeps (``userq.DB_FW_SLEEPING``), and
    then one byte written to the context's doorbell pipe.
    """

    _fields_ = [
        ("ctx_id", ctypes.c_uint64),
        ("priority", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("ring_fd", ctypes.c_int32),  # in: sealed memfd, userq.RING_FILE_SIZE bytes
        ("doorbell", ctypes.c_uint32),  # out: this queue's slot in the doorbell page
        ("queue_id", ctypes.c_uint64),  # out
    ]


class accel_queue_destroy(Struct):
    """ACCEL_CMD_QUEUE_DESTROY: the queue's queued work still runs to completion first."""

    _fields_ = [
        ("ctx_id", ctypes.c_uint64),
        ("queue_id", ctypes.c_uint64),
    ]


class accel_queue_import(Struct):
    """ACCEL_CMD_QUEUE_IMPORT: make another device's queue of this process waitable here.

    Returns a local queue id that WAIT_QUEUE packets of this context may name, so a stream
    waits for an event of another device on the device, without the host.
    """

    _fields_ = [
        ("ctx_id", ctypes.c_uint64),
        ("peer_index", ctypes.c_uint32),
        ("pad", ctypes.c_uint32),
        ("peer_queue_id", ctypes.c_uint64),
        ("queue_id", ctypes.c_uint64),  # out: the local name of that queue's fence
    ]


# --- client memory: sealed memfds --------------------------------------------------------------
#: fcntl(2) file-seal commands and bits (linux/fcntl.h).
F_ADD_SEALS: Final = 1033
F_GET_SEALS: Final = 1034
F_SEAL_SEAL, F_SEAL_SHRINK, F_SEAL_GROW, F_SEAL_WRITE = 0x1, 0x2, 0x4, 0x8
F_SEAL_FUTURE_WRITE: Final = 0x10
#: Memory the device maps and writes (rings, pinned and managed memory, the doorbell
#: page): its size is fixed for good, so no one can truncate it under the device (a
#: device access past the end would be a SIGBUS of the firmware, every tenant's loss).
ACCEL_SEALS_PINNED: Final = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL
#: Memory the device only reads once checked (module images): immutable as well.
ACCEL_SEALS_IMMUTABLE: Final = ACCEL_SEALS_PINNED | F_SEAL_WRITE

# --- the command table ---------------------------------------------------------------------


@dataclass(frozen=True)
class Command:
    """One entry of the command table shared by driver and runtime."""

    name: str
    code: int
    struct: type[Struct]

    # computed once: the driver asks on every command (cached_property writes the
    # instance's __dict__, which a frozen dataclass allows)
    @cached_property
    def has_reply(self) -> bool:
        return bool(ioc_dir(self.code) & IOC_READ)

    @cached_property
    def size(self) -> int:
        """The struct's size in bytes."""
        return ctypes.sizeof(self.struct)


def _cmd(name: str, direction: int, nr: int, struct: type[Struct]) -> Command:
    return Command(name, _ioc(direction, nr, struct), struct)


ACCEL_CMD_GET_VERSION = _cmd("GET_VERSION", IOC_READ, 0x00, accel_version)
ACCEL_CMD_DEVICE_QUERY = _cmd("DEVICE_QUERY", IOC_READ, 0x01, accel_device_info)
ACCEL_CMD_CTX_CREATE = _cmd("CTX_CREATE", IOC_READ | IOC_WRITE, 0x02, accel_ctx_create)
ACCEL_CMD_CTX_DESTROY = _cmd("CTX_DESTROY", IOC_WRITE, 0x03, accel_ctx_destroy)
ACCEL_CMD_SUBMIT_NOOP = _cmd("SUBMIT_NOOP", IOC_READ | IOC_WRITE, 0x04, accel_submit_noop)
ACCEL_CMD_WAIT = _cmd("WAIT", IOC_READ | IOC_WRITE, 0x05, accel_wait)
ACCEL_CMD_MEM_ALLOC = _cmd("MEM_ALLOC", IOC_READ | IOC_WRITE, 0x06, accel_mem_alloc)
ACCEL_CMD_MEM_FREE = _cmd("MEM_FREE", IOC_WRITE, 0x07, accel_mem_free)
ACCEL_CMD_MEM_EXPORT = _cmd("MEM_EXPORT", IOC_READ | IOC_WRITE, 0x08, accel_mem_export)
ACCEL_CMD_MEM_IMPORT = _cmd("MEM_IMPORT", IOC_READ | IOC_WRITE, 0x09, accel_mem_import)
ACCEL_CMD_MEM_INFO = _cmd("MEM_INFO", IOC_READ | IOC_WRITE, 0x0A, accel_mem_info)
ACCEL_CMD_PEER_ENABLE = _cmd("PEER_ENABLE", IOC_WRITE, 0x0B, accel_peer_enable)
ACCEL_CMD_QUEUE_CREATE = _cmd("QUEUE_CREATE", IOC_READ | IOC_WRITE, 0x0C, accel_queue_create)
ACCEL_CMD_QUEUE_DESTROY = _cmd("QUEUE_DESTROY", IOC_WRITE, 0x0D, accel_queue_destroy)
ACCEL_CMD_QUEUE_IMPORT = _cmd("QUEUE_IMPORT", IOC_READ | IOC_WRITE, 0x0E, accel_queue_import)
ACCEL_CMD_MODULE_LOAD = _cmd("MODULE_LOAD", IOC_READ | IOC_WRITE, 0x0F, accel_module_load)
ACCEL_CMD_MODULE_UNLOAD = _cmd("MODULE_UNLOAD", IOC_WRITE, 0x10, accel_module_unload)
ACCEL_CMD_KERNEL_GET = _cmd("KERNEL_GET", IOC_READ | IOC_WRITE, 0x11, accel_kernel_get)
ACCEL_CMD_DEVICE_RESET = _cmd("DEVICE_RESET", IOC_WRITE, 0x12, accel_device_reset)

COMMANDS: Final[dict[int, Command]] = {
    c.code: c
    for c in (
        ACCEL_CMD_GET_VERSION,
        ACCEL_CMD_DEVICE_QUERY,
        ACCEL_CMD_CTX_CREATE,
        ACCEL_CMD_CTX_DESTROY,
        ACCEL_CMD_SUBMIT_NOOP,
        ACCEL_CMD_WAIT,
        ACCEL_CMD_MEM_ALLOC,
        ACCEL_CMD_MEM_FREE,
        ACCEL_CMD_MEM_EXPORT,
        ACCEL_CMD_MEM_IMPORT,
        ACCEL_CMD_MEM_INFO,
        ACCEL_CMD_PEER_ENABLE,
        ACCEL_CMD_QUEUE_CREATE,
        ACCEL_CMD_QUEUE_DESTROY,
        ACCEL_CMD_QUEUE_IMPORT,
        ACCEL_CMD_MODULE_LOAD,
        ACCEL_CMD_MODULE_UNLOAD,
        ACCEL_CMD_KERNEL_GET,
        ACCEL_CMD_DEVICE_RESET,
    )
}
COMMANDS_BY_NR: Final[dict[int, Command]] = {ioc_nr(c.code): c for c in COMMANDS.values()}

# --- errno contract ---------------------------------------------------------------------------
#: What each errno means when a device node's open(2) or a command fails. The runtime's
#: messages quote it (runtime/_channel.py); docs/uapi.md says the same at more length.
#: tests/driver/test_errno_contract.py holds it to what the driver answers on a mount.
ERRNO_MEANING: Final[dict[int, str]] = {
    errno.ENOTTY: "unknown command",
    errno.EINVAL: "malformed command (size, reserved field, flag or value); a descriptor of "
                  "the right kind but too small, or a pipe's other end",
    errno.ENOMSG: "no reply pending for that tag",
    errno.EBUSY: "device held exclusively by another process, or too many unread replies",
    errno.EDQUOT: "over a per-process or per-context limit (contexts, queues, pinned "
                  "memory, host allocations, modules); sys/class/accel/accelN/limits shows them",
    errno.ENOSPC: "a device-wide table is full (contexts or queues of all processes)",
    errno.EOPNOTSUPP: "a kernel of the module needs a capability the device lacks",
    errno.EBADF: "a file descriptor the command names is not one this process holds",
    errno.EEXIST: "a reply with that tag is still unread",
    errno.EBADFD: "command needs a context and this open file has none",
    errno.ENOENT: "no such handle: nobody on the device holds that context, queue, "
                  "allocation, module or export (never made, or freed), or the module has no "
                  "kernel of that name",
    errno.EPROTO: "runtime ABI not supported by the driver",
    errno.ENOPKG: "firmware image missing",
    errno.ENOEXEC: "firmware image corrupt or incompatible",
    errno.EIO: "firmware failed to boot",
    errno.EAGAIN: "device in reset",
    errno.ENODEV: "device or context lost (firmware crash, hang, reset or removal)",
    errno.ETIME: "wait timed out",
    errno.ENOMEM: "out of device memory (or over the per-process limit)",
    errno.EFAULT: "a packet named an address outside the context's mappings",
    errno.ECANCELED: "the queue faulted earlier; destroy and recreate it",
    errno.EPERM: "the handle is held by another open file's context (counted in "
                 "sys/class/accel/accelN/isolation); peer access needs a context of this "
                 "process on the peer device; a device reset needs a context that holds the "
                 "device exclusively; a diagnostic context (ACCEL_CTX_DIAGNOSTIC) is root's; "
                 "the driver may not reach this process's descriptors",
    errno.EACCES: "MEM_IMPORT of an allocation not exported, or with the wrong token; an "
                  "attribute only root may read or write (counted in "
                  "sys/class/accel/accelN/isolation)",
    errno.EMEDIUMTYPE: "a file descriptor the command names is not the kind of object it "
                       "needs: a memfd sealed as it needs, or a pipe",
}


def cstr(raw: bytes) -> str:
    """Decode a fixed-size NUL-padded char field."""
    return raw.split(b"\0", 1)[0].decode()


# --- where the device tree lives (docs/contract.md "Environment") ----------------------------
def default_root() -> str:
    """``$ACCEL_EMU_ROOT``, else /run/accel-emu for root, else a per-user runtime dir."""
    if root := os.environ.get("ACCEL_EMU_ROOT"):
        return root
    if os.geteuid() == 0:
        return "/run/accel-emu"
    if xdg := os.environ.get("XDG_RUNTIME_DIR"):
        return os.path.join(xdg, "accel-emu")
    return f"/tmp/accel-emu-{os.getuid()}"


#: Paths below the root, shared by the driver that serves them and the tools that read them.
DEV_DIR: Final = "dev/accel"
CLASS_DIR: Final = "sys/class/accel"
DEBUG_DIR: Final = "sys/kernel/debug/accel"
#: A device's fault event stream, ``EVENTS_DIR/accelN``: a character-device-like node (read
#: blocks, poll works), as /dev/kmsg is, and so outside sysfs, whose files never block.
EVENTS_DIR: Final = "dev/accel-events"
MODULE_DIR: Final = "sys/module/accel_emu"
