"""torch.cuda's NVML names on torch.accel, read from the device (the driver's sysfs
attributes): ``utilization`` rises while a kernel keeps the device busy, ``temperature``
follows the load, ``list_gpu_processes`` lists this process with the memory it holds."""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.timeout(120)


def test_utilization_and_temperature_rise_under_load(torch_json):
    r = torch_json("""
        report(types=[type(torch.accel.utilization()).__name__,
                      type(torch.accel.temperature(1)).__name__],
               initialised=torch.accel.is_initialized())
        torch.accel._sleep(1000)                  # compiled before anything is measured
        torch.accel.synchronize()
        deadline = time.monotonic() + 20          # other tests' work fades out of the window
        while torch.accel.utilization() > 10 and time.monotonic() < deadline:
            time.sleep(0.2)
        idle_util, idle_temp = torch.accel.utilization(), torch.accel.temperature()
        for _ in range(100):                      # seconds of busy kernels, each counted as it ends
            torch.accel._sleep(20_000_000)
        busy_util, temps = [], []
        while len(busy_util) < 4 or not torch.accel.current_stream().query():
            time.sleep(0.25)                      # the thermal model samples as it is read
            busy_util.append(torch.accel.utilization("accel:0"))
            temps.append(torch.accel.temperature(0))
        torch.accel.synchronize()
        report(idle=[idle_util, idle_temp], busy_util=busy_util, temps=temps)
    """)
    assert r["types"] == ["int", "int"] and r["initialised"] is False, r
    idle_util, idle_temp = r["idle"]
    assert max(r["busy_util"]) >= idle_util + 20, r
    assert max(r["temps"]) > idle_temp and 20 <= idle_temp <= 100, r


def test_list_gpu_processes_lists_this_process_and_its_memory(torch_json):
    r = torch_json("""
        MiB = 1 << 20
        quiet = torch.accel.list_gpu_processes(1)
        x = torch.empty(8 * MiB, dtype=torch.uint8, device="accel:1")
        held = torch.accel.list_gpu_processes("accel:1")
        y = torch.empty(40 * MiB, dtype=torch.uint8, device="accel:1")
        more = torch.accel.list_gpu_processes(1)
        report(pid=os.getpid(), quiet=quiet.splitlines(), held=held.splitlines(),
               more=more.splitlines())
    """)
    pid = r["pid"]

    def mine(lines: list[str]) -> float:
        [line] = [line for line in lines[1:] if line.split()[1] == str(pid)]
        assert line.startswith("process ") and line.endswith(" MB accel memory"), line
        return float(line.split()[3])

    assert r["quiet"][0] == "accel:1" and all(str(pid) not in l for l in r["quiet"]), r
    assert r["held"][0] == "accel:1" and mine(r["held"]) >= 8, r
    assert mine(r["more"]) >= mine(r["held"]) + 40, r
