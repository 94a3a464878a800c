"""The attribute tree: ``sys/class/accel/accelN``, ``sys/kernel/debug`` and ``sys/module``.

One small text file per value, as in Linux sysfs. Identity attributes come from the same
``AccelDevice.describe`` that answers DEVICE_QUERY, so the two can never disagree. Writable
attributes take one value per write (printable ASCII, at most a page, each number read by
one parser with its range: kmod_emul/attr.py): ``reset`` (write 1), and the debugfs
fault-injection knobs ``fw_boot_fail``, ``fw_hang``, ``reset_hold``, ``fail_step`` (a
bring-up step's name, or ``none``: the device's next bring-ups fail at that step, see
:mod:`kmod_emul.bringup`), ``map_fail`` (N: the device's next N device-local MAPs fail
in the firmware, so each makes a MAP_FAILED record) and ``ras_ctrl`` (``inject BLOCK ue|ce
ADDRESS``, see :mod:`kmod_emul.ras`); a physical device's ``partition_fail_step`` is
:mod:`kmod_emul.partition`'s.

Who sees what (docs/containment.md): writing any attribute is root's, as sysfs files are
root's 0200 and 0644; debugfs is root's alone, as ``/sys/kernel/debug`` is 0700, and so is a
device's ``devcoredump/`` (Linux's devcoredump ``data`` is 0600: a dump names every
tenant); and an attribute that names other tenants' processes (``processes``,
``exclusive_owner``) shows a user only their own, as DRM fdinfo shows a process only to who
may ptrace it.
"""

from __future__ import annotations

import errno
import functools
import os
from collections.abc import Awaitable, Callable

from abi import faults, mailbox, uapi
from kmod_emul.activity import POWER_LIMIT_W, fdinfo
from kmod_emul.attr import Attr, Writer, parse_number
from kmod_emul.boot import STEP_NAMES
from kmod_emul.device import AccelDevice
from kmod_emul.drv import DriverInfo
from kmod_emul.errors import DriverError


def _visible(dev: AccelDevice, uid: int) -> set[int]:
    """The pids whose details ``uid`` may see: all for root, else that user's own."""
    return {f.pid for f in dev.files if uid == 0 or f.uid == uid}


def _bool(text: str) -> bool:
    value = text.strip()
    if value not in ("0", "1"):
        raise DriverError(errno.EINVAL, f"expected 0 or 1, got {value!r}")
    return value == "1"


def _format(field: str, value: object) -> str:
    if isinstance(value, bytes):
        return uapi.cstr(value)
    if field == "capabilities":
        return " ".join(uapi.caps_to_names(int(value)))  # type: ignore[arg-type]
    return str(value)


#: Description fields that change between boots; rendered live on every read.
_LIVE: dict[str, Callable[[AccelDevice], str]] = {
    "state": lambda dev: dev.state.label,
    "memory_used": lambda dev: str(dev.memory_used),
}


@functools.lru_cache(maxsize=64)
def _static_text(static: bytes) -> dict[str, str]:
    """The per-boot fields of a device description as text, cached per description."""
    raw = uapi.accel_device_info.from_buffer_copy(static)
    return {
        name: _format(name, getattr(raw, name))
        for name, *_ in raw._fields_
        if not name.startswith(("pad", "reserved")) and name not in _LIVE
    }


def _static_field(dev: AccelDevice, field: str) -> str:
    return _static_text(dev.static_description())[field]


def _fw_stat(dev: AccelDevice, name: str) -> str:
    """A firmware counter (of its current life)."""
    return str(dev.fw_stats().get(name, 0))


