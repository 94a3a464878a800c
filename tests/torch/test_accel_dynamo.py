"""Dynamo on accel (torch_accel/dynamo.py): the device interface Dynamo looks devices up
by, registered when Dynamo loads and not before, and code on accel tensors that reads the
current stream and synchronizes compiling into one graph (``fullgraph=True`` fails on any
graph break) with eager's results.

These compile with ``aot_eager`` (Dynamo and AOTAutograd, then the eager operators): what
they test is Dynamo's view of the device; Inductor's code generator for accel is
tests/torch/test_accel_compile.py's.
"""

from __future__ import annotations

import pytest


@pytest.mark.timeout(300)
def test_dynamo_finds_accels_interface_registered_only_when_it_loads(torch_json):
    r = torch_json("""
        loaded_by_import = "torch._dynamo" in sys.modules
        from torch._dynamo.device_interface import get_interface_for_device
        face = get_interface_for_device("accel")
        s = torch.accel.Stream()
        with torch._dynamo.device_interface.DeviceGuard(face, 1):
            inside = face.current_device()
        report(loaded_by_import=loaded_by_import, name=face.__name__,
               same_for_index=get_interface_for_device(torch.device("accel", 1)) is face,
               available=face.is_available(), count=face.device_count(),
               capability=face.get_compute_capability(),
               want_capability=list(torch.accel.get_device_capability()),
               triton=face.is_triton_capable(), inside=inside, after=face.current_device(),
               raw_stream=face.get_raw_stream(0) == torch.accel.current_stream().stream_id,
               worker_props=face.Worker.get_device_properties("accel:1").name
                   == torch.accel.get_device_properties(1).name)
    """)
    major, minor = r.pop("want_capability")
    assert r == {"loaded_by_import": False, "name": "AccelInterface", "same_for_index": True,
                 "available": True, "count": 2, "capability": major * 10 + minor,
                 "triton": False, "inside": 1, "after": 0, "raw_stream": True,
                 "worker_props": True}, r


@pytest.mark.timeout(300)
def test_code_reading_the_stream_and_synchronizing_compiles_into_one_graph(torch_json):
    r = torch_json("""
        import torch._dynamo
        def step(x, w):
            s = torch.accel.current_stream()
            y = torch.relu(x @ w + 1)
            torch.accel.synchronize()
            return (y * 2).sum(), s.device_index
        x, w = torch.randn(16, 8, device="accel"), torch.randn(8, 4, device="accel")
        compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
        got, want = compiled(x, w), step(x, w)
        report(got=got[0].item(), want=want[0].item(), device=got[0].device,
               index=[got[1], want[1]], frames=torch._dynamo.utils.counters["stats"]["unique_graphs"])
    """)
    assert abs(r["got"] - r["want"]) <= 1e-4 * max(1.0, abs(r["want"])), r
    assert r["device"] == "accel:0" and r["index"] == [0, 0] and r["frames"] == 1, r


@pytest.mark.timeout(300)
def test_stream_contexts_and_events_compile_with_torchs_generic_names(torch_json):
    """Inside a compiled region Dynamo resolves streams it knows by name: torch.cuda's,
    torch.xpu's and ``torch.accelerator``'s (hard-coded in Dynamo), so accel code there uses
    ``torch.accelerator.current_stream()`` and ``torch.Event``; ``torch.accel.stream(s)``
    enters as torch.cuda.stream does."""
    r = torch_json("""
        import torch._dynamo
        side, done = torch.accel.Stream(), torch.Event(device="accel")
        def step(x):
            with torch.accel.stream(side):
                y = x * 3
            torch.accelerator.current_stream().wait_stream(side)
            z = y + 1
            torch.accelerator.current_stream().record_event(done)
            done.wait(side)
            return z
        x = torch.arange(8.0, device="accel")
        compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
        got = compiled(x)
        torch.accel.synchronize()
        report(got=got, want=step(x), graphs=torch._dynamo.utils.counters["stats"]["unique_graphs"])
    """)
    assert r["got"] == r["want"] == [3.0 * i + 1 for i in range(8)] and r["graphs"] == 1, r
