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


def test_autograd_profiler_key_averages_with_device_time(torch_json):
    """OpenReg's test_profiler, ported: ``torch.autograd.profiler.profile(use_device=
    "accel")`` asks the backend's profiler stubs for an event at each operator's start and
    end. Without them every callback raised and key_averages() showed -7.4e16 us of CPU
    time; now every CPU time is positive, each operator has its device time (the ACCEL
    columns, as CUDA's legacy profiler fills them) and the table renders."""
    r = torch_json("""
        from torch.autograd.profiler import profile as autograd_profile
        from torch.profiler import record_function
        x = torch.randn(100, 100, device="accel"); (x @ x + x).sum().item()   # compiled first
        s = torch.Stream(device="accel")
        with autograd_profile(use_device="accel", record_shapes=True) as prof:
            with record_function("accel_block"):
                with s:
                    y = torch.randn(100, 100, device="accel")
                    for _ in range(5):
                        y = y @ x
                    (y + 1).sum()
                s.synchronize()
            w = torch.randn(8, 8, device="accel", requires_grad=True)
            (w * w).sum().backward()
            x1 = torch.ones(10, device="accel:1"); x1 + x1
        avgs = prof.key_averages()
        table = avgs.table(sort_by="cpu_time_total", row_limit=10)
        rows = {a.key: [a.count, a.cpu_time_total, a.self_cpu_time_total, a.device_time_total]
                for a in avgs}
        report(rows=rows, table_has_accel="ACCEL total" in table, events=len(prof.function_events),
               mm_total=sum(e.cpu_time_total for e in prof.function_events if e.name == "aten::mm"),
               grouped=len(prof.key_averages(group_by_input_shape=True)))
    """)
    rows = r["rows"]
    assert {"accel_block", "aten::mm", "aten::add", "aten::sum"} <= rows.keys(), rows
    assert any("backward" in k.lower() for k in rows), rows
    for key, (count, cpu_total, self_cpu, device_total) in rows.items():
        assert count > 0 and 0 <= self_cpu <= cpu_total < 60e6, (key, rows[key])
        assert 0 <= device_total < 60e6, (key, rows[key])
    assert rows["aten::mm"][0] == 5 and rows["aten::mm"][3] > 0, rows["aten::mm"]
    assert r["mm_total"] > 0 and r["table_has_accel"] and r["grouped"] > 0, r


def test_a_kernels_first_compile_is_its_own_row(torch_run, tmp_path):
    """A kernel's first launch waits for the firmware to compile it (a first ``sum`` had
    shown 8.8 s of kernel time): in ``prof.accel_events`` and the trace that wait is a
    ``compile <kernel>`` event of category ``kernel_compile`` before the kernel, whose own
    duration is only its run. A kernel of a source no daemon has seen forces the compile;
    it runs on torch's current stream, where the operators' kernels run."""
    path = tmp_path / "trace.json"
    lines = torch_run(f"""
        import json
        name = f"twice{{os.getpid()}}_{{time.monotonic_ns()}}"
        m = runtime.compile(f'''
        def {{name}}(x):
            i = global_id(0)
            x[i] = x[i] * 2.0
        ''')
        x = torch.ones(1 << 14, device="accel")
        view = torch_accel.ops._tensors.view_of(x)
        with torch.profiler.profile() as prof:
            for _ in range(2):
                getattr(m, name)[64, 256](view, stream=runtime.current_stream())
            x.sum().item()
        prof.export_chrome_trace({str(path)!r})
        mine = [[e["cat"], e["name"].replace(name, "K"), e["start_ns"], e["end_ns"]]
                for e in prof.accel_events if name in e["name"]]
        print(json.dumps(mine))
        print(x[0].item())
    """)
    mine = json.loads(lines[0])
    assert [e[:2] for e in mine] == [["kernel_compile", "compile K"], ["kernel", "K"],
                                     ["kernel", "K"]], mine
    compile_ns, run_ns = mine[0][3] - mine[0][2], mine[1][3] - mine[1][2]
    assert mine[0][3] == mine[1][2] and compile_ns > 10 * run_ns, mine
    assert float(lines[1]) == 4.0, lines
    trace = json.loads(path.read_text())
    compiles = [e for e in trace["traceEvents"] if e.get("cat") == "kernel_compile"]
    assert any(e["name"].startswith("compile twice") and str(e["pid"]).startswith("accel:")
               for e in compiles), compiles


def test_autograd_profiler_edge_cases(torch_run, tmp_path):
    """The rest of OpenReg's test_profiler: an empty profile, an exception raised inside
    one, many record_function ranges, events recorded and synchronized on a side stream,
    and the legacy profiler's Chrome trace, which is valid JSON naming the ranges."""
    trace = tmp_path / "legacy.json"
    lines = torch_run(f"""
        import json
        from torch.autograd.profiler import profile as autograd_profile
        from torch.profiler import record_function
        with autograd_profile(use_device="accel") as empty:
            pass
        try:
            with autograd_profile(use_device="accel") as failed:
                x = torch.randn(10, 10, device="accel")
                raise RuntimeError("Test exception")
        except RuntimeError as e:
            print(e, isinstance(failed.function_events, list))
        s, ev = torch.Stream(device="accel"), torch.Event(device="accel", enable_timing=True)
        with autograd_profile(use_device="accel") as prof:
            with s:
                y = torch.randn(10, 10, device="accel")
                ev.record(s)
                y + y
            ev.synchronize()
            for i in range(100):
                with record_function(f"op_{{i}}"):
                    y = y + 1
        names = [e.name for e in prof.function_events]
        print(len(empty.function_events), len(names) > 100, all(f"op_{{i}}" in names for i in range(100)))
        prof.export_chrome_trace({str(trace)!r})
        events = json.load(open({str(trace)!r}))["traceEvents"]
        print(sum(e.get("name") == "op_7" for e in events), min(e.get("dur", 0) for e in events if "dur" in e) >= 0)
    """)
    assert lines == ["Test exception True", "0 True True", "1 True"]
