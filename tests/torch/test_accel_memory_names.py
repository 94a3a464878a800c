"""torch.cuda's remaining memory names on torch.accel, read from the runtime's caching
allocator: ``memory_snapshot`` (segments and their blocks), ``memory_summary`` (the text
table), the older ``reset_max_memory_*`` names, and ``set_per_process_memory_fraction``,
which the allocator enforces: an allocation past the fraction is torch.OutOfMemoryError."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20


def test_snapshot_and_summary_follow_allocations(torch_json):
    r = torch_json("""
        import warnings
        MiB = 1 << 20
        report(before_init=torch.accel.memory_snapshot())
        torch.ones(1, device="accel")
        def mine(segments, va):
            return [(s["segment_type"], s["total_size"], s["allocated_size"], s["stream"],
                     sorted(s) , b) for s in segments for b in s["blocks"] if b["address"] == va]
        x = torch.empty(3 * MiB, dtype=torch.uint8, device="accel")
        va = x.data_ptr()
        held = torch.accel.memory_snapshot()
        report(held=mine(held, va), devices=sorted({s["device"] for s in held}),
               allocated=sum(s["allocated_size"] for s in held if s["device"] == 0),
               memory_allocated=torch.accel.memory_allocated(),
               reserved=sum(s["total_size"] for s in held if s["device"] == 0),
               memory_reserved=torch.accel.memory_reserved())
        summary = torch.accel.memory_summary()
        del x
        report(freed=mine(torch.accel.memory_snapshot(), va),
               summary=summary.splitlines(), summary_after=torch.accel.memory_summary().splitlines(),
               abbreviated=len(torch.accel.memory_summary(0, abbreviated=True).splitlines()))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            before = torch.accel.max_memory_allocated()
            torch.accel.reset_max_memory_allocated()
            after_allocated = torch.accel.max_memory_allocated()
            y = torch.empty(4 * MiB, dtype=torch.uint8, device="accel")
            del y
            torch.accel.empty_cache()
            torch.accel.reset_max_memory_cached()
        report(peaks=[before, after_allocated, torch.accel.memory_allocated(),
                      torch.accel.max_memory_reserved(), torch.accel.memory_reserved()],
               warned=[w.category.__name__ for w in caught])
    """)
    assert r["before_init"] == [], r
    [(kind, total, allocated, stream, keys, block)] = r["held"]
    assert kind == "large" and total == 20 * MiB and allocated >= 3 * MiB and stream == 0, r
    assert block == {"address": block["address"], "size": 3 * MiB, "requested_size": 3 * MiB,
                     "state": "active_allocated", "frames": []}, r
    assert {"device", "address", "total_size", "allocated_size", "active_size",
            "requested_size", "segment_type", "stream", "blocks"} <= set(keys), r
    assert r["devices"] == [0], r
    assert r["allocated"] == r["memory_allocated"] and r["reserved"] == r["memory_reserved"], r
    [(_, _, _, _, _, freed)] = r["freed"]  # the block is back in the cache, merged
    assert freed["state"] == "inactive" and freed["size"] == 20 * MiB, r
    summary = r["summary"]
    assert summary[1].startswith("|") and "PyTorch accel memory summary, device ID 0" in summary[1]
    assert all(len(line) == 77 for line in summary), summary   # torch's 75 columns and bars
    allocated = next(line for line in summary if "Allocated memory" in line)
    allocated_after = next(line for line in r["summary_after"] if "Allocated memory" in line)
    assert allocated != allocated_after, (allocated, allocated_after)  # the 3 MiB went
    assert r["abbreviated"] < len(summary), r
    before, after_allocated, now, max_reserved, reserved = r["peaks"]
    assert before >= 3 * MiB + now and after_allocated == now, r
    assert max_reserved == reserved, r
    assert r["warned"] == ["FutureWarning", "FutureWarning"], r


def test_memory_fraction_refuses_allocations_past_it(torch_json):
    r = torch_json("""
        MiB = 1 << 20
        torch.accel.set_per_process_memory_fraction(0.25)                   # 64 MiB of 256
        ooms = torch.accel.memory_stats()["num_ooms"]
        try:
            torch.empty(100 * MiB, dtype=torch.uint8, device="accel")
            report(refused=None)
        except torch.OutOfMemoryError as e:
            report(refused=str(e))
        small = torch.ones(10 * MiB // 4, device="accel")                  # under it: fine
        report(ooms=torch.accel.memory_stats()["num_ooms"] - ooms, small=small[-1].item(),
               reserved=torch.accel.memory_reserved())
        torch.accel.set_per_process_memory_fraction(1.0)                    # the device fits it
        again = torch.empty(100 * MiB, dtype=torch.uint8, device="accel")
        report(again=again.numel())
        errors = []
        for bad in (1, 1.5, -0.1):
            try:
                torch.accel.set_per_process_memory_fraction(bad)
            except (TypeError, ValueError) as e:
                errors.append([type(e).__name__, str(e)])
        report(errors=errors)
    """)
    assert r["refused"] is not None and r["refused"].startswith(
        "accel out of memory. Tried to allocate 100.00 MiB"), r
    assert "This process may hold 64.00 MiB" in r["refused"], r
    assert r["ooms"] == 1 and r["small"] == 1.0 and r["reserved"] <= 64 * MiB, r
    assert r["again"] == 100 * MiB, r
    assert r["errors"] == [["TypeError", "Invalid type for fraction argument, must be `float`"],
                           ["ValueError", "Invalid fraction value: 1.5. Allowed range: 0~1"],
                           ["ValueError", "Invalid fraction value: -0.1. Allowed range: 0~1"]], r
