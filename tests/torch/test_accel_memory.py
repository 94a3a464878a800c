"""Device memory (OpenReg's test_memory, torch.cuda's statistics): torch.accelerator's and
torch.accel's counters report the runtime's caching allocator under torch's key names and
move as tensors are made and freed; device OOM is torch.OutOfMemoryError and leaves the
device usable; tensors of many kinds give back all they took."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20


def test_statistics_move_with_tensors_under_torchs_names(torch_run):
    lines = torch_run("""
        acc, MiB = torch.accelerator, 1 << 20
        print(dict(acc.memory_stats()), torch.accel.memory_allocated(), torch.accel.max_memory_reserved(),
              torch.accel.is_initialized())        # nothing to report, nothing initialised
        base = acc.memory_allocated()
        x = torch.empty(8 * MiB, dtype=torch.uint8, device="accel")
        print(acc.memory_allocated() - base, acc.memory_reserved() >= acc.memory_allocated(),
              acc.max_memory_allocated() >= base + 8 * MiB)
        stats = acc.memory_stats()
        print(stats == torch.accel.memory_stats(), [k for k in (
            "allocated_bytes.all.current", "allocated_bytes.all.peak", "reserved_bytes.all.current",
            "active_bytes.all.current", "requested_bytes.all.current", "segment.all.current",
            "allocation.all.current", "num_ooms", "num_alloc_retries") if k not in stats])
        print(stats["allocated_bytes.all.current"] == acc.memory_allocated(),
              stats["reserved_bytes.all.current"] == acc.memory_reserved())
        print([n for n in ("memory_allocated", "memory_reserved", "max_memory_allocated", "max_memory_reserved")
               if getattr(torch.accel, n)() != getattr(acc, n)()])
        free, total = acc.get_memory_info()
        print(total, torch.accel.mem_get_info() == (free, total))
        del x
        print(acc.memory_allocated() == base, acc.memory_reserved() >= 8 * MiB)   # kept in the cache
        torch.accel.empty_cache()
        print(acc.memory_reserved() < 8 * MiB, acc.get_memory_info()[0] >= free + 8 * MiB)
        print(acc.max_memory_allocated() >= base + 8 * MiB, acc.max_memory_reserved() >= 8 * MiB)
        acc.reset_peak_memory_stats()
        print(acc.max_memory_allocated() == acc.memory_allocated(),
              torch.accel.max_memory_reserved() == torch.accel.memory_reserved())
        y = torch.empty(MiB, dtype=torch.uint8, device="accel:1")    # another device's books
        print(acc.memory_allocated() == base, acc.memory_allocated(1) >= MiB,
              torch.accel.memory_allocated("accel:1") == acc.memory_allocated(1))
    """)
    assert lines == ["{} 0 0 False", f"{8 * MiB} True True", "True []", "True True", "[]", f"{256 * MiB} True",
                     "True True", "True True", "True True", "True True", "True True True"]


def test_device_oom_is_torchs_error_and_the_device_recovers(torch_run):
    lines = torch_run("""
        MiB = 1 << 20
        try:
            torch.empty(300 * MiB, dtype=torch.uint8, device="accel")
        except torch.OutOfMemoryError as e:
            print(isinstance(e, RuntimeError), str(e).startswith(
                "accel out of memory. Tried to allocate 300.00 MiB. Device 0 has a total capacity of 256.00 MiB"))
        big = torch.empty(200 * MiB, dtype=torch.uint8, device="accel")
        try:
            torch.empty(100 * MiB, dtype=torch.uint8, device="accel")      # fits only without `big`
        except torch.OutOfMemoryError as e:
            print("Tried to allocate 100.00 MiB" in str(e), torch.accel.memory_stats()["num_ooms"])
        del big
        again = torch.ones(100 * MiB // 4, device="accel")
        print(again.device, again[-1].item())
    """)
    assert lines == ["True True", "True 2", "accel:0 1.0"]


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
        print(acc.memory_allocated() == base, acc.memory_allocated(1) == 0)
        x = torch.ones(100, device="accel")
        ptr = x.data_ptr()
        x.add_(1).mul_(2)
        y = x.view(10, 10)
        print(x.data_ptr() == ptr == y.data_ptr(), bool((y == 4).all()))
        c = torch.empty(2, 3, 4, 4, device="accel", memory_format=torch.channels_last)
        print(c.is_contiguous(memory_format=torch.channels_last))
        cpu, dev = torch.randn(4, 4), torch.randn(4, 4, device="accel")
        print(torch._has_compatible_shallow_copy_type(cpu, dev))
        cpu.data = dev                              # set_data: CPU and accel tensors trade data
        print(cpu.device, cpu.data_ptr() == dev.data_ptr())
        dev2 = torch.randn(4, 4, device="accel")
        dev2.data = torch.ones(2)
        print(dev2.device, dev2.tolist())
    """)
    assert lines == ["True True", "True True", "True", "True", "accel:0 True", "cpu [1.0, 1.0]"]