def device_attrs(dev: AccelDevice) -> dict[str, Attr]:
    """``sys/class/accel/accelN/*``."""
    attrs = {
        field: Attr(read=functools.partial(_static_field, dev, field))
        for field in _static_text(dev.static_description())
    }
    attrs.update({name: Attr(read=functools.partial(fn, dev)) for name, fn in _LIVE.items()})

    def reset(text: str, writer: Writer) -> None:
        """The reason names who asked, as an operator reading ``reset_reason`` needs."""
        if not _bool(text):
            raise DriverError(errno.EINVAL, "write 1 to reset the device")
        dev.resets.request(f"reset requested through sysfs by {writer.describe()}",
                           faults.ORIGIN_REQUESTED)

    attrs.update(
        failure=Attr(read=lambda: dev.failure[1] if dev.failure else ""),
        failure_code=Attr(
            read=lambda: errno.errorcode.get(dev.failure[0], "") if dev.failure else ""
        ),
        exclusive_owner=Attr(read=functools.partial(_exclusive_owner, dev), per_viewer=True),
        contexts=Attr(read=lambda: str(len(dev.contexts))),
        open_files=Attr(read=lambda: str(len(dev.files))),
        clients=Attr(read=lambda: str(len(dev.tenants.client_pids()))),
        completions=Attr(read=lambda: str(dev.fw_stats().get("packets", 0))),
        reset_count=Attr(read=lambda: str(dev.reset_count)),
        # why and when the last reset was (a recovery says what it recovered from)
        reset_reason=Attr(read=lambda: dev.reset_reason),
        last_reset=Attr(read=lambda: f"{dev.last_reset:.3f}" if dev.last_reset else ""),
        # the last failure, kept after the reset that recovered it ("CODE message")
        last_failure=Attr(read=lambda: (f"{errno.errorcode.get(dev.last_failure[0], '')} "
                                        f"{dev.last_failure[1]}") if dev.last_failure else ""),
        last_failure_time=Attr(read=lambda: f"{dev.last_failure[2]:.3f}"
                               if dev.last_failure else ""),
        heartbeat=Attr(read=lambda: str(dev.fw.mbx.heartbeat[0]) if dev.fw else "0"),
        reset=Attr(write=reset, with_writer=True),
        memory_free=Attr(read=lambda: str(dev.memory.free_bytes())),
        # bad pages out of the free list: total = used + free + reserved (kmod_emul/ras.py)
        memory_reserved=Attr(read=lambda: str(dev.memory.vram.reserved)),
        processes=Attr(read=functools.partial(_processes, dev), per_viewer=True),
        # the last fault records, one JSON line each (kmod_emul/faultlog.py)
        fault_log=Attr(read=dev.faults.render, per_viewer=True),
        # the fabric port (kmod_emul/link.py) and the thermal model (kmod_emul/thermal.py)
        link_state=Attr(read=lambda: dev.link.state),
        temperature=Attr(read=lambda: f"{dev.thermal.temperature():.0f}"),
        # engine use over the last second, power, per-client time (kmod_emul/activity.py)
        utilization=Attr(read=lambda: str(dev.activity.utilization("compute"))),
        utilization_copy=Attr(read=lambda: str(dev.activity.utilization("copy"))),
        power=Attr(read=lambda: f"{dev.activity.power():.1f}"),
        power_limit=Attr(read=lambda: f"{POWER_LIMIT_W:.1f}"),
        fdinfo=Attr(read=functools.partial(fdinfo, dev), per_viewer=True),
        clock=Attr(read=lambda: str(dev.thermal.clock_mhz())),
        throttle_reasons=Attr(read=dev.thermal.throttle_reasons),
        # the bad-page table, amdgpu's format (kmod_emul/ras.py; counters under ras/)
        bad_pages=Attr(read=dev.ras.bad_pages),
        retired_pages=Attr(read=dev.ras.retired_pages),
        queues=Attr(read=lambda: str(dev.tenants.queue_count())),
        pinned_bytes=Attr(read=lambda: str(dev.memory.pinned_bytes())),
        host_allocations=Attr(read=lambda: str(dev.memory.host_allocations())),
    )
    attrs.update({name: Attr(read=functools.partial(_fw_stat, dev, name)) for name in mailbox.STAT_NAMES})
    # not the firmware's: the driver's count of tenants' faults, of every firmware life
    attrs["faults"] = Attr(read=lambda: str(dev.tenant_faults))
    return attrs


def reset_mask_attrs() -> dict[str, Attr]:
    """``sys/class/accel/accelN/<engine>_reset_mask``: the reset scopes the stack implements
    for that engine's faults (``abi.faults.RESET_SCOPES``), as amdgpu's ``gfx_reset_mask``."""
    return {f"{engine}_reset_mask": Attr(read=functools.partial(" ".join,
                                                                faults.reset_mask(engine)))
            for engine in faults.ENGINES}


def limit_attrs(dev: AccelDevice) -> dict[str, Attr]:
    """``sys/class/accel/accelN/limits/*``: every limit the driver enforces."""
    return {name: Attr(read=functools.partial(lambda n: str(getattr(dev.limits, n)), name))
            for name in dev.limits.__dataclass_fields__}


def _exclusive_owner(dev: AccelDevice, uid: int) -> str:
    owner = dev.tenants.exclusive_owner()
    if owner is None:
        return ""
    return str(owner.file.pid) if owner.file.pid in _visible(dev, uid) else "another user"


def _processes(dev: AccelDevice, uid: int) -> str:
    """pid and device-local bytes of each process holding memory, as ``uid`` may see."""
    seen = _visible(dev, uid)
    rows = [f"{pid} {n}" for pid, n in sorted(dev.memory.pid_bytes().items())
            if pid in seen or uid == 0]
    return "\n".join(["pid device_bytes", *rows])


