"""``torch.profiler.profile`` on accel: the device's kernel, copy and memset rows, each
tied to the aten operator that queued it, in ``prof.accel_events`` and merged into the
exported Chrome trace (one process per device, an ``ac2g`` flow from the operator)."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.timeout(240)


def test_device_rows_are_correlated_to_their_operators_in_the_trace(torch_run, tmp_path):
    path = tmp_path / "trace.json"
    lines = torch_run(f"""
        x = torch.randn(64, 64).to("accel")
        (x @ x).relu().sum().item()                        # compiled before the profile
        with torch.profiler.profile() as prof:
            z = torch.zeros(128, device="accel")
            y = (x @ x).relu().sum()
            print(y.item())
        print(sorted({{e["cat"] for e in prof.accel_events}}))
        prof.export_chrome_trace({str(path)!r})
    """, timeout=200)
    assert float(lines[0]) > 0 and lines[1:] == ["['gpu_memcpy', 'gpu_memset', 'kernel']"], lines

    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    ops = {e["args"]["External id"]: e for e in events if e.get("cat") == "cpu_op"}
    device = [e for e in events if e.get("ph") == "X" and str(e["pid"]).startswith("accel:")]
    by_op = {(e["cat"], e["args"]["op"]) for e in device}
    assert {("gpu_memset", "aten::zero_"), ("kernel", "aten::mm"), ("kernel", "aten::relu"),
            ("kernel", "aten::sum"), ("gpu_memcpy", "aten::_local_scalar_dense")} <= by_op
    slack = trace["accelClockUncertaintyUs"]
    assert 0 <= slack < 1000
    for e in device:  # each starts after its operator began, on device 0's default stream
        op = ops[e["args"]["op_external_id"]]
        assert op["name"] == e["args"]["op"] and e["pid"] == "accel:0", e
        assert e["ts"] >= op["ts"] - slack, (e, op)
    flows = [e for e in events if e.get("cat") == "ac2g"]
    assert len(flows) == 2 * len(device)
