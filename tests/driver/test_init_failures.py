"""Distinct initialisation failures: each its own errno, exception class, message and state.

Each case is checked at three levels: the raw open(2) of the device node (errno), the
runtime (exception class and a message naming cause and fix) and sysfs (state and
failure_code, which accel-smi shows).
"""

from __future__ import annotations

import os

from rawdev import RawDev, errname

from abi import uapi
from abi.fwimage import IMAGE_NAME

#: Prints "<exception class>|<message>" for runtime.init() in a fresh process.
INIT_PROBE = """
import runtime
try:
    runtime.init()
    print("ok|")
except runtime.AccelError as exc:
    print(f"{type(exc).__name__}|{exc}")
"""


def probe(d, **env) -> tuple[str, str]:
    out = d.run_py(INIT_PROBE, **env)
    assert out.returncode == 0, out.stderr
    cls, _, msg = out.stdout.strip().partition("|")
    return cls, msg


def open_errno(d, dev: int = 0) -> str:
    return errname(lambda: os.close(os.open(d.node(dev), os.O_RDWR)))


def test_missing_firmware(make_daemon, tmp_path):
    empty = tmp_path / "no-firmware"
    empty.mkdir()
    d = make_daemon(firmware_dir=empty)
    assert d.attr(0, "state") == "failed"
    assert d.attr(0, "failure_code") == "ENOPKG"
    assert open_errno(d) == "ENOPKG"
    cls, msg = probe(d)
    assert cls == "FirmwareMissingError"
    assert IMAGE_NAME in msg and "not found" in msg and "install" in msg


def test_corrupt_firmware_then_fixed_by_reset(make_daemon, firmware_copy):
    image = firmware_copy / IMAGE_NAME
    good = image.read_bytes()
    image.write_bytes(good[:-1] + bytes([good[-1] ^ 0xFF]))
    d = make_daemon(firmware_dir=firmware_copy)
    assert (d.attr(0, "state"), d.attr(0, "failure_code")) == ("failed", "ENOEXEC")
    assert open_errno(d) == "ENOEXEC"
    cls, msg = probe(d)
    assert cls == "FirmwareCorruptError"
    assert "checksum mismatch" in msg and "reinstall" in msg
    # The fix the message names works: reinstall the image and reset the device.
    image.write_bytes(good)
    (d.root / "sys/class/accel/accel0/reset").write_text("1")
    d.wait_state(0, "operational")
    assert probe(d) == ("ok", "")


def test_truncated_image_is_corrupt_not_missing(make_daemon, firmware_copy):
    (firmware_copy / IMAGE_NAME).write_bytes(b"AEMUFW01\x10")
    d = make_daemon(firmware_dir=firmware_copy)
    assert d.attr(0, "failure_code") == "ENOEXEC"
    assert "truncated" in d.attr(0, "failure")


def test_firmware_boot_failure(make_daemon):
    d = make_daemon()
    d.debug(0, "fw_boot_fail").write_text("1")
    (d.root / "sys/class/accel/accel0/reset").write_text("1")
    d.wait_state(0, "failed")
    assert d.attr(0, "failure_code") == "EIO"
    assert open_errno(d) == "EIO"
    cls, msg = probe(d)
    assert cls == "FirmwareBootError" and "injected boot failure" in msg


def test_driver_abi_mismatch(make_daemon):
    newer = f"{uapi.ACCEL_ABI_MAJOR + 1}.0"
    d = make_daemon(extra=["--driver-abi", newer])
    assert d.attr(0, "state") == "operational"  # the device is fine; the versions are not
    cls, msg = probe(d)
    assert cls == "DriverVersionMismatchError"
    assert f"driver speaks uAPI {newer}" in msg
    assert f"runtime speaks {uapi.ACCEL_ABI_MAJOR}.{uapi.ACCEL_ABI_MINOR}" in msg
    with RawDev(d.node(0)) as dev:
        assert errname(lambda: dev.ctx_create()) == "EPROTO"


def test_device_held_exclusively_by_another_process(daemon):
    code = """
        import sys, runtime
        ctx = runtime.new_context(1, exclusive=True)
        print("held", flush=True)
        sys.stdin.readline()
    """
    proc = daemon.popen_py(code)
    try:
        assert proc.stdout.readline().strip() == "held"
        assert daemon.attr(1, "exclusive_owner") == str(proc.pid)
        assert open_errno(daemon, 1) == "EBUSY"
        cls, msg = probe(daemon, ACCEL_VISIBLE_DEVICES="1")
        assert cls == "DeviceBusyError"
        assert f"held exclusively by process {proc.pid}" in msg
        assert open_errno(daemon, 0) == ""  # the other device is not affected
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
    assert daemon.attr(1, "exclusive_owner") == ""
    assert probe(daemon, ACCEL_VISIBLE_DEVICES="1") == ("ok", "")


def test_exclusive_refused_while_others_have_it_open(daemon):
    with RawDev(daemon.node(1)):  # this test process has accel1 open
        out = daemon.run_py("""
            import runtime
            try:
                runtime.new_context(1, exclusive=True)
            except runtime.DeviceBusyError as exc:
                print("busy", exc.errno)
        """)
    assert out.stdout.split() == ["busy", "16"], out.stderr


def test_device_in_reset(make_daemon):
    d = make_daemon()
    with RawDev(d.node(0)) as dev:
        ctx = dev.ctx_create()
        d.debug(0, "reset_hold").write_text("1")
        (d.root / "sys/class/accel/accel0/reset").write_text("1")
        assert d.attr(0, "state") == "in_reset"
        assert open_errno(d) == "EAGAIN"
        cls, msg = probe(d)
        assert cls == "DeviceInResetError" and "in reset" in msg
        assert errname(lambda: dev.noop(ctx)) == "ENODEV"  # the old context was lost
        d.debug(0, "reset_hold").write_text("0")
        d.wait_state(0, "operational")
        assert errname(lambda: dev.noop(ctx)) == "ENODEV"  # lost stays lost
    assert d.attr(0, "reset_count") == "1"
    assert probe(d) == ("ok", "")


def test_no_device_is_its_own_error(daemon, tmp_path):
    cls, msg = probe(daemon, ACCEL_EMU_ROOT=str(tmp_path))
    assert cls == "NoDeviceError" and "no accel-emud serves" in msg
    cls, msg = probe(daemon, ACCEL_VISIBLE_DEVICES="")
    assert cls == "NoDeviceError" and "ACCEL_VISIBLE_DEVICES" in msg
