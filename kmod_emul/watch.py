"""The watchers of a serving device: its firmware's exit, its heartbeat, a reset request.

Each runs while the device serves (``AccelDevice.serve``) and ends serving by cancelling
``scope``: a firmware that exits or stops heart-beating while the device is operational
fails it (``Resets.fail_running``: its contexts lost, the fault recorded, then with
``recovery`` auto a reset); a requested reset just ends serving, and the supervisor
boots again.
"""

from __future__ import annotations

import errno
from typing import TYPE_CHECKING

import trio

from abi import faults, uapi

if TYPE_CHECKING:
    from kmod_emul.device import AccelDevice


async def watch_exit(dev: AccelDevice, scope: trio.CancelScope) -> None:
    assert dev.fw is not None
    status = await dev.fw.proc.wait()
    if dev.state == uapi.DeviceState.OPERATIONAL:
        dev.resets.fail_running(errno.ENODEV,
                                f"firmware process exited unexpectedly (status {status})",
                                faults.BY_NAME["FIRMWARE_DIED"].code)
    scope.cancel()


async def watch_heartbeat(dev: AccelDevice, scope: trio.CancelScope) -> None:
    assert dev.fw is not None
    mbx = dev.fw.mbx
    last = mbx.heartbeat[0]
    last_change = trio.current_time()
    while True:
        await trio.sleep(min(0.1, dev.heartbeat_timeout_s / 4))
        beat = mbx.heartbeat[0]
        now = trio.current_time()
        if beat != last:
            last, last_change = beat, now
        elif now - last_change > dev.heartbeat_timeout_s:
            dev.resets.fail_running(
                errno.ENODEV,
                f"firmware stopped heart-beating (none for {now - last_change:.1f} s)"
                + ("" if dev.recovery == "auto" else "; reset the device"),
                faults.BY_NAME["FIRMWARE_HANG"].code,
            )
            scope.cancel()
            return


async def watch_reset(dev: AccelDevice, scope: trio.CancelScope) -> None:
    await dev.resets.requested.wait()
    scope.cancel()