def debug_attrs(dev: AccelDevice) -> dict[str, Attr]:
    """``sys/kernel/debug/accel/accelN/*``: introspection and fault injection."""

    def fw_hang(text: str) -> None:
        if not _bool(text):
            raise DriverError(errno.EINVAL, "write 1 to hang the firmware")
        dev.resets.hang_firmware()

    def contexts() -> str:
        rows = ["id pid uid exclusive queues allocations state"]
        for c in dev.contexts.values():
            rows.append(
                f"{c.id} {c.file.pid} {c.file.uid} {int(c.exclusive)} {1 + len(c.queues)} "
                f"{len(c.allocations)} {'lost' if c.lost else 'live'}"
            )
        return "\n".join(rows)

    def set_boot_fail(text: str) -> None:
        dev.fw_boot_fail = _bool(text)

    def set_fail_step(text: str) -> None:
        dev.fail_step = parse_fail_step(text)

    def set_recovery(text: str) -> None:
        dev.recovery = parse_recovery(text)

    def set_map_fail(text: str) -> None:
        dev.map_fail = parse_number(text.strip(), "map_fail", MAP_FAIL_MAX, decimal=True)

    def set_sched_hold(text: str) -> Awaitable[None]:
        # the write(2) returns once the firmware took the message: a writer that queues
        # work next (the tests) otherwise raced the firmware's loop, which could take that
        # work in the pass it was in when the message came
        dev.sched_hold = _bool(text)
        dev.fw_send(0, mailbox.fw_hold(hold=int(dev.sched_hold)))
        return dev.fw_took_all()

    return {
        "fw_pid": Attr(read=lambda: str(dev.fw.pid) if dev.fw else ""),
        "fw_boot_fail": Attr(read=lambda: str(int(dev.fw_boot_fail)), write=set_boot_fail),
        "fail_step": Attr(read=lambda: dev.fail_step or "none", write=set_fail_step),
        "fw_hang": Attr(write=fw_hang),
        "reset_hold": Attr(read=lambda: str(int(dev.resets.hold)),
                           write=lambda t: dev.resets.set_hold(_bool(t))),
        "contexts": Attr(read=contexts),
        "sched_hold": Attr(read=lambda: str(int(dev.sched_hold)), write=set_sched_hold),
        "recovery": Attr(read=lambda: dev.recovery, write=set_recovery),
        "map_fail": Attr(read=lambda: str(dev.map_fail), write=set_map_fail),
        "ras_ctrl": Attr(write=dev.ras.inject),
        "vram_mm": Attr(read=functools.partial(_vram_mm, dev)),
    }


def _vram_mm(dev: AccelDevice) -> str:
    """Where each device-local allocation lies in VRAM, and which live contexts reach it
    (amdgpu's ``amdgpu_vram_mm``): what a memory error at an offset hits."""
    rows = ["offset size pid contexts"]
    for b in sorted((b for b in dev.memory.backings.values() if b.kind == uapi.MemKind.DEVICE),
                    key=lambda b: b.offset):
        ids = ",".join(str(c.id) for c in dev.memory.holders(b)) or "-"
        rows.append(f"{b.offset:#x} {b.size:#x} {b.pid} {ids}")
    return "\n".join(rows)


RECOVERY_MODES = ("auto", "manual")
#: ``map_fail`` counts the next device-local MAPs to fail: fewer than this
MAP_FAIL_MAX = 1024


def parse_recovery(text: str) -> str:
    """A ``recovery`` value: ``auto`` (reset a device whose running firmware died or hung)
    or ``manual`` (leave it failed until reset)."""
    value = text.strip()
    if value not in RECOVERY_MODES:
        raise DriverError(errno.EINVAL, f"recovery is one of {', '.join(RECOVERY_MODES)}, "
                                        f"not {value!r}")
    return value


def parse_fail_step(text: str) -> str:
    """A ``fail_step`` value: a bring-up step's name, or ``none`` (or nothing) for none."""
    value = text.strip()
    if value in ("", "none"):
        return ""
    if value not in STEP_NAMES:
        raise DriverError(errno.EINVAL, f"no bring-up step {value!r}; the steps are "
                                        f"{' '.join(STEP_NAMES)} (or none)")
    return value


def module_attrs(info: DriverInfo, devices: list[AccelDevice]) -> dict[str, Attr]:
    """``sys/module/accel_emu/*``: the driver itself."""
    return {
        "version": Attr(read=lambda: info.version),
        "abi_version": Attr(read=lambda: f"{info.abi_major}.{info.abi_minor}"),
        "pid": Attr(read=lambda: str(os.getpid())),
        "devices": Attr(read=lambda: str(len(devices))),
    }
