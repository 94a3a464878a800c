"""Device memory (OpenReg's test_memory, torch.cuda's statistics): torch.accelerator's and
torch.accel's counters report the runtime's caching allocator under torch's key names and
move as tensors are made and freed; device OOM is torch.OutOfMemoryError and leaves the
device usable; tensors of many kinds give back all they took."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20


def test_statistics_move_with_tensors_under_torchs_names(torch_json):
    r = torch_json("""
        acc, MiB = torch.accelerator, 1 << 20
        report(first=[dict(acc.memory_stats()), torch.accel.memory_allocated(),
                      torch.accel.max_memory_reserved(), torch.accel.is_initialized()])
        base = acc.memory_allocated()
        x = torch.empty(8 * MiB, dtype=torch.uint8, device="accel")
        report(base=base, allocated=acc.memory_allocated(), reserved=acc.memory_reserved(),
               max_allocated=acc.max_memory_allocated())
        stats, accel_stats = acc.memory_stats(), torch.accel.memory_stats()
        report(stats_differ=sorted(k for k in {*stats, *accel_stats} if stats.get(k) != accel_stats.get(k)),
               missing=[k for k in (
            "allocated_bytes.all.current", "allocated_bytes.all.peak", "reserved_bytes.all.current",
            "active_bytes.all.current", "requested_bytes.all.current", "segment.all.current",
            "allocation.all.current", "num_ooms", "num_alloc_retries") if k not in stats],
               stats_current=[stats["allocated_bytes.all.current"], stats["reserved_bytes.all.current"]],
               current=[acc.memory_allocated(), acc.memory_reserved()])
        report(accel_differs=[n for n in ("memory_allocated", "memory_reserved", "max_memory_allocated", "max_memory_reserved")
                              if getattr(torch.accel, n)() != getattr(acc, n)()])
        free, total = acc.get_memory_info()
        report(free=free, total=total, mem_get_info=torch.accel.mem_get_info())
        del x
        report(after_del=[acc.memory_allocated(), acc.memory_reserved()])
        torch.accel.empty_cache()
        report(after_empty=[acc.memory_reserved(), acc.get_memory_info()[0]],
               peaks=[acc.max_memory_allocated(), acc.max_memory_reserved()])
        acc.reset_peak_memory_stats()
        report(after_reset=[acc.max_memory_allocated(), acc.memory_allocated(),
                            torch.accel.max_memory_reserved(), torch.accel.memory_reserved()])
        y = torch.empty(MiB, dtype=torch.uint8, device="accel:1")    # another device's books
        report(with_y=[acc.memory_allocated(), acc.memory_allocated(1),
                       torch.accel.memory_allocated("accel:1")])
    """)
    assert r["first"] == [{}, 0, 0, False], r  # nothing to report, nothing initialised
    base = r["base"]
    assert r["allocated"] - base == 8 * MiB and r["reserved"] >= r["allocated"], r
    assert r["max_allocated"] >= base + 8 * MiB, r
    assert r["stats_differ"] == [] and r["missing"] == [], r
    assert r["stats_current"] == r["current"] and r["accel_differs"] == [], r
    assert r["total"] == 256 * MiB and r["mem_get_info"] == [r["free"], r["total"]], r
    assert r["after_del"][0] == base and r["after_del"][1] >= 8 * MiB, r  # kept in the cache
    assert r["after_empty"][0] < 8 * MiB and r["after_empty"][1] >= r["free"] + 8 * MiB, r
    assert r["peaks"][0] >= base + 8 * MiB and r["peaks"][1] >= 8 * MiB, r
    max_allocated, allocated, max_reserved, reserved = r["after_reset"]
    assert max_allocated == allocated and max_reserved == reserved, r
    here, there, there_by_name = r["with_y"]
    assert here == base and there >= MiB and there_by_name == there, r


def test_device_oom_is_torchs_error_and_the_device_recovers(torch_json):
    r = torch_json("""
        MiB = 1 << 20
        try:
            torch.empty(300 * MiB, dtype=torch.uint8, device="accel")
        except torch.OutOfMemoryError as e:
            report(runtime_error=isinstance(e, RuntimeError), first=str(e))
        big = torch.empty(200 * MiB, dtype=torch.uint8, device="accel")
        try:
            torch.empty(100 * MiB, dtype=torch.uint8, device="accel")      # fits only without `big`
        except torch.OutOfMemoryError as e:
            report(second=str(e), num_ooms=torch.accel.memory_stats()["num_ooms"])
        del big
        again = torch.ones(100 * MiB // 4, device="accel")
        report(again=[again.device, again[-1].item()])
    """)
    assert r["runtime_error"] is True, r
    assert r["first"].startswith("accel out of memory. Tried to allocate 300.00 MiB. Device 0 has "
                                 "a total capacity of 256.00 MiB"), r
    assert "Tried to allocate 100.00 MiB" in r["second"] and r["num_ooms"] == 2, r
    assert r["again"] == ["accel:0", 1.0], r


def test_tensors_of_every_kind_give_back_what_they_took(torch_run):
    lines = torch_run("""
        acc = torch.accelerator
        torch.ones(1, device="accel")
        base = acc.memory_allocated()
        for i in range(50):
            x = torch.randn(1000 + i, device="accel", requires_grad=i % 2 == 0)
            views = (x.view(-1)[10:20], x.reshape(-1), x.detach())
            copies = (x.cpu().to("accel"), x.clone(), x.to("accel:1"), x * 2)
            del x, views, copies
        print("allocated", acc.memory_allocated() - base, acc.memory_allocated(1))
        x = torch.ones(100, device="accel")
        ptr = x.data_ptr()
        x.add_(1).mul_(2)
        y = x.view(10, 10)
        print("moved", x.data_ptr() - ptr, y.data_ptr() - ptr, y.cpu().unique().tolist())
        c = torch.empty(2, 3, 4, 4, device="accel", memory_format=torch.channels_last)
        print(c.is_contiguous(memory_format=torch.channels_last))
        cpu, dev = torch.randn(4, 4), torch.randn(4, 4, device="accel")
        print(torch._has_compatible_shallow_copy_type(cpu, dev))
        cpu.data = dev                              # set_data: CPU and accel tensors trade data
        print(cpu.device, cpu.data_ptr() - dev.data_ptr())
        dev2 = torch.randn(4, 4, device="accel")
        dev2.data = torch.ones(2)
        print(dev2.device, dev2.tolist())
    """)
    assert lines == ["allocated 0 0", "moved 0 0 [4.0]", "True", "True", "accel:0 0",
                     "cpu [1.0, 1.0]"]



def test_two_devices_allocate_apart_and_cycles_give_everything_back(torch_run):
    """OpenReg's multi-device and leak tests: each device's tensors stay on it with
    addresses no other device hands out, a tensor moves 0 -> 1 -> 0 unchanged, and a
    thousand allocate/free cycles (plain, copies, views, in-place, autograd) end where
    they began on both devices, without the reserved memory growing."""
    lines = torch_run("""
        import gc
        t0 = [torch.empty(1000 + i, device="accel:0") for i in range(10)]
        t1 = [torch.empty(1000 + i, device="accel:1") for i in range(10)]
        print({t.device.index for t in t0}, {t.device.index for t in t1},
              len({t.data_ptr() for t in t0} & {t.data_ptr() for t in t1}))
        x = torch.randn(100, device="accel:0")
        there = x.to("accel:1")
        print(there.device, there.data_ptr() != x.data_ptr(), torch.equal(there.to("accel:0").cpu(), x.cpu()))
        del t0, t1, x, there
        gc.collect()
        base = [torch.accel.memory_allocated(d) for d in (0, 1)]
        reserved = [torch.accel.memory_reserved(d) for d in (0, 1)]
        for i in range(200):
            dev = f"accel:{i % 2}"
            x = torch.empty((100, 500, 1000, 5000)[i % 4], device=dev)
            y = torch.randn(500, device=dev, requires_grad=True)
            z = (y + y).view(10, 50)[2:4].reshape(-1)
            w = torch.ones(1000, device=dev).add_(1).mul_(2).div_(2).sub_(1)
            c = w.cpu().to(dev).clone()
            del x, y, z, w, c
        gc.collect()
        print([torch.accel.memory_allocated(d) for d in (0, 1)] == base,
              [torch.accel.memory_reserved(d) for d in (0, 1)] == reserved)
    """)
    assert lines == ["{0} {1} 0", "accel:1 True True", "True True"]


def test_a_factory_allocates_on_its_named_device_without_switching_devices(torch_json):
    """``torch.empty(..., device="accel:1")`` allocates on device 1 directly: the shim
    hands torch an allocator bound to that device instead of making it current around
    the allocation (the guard's exchange and restore were two calls into Python per
    tensor, ~3 us of a small operator's host time). The current device never moves, the
    bytes are counted on device 1, and an index out of range is still torch's error,
    for an empty tensor too."""
    r = torch_json("""
        from torch_accel import _hooks
        torch.empty(1, device="accel:0")
        switches = []
        for name in ("exchange_device", "set_device"):
            real = getattr(_hooks, name)
            setattr(_hooks, name, lambda i, _r=real, _n=name: switches.append(_n) or _r(i))
        before = [torch.accel.memory_allocated(d) for d in (0, 1)]
        t = torch.empty(1024, device="accel:1")
        s = torch.empty_strided((16, 16), (1, 16), device="accel:1")
        after = [torch.accel.memory_allocated(d) for d in (0, 1)]
        switched = list(switches)
        t.fill_(2.0)
        def refused(fn):
            try:
                fn()
            except RuntimeError as exc:
                return "invalid device index 9" in str(exc)
            return False
        report(switches=switched, current=torch.accel.current_device(),
               devices=[t.device.index, s.device.index], grew=[a - b for a, b in zip(after, before)],
               value=t[:2].cpu().tolist(),
               refused=[refused(lambda: torch.empty(4, device="accel:9")),
                        refused(lambda: torch.empty(0, device="accel:9")),
                        refused(lambda: torch.empty_strided((2,), (1,), device="accel:9"))])
    """)
    assert r == {"switches": [], "current": 0, "devices": [1, 1], "grew": [0, 4096 + 1024],
                 "value": [2.0, 2.0], "refused": [True, True, True]}, r


def test_an_eager_loops_results_keep_torchs_figures(torch_json):
    """The host path of a small operator's result (the shim's allocation and free calls,
    the allocator's merge-then-split cycle): results dropped at once reuse one address,
    and the figures move as torch's allocator's would: each result one allocation and one
    free of its bytes, nothing held after the loop, the segment's rest one inactive split
    whose peak is the merged state in between. A result another stream used
    (record_stream) stays active, pending, until that stream's work is done."""
    r = torch_json("""
        acc = torch.accelerator
        a, b = torch.ones(4096, device="accel"), torch.full((4096,), 2.0, device="accel")
        acc.synchronize()
        ptr = (a + b).data_ptr()
        acc.reset_peak_memory_stats()
        before = acc.memory_stats()
        ptrs = {(a + b).data_ptr() - ptr for _ in range(50)}
        after = acc.memory_stats()
        keys = ("allocation.all.allocated", "allocation.all.freed", "allocation.all.current",
                "allocated_bytes.all.allocated", "allocated_bytes.all.current",
                "requested_bytes.all.current", "active.all.current", "segment.all.current",
                "inactive_split.all.current")
        [segment] = [s for s in torch.accel.memory_snapshot()
                     if s["address"] <= ptr < s["address"] + s["total_size"]]
        rest = segment["total_size"] - (ptr - segment["address"])
        side = torch.accel.Stream()
        c = a + b
        c.record_stream(side)
        side.wait_stream(torch.accel.current_stream())
        with torch.accel.stream(side):
            c.mul_(3)
        torch.accel.current_stream().wait_stream(side)
        value = c[:2].cpu().tolist()
        del c
        pending = acc.memory_stats()
        side.synchronize()
        (a + b)
        done = acc.memory_stats()
        report(ptrs=sorted(ptrs), delta={k: after[k] - before[k] for k in keys},
               split_bytes=[after["inactive_split_bytes.all.current"],
                            after["inactive_split_bytes.all.peak"]], rest=rest,
               value=value,
               pending=[pending[k] - after[k] for k in ("allocated_bytes.all.current",
                                                        "active_bytes.all.current")],
               done=[done[k] - after[k] for k in ("allocated_bytes.all.current",
                                                  "active_bytes.all.current")])
    """)
    assert r["ptrs"] == [0], r
    assert r["delta"] == {"allocation.all.allocated": 50, "allocation.all.freed": 50,
                          "allocated_bytes.all.allocated": 50 * 16384,
                          **dict.fromkeys(("allocation.all.current", "allocated_bytes.all.current",
                                           "requested_bytes.all.current", "active.all.current",
                                           "segment.all.current", "inactive_split.all.current"),
                                          0)}, r
    assert r["split_bytes"] == [r["rest"], r["rest"]], r   # merged: the result's and the rest's
    assert r["value"] == [9.0, 9.0], r
    assert r["pending"] == [0, 16384] and r["done"] == [0, 0], r
