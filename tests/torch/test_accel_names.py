"""torch.accel has the torch.cuda names docs/torch.md lists, each answering from the device:
the properties under torch.cuda's field names, ``Stream.priority``, ``is_bf16_supported``,
``get_arch_list`` and ``ipc_collect`` (the memory and telemetry names have files of their
own: test_accel_memory_names.py, test_accel_telemetry.py)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(120)

#: torch.cuda names issue 31 found missing, and the memory names they stand beside
NAMES = ["memory_summary", "memory_snapshot", "reset_max_memory_allocated",
         "reset_max_memory_cached", "reset_peak_memory_stats", "max_memory_reserved",
         "list_gpu_processes", "utilization", "temperature", "ipc_collect",
         "set_per_process_memory_fraction", "is_bf16_supported", "get_arch_list"]


def test_torch_cuda_names_exist_with_torch_cudas_parameter_names(torch_json):
    """The new names, and every function torch.accel shares with torch.cuda, take the
    same parameters by the same names (``torch.accel.synchronize(device=1)``)."""
    r = torch_json(f"""
        import inspect
        def params(f):
            return [p.name for p in inspect.signature(f).parameters.values()]
        shared = [n for n in torch.accel.__all__ if inspect.isfunction(getattr(torch.accel, n))
                  and inspect.isfunction(getattr(torch.cuda, n, None))]
        report(missing=[n for n in {NAMES!r} if not hasattr(torch.accel, n)],
               unlisted=[n for n in {NAMES!r} if n not in torch.accel.__all__],
               unshared=[n for n in {NAMES!r} if n not in shared],
               parameters=[n for n in shared
                           if params(getattr(torch.accel, n)) != params(getattr(torch.cuda, n))])
    """)
    assert r == {"missing": [], "unlisted": [], "unshared": [], "parameters": []}, r


def test_properties_have_torch_cudas_fields_from_the_device(torch_json):
    r = torch_json("""
        report(arch_before=torch.accel.get_arch_list(), initialised=torch.accel.is_initialized())
        props = torch.accel.get_device_properties("accel:1")
        report(runtime_props=isinstance(props, runtime.DeviceProperties),
               fields=[props.name, props.total_memory, props.major, props.minor,
                       props.multi_processor_count, props.shared_memory_per_block],
               device=[runtime.get_device_properties(1).compute_engines,
                       runtime.get_device_properties(1).max_shared_mem_per_block,
                       runtime.get_device_properties(1).isa_version],
               capability=list(torch.accel.get_device_capability(1)),
               arch=torch.accel.get_arch_list(), repr=repr(props).split("(")[0])
    """)
    assert r["arch_before"] == r["arch"] and r["initialised"] is False, r
    name, total, major, minor, engines, shared = r["fields"]
    assert r["runtime_props"] and total == 256 << 20 and name, r
    assert [engines, shared, f"{major}.{minor}"] == r["device"], r
    assert r["capability"] == [major, minor] and r["arch"] == [f"isa_{major}{minor}"], r
    assert r["repr"] == "DeviceProperties", r


def test_stream_priority_bf16_and_ipc_collect(torch_json):
    r = torch_json("""
        high = torch.accel.Stream(priority=-1)
        low = torch.accel.Stream()
        report(priorities=[high.priority, low.priority, torch.accel.default_stream().priority,
                           torch.accel.current_stream().priority],
               runtime=[high.runtime_stream.priority, low.runtime_stream.priority],
               range=list(torch.accel.Stream.priority_range()))
        report(bf16=[torch.accel.is_bf16_supported(), torch.accel.is_bf16_supported(False)],
               capabilities=list(torch.accel.get_device_properties().capabilities))
        x = torch.ones(1000, device="accel")
        before = torch.accel.memory_allocated()
        report(ipc_collect=torch.accel.ipc_collect(), kept=torch.accel.memory_allocated() - before)
    """)
    assert r["priorities"] == [-1, 0, 0, 0] and r["runtime"] == [-1, 0], r
    assert r["range"] == [0, -1], r
    # no kernel type of the device is a 16-bit float: bfloat16 only as emulated (moved as
    # integers, computed on the host)
    assert "bfloat16" not in r["capabilities"] and r["bf16"] == [True, False], r
    assert r["ipc_collect"] is None and r["kept"] == 0, r
