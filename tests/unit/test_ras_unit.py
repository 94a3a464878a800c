"""RAS in this process (kmod_emul/ras.py, ``VramAllocator.exclude``): no daemon, no firmware.

The allocator keeps bad pages out of every allocation and its books add up whatever is
retired; ``ras_ctrl`` refuses every malformed write with its errno and changes nothing;
the memory errors land in the scope docs/faults.md gives them (with no firmware, a lost
context is only marked: the firmware's part is tests/driver/test_ras.py's)."""

from __future__ import annotations

import errno
import json
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rawdev import OfflineDev, errname

from abi import uapi
from firmware.image import IMAGE_DIR
from kmod_emul import ras
from kmod_emul.errors import DriverError
from kmod_emul.memory import VramAllocator
from kmod_emul.offline import OfflineDriver

pytestmark = pytest.mark.timeout(120)

PAGE = uapi.ACCEL_PAGE_SIZE
MIB = 1 << 20


# --- the allocator ---------------------------------------------------------------------------
def test_a_free_bad_page_is_cut_out_at_once_and_a_held_one_once_freed():
    v = VramAllocator(16 * PAGE)
    assert v.exclude(3 * PAGE) is True
    assert (v.used, v.reserved) == (0, PAGE)
    assert v.alloc(4 * PAGE) == 4 * PAGE  # 0..2 is too small, 3 is out
    held = v.alloc(3 * PAGE)
    assert held == 0
    assert v.exclude(PAGE) is False  # held: nothing changes until it is freed
    assert v.exclude(PAGE) is False  # and once is enough
    assert v.reserved == PAGE
    v.free(held, 3 * PAGE)
    assert (v.used, v.reserved) == (4 * PAGE, 2 * PAGE)
    assert v.alloc(2 * PAGE) == 8 * PAGE  # pages 0 and 2 are free, apart: 1 never returns
    assert (v.alloc(PAGE), v.alloc(PAGE)) == (0, 2 * PAGE)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "free", "exclude"]),
                          st.integers(0, 63), st.integers(1, 9)), max_size=60))
def test_no_allocation_ever_holds_an_excluded_page_and_the_books_add_up(steps):
    v = VramAllocator(64 * PAGE)
    live: dict[int, int] = {}  # offset -> size
    excluded: dict[int, bool] = {}  # page -> excluded while free (reserved at once)
    for op, n, pages in steps:
        if op == "alloc" and (off := v.alloc(pages * PAGE)) is not None:
            assert not any(off <= p < off + pages * PAGE for p in excluded)
            live[off] = pages * PAGE
        elif op == "free" and live:
            off = sorted(live)[n % len(live)]
            v.free(off, live.pop(off))
        elif op == "exclude" and n * PAGE not in excluded:
            held = any(o <= n * PAGE < o + s for o, s in live.items())
            assert v.exclude(n * PAGE) is not held
            excluded[n * PAGE] = not held
        in_allocs = sum(any(o <= p < o + s for o, s in live.items()) for p in excluded)
        assert v.used == sum(live.values())
        assert v.reserved == (len(excluded) - in_allocs) * PAGE
        assert sum(size for _, size in v._free) == v.total - v.used - v.reserved


# --- ras_ctrl on a device -----------------------------------------------------------------------
@pytest.fixture
def driver() -> Iterator[OfflineDriver]:
    with OfflineDriver(IMAGE_DIR, devices=2, memory=4 * MIB) as d:
        yield d


def records(dev) -> list[tuple[int, int | None]]:
    return [(r["code"], r["address"]) for r in dev.faults.records]


def short(value: object) -> str | None:
    """A test id for a long value: its start and its length."""
    return f"{value[:24]}...({len(value)})" if isinstance(value, str) and len(value) > 40 else None


@pytest.mark.parametrize("text, code", [
    ("", errno.EINVAL), ("inject", errno.EINVAL), ("inject memory ce", errno.EINVAL),
    ("inject memory ce 0x10 0x20", errno.EINVAL), ("insert memory ce 0x10", errno.EINVAL),
    ("inject umc ce 0x10", errno.EINVAL), ("inject memory de 0x10", errno.EINVAL),
    ("inject memory CE 0x10", errno.EINVAL), ("inject memory ce -1", errno.EINVAL),
    ("inject memory ce 0x", errno.EINVAL), ("inject memory ce 12ab", errno.EINVAL),
    ("inject memory ce 0b101", errno.EINVAL), ("inject memory ce 1_000", errno.EINVAL),
    (f"inject memory ce {4 * MIB}", errno.EINVAL), (f"inject memory ue {4 * MIB:#x}", errno.EINVAL),
    ("inject link ue", errno.EINVAL), ("inject thermal ce 0x", errno.EINVAL),
    # each a driver bug once (EIO): '²' is isdigit() but not int(); the degrees overflowed
    # the thermal model's float; past 4,300 digits int() refuses; an address past 64 bits
    ("inject memory ce \u00b2", errno.EINVAL), ("inject memory ce \u0663", errno.EINVAL),
    ("inject thermal ce " + "9" * 400, errno.EINVAL), ("inject thermal ue 201", errno.EINVAL),
    ("inject thermal ce " + "9" * 5000, errno.EINVAL),
    ("inject compute ce 0x1" + "0" * 16, errno.EINVAL),
    ("inject firmware ue 18446744073709551616", errno.EINVAL),
    ("inject link ce 0x" + "f" * 3000, errno.EINVAL),
], ids=short)
def test_a_malformed_write_changes_nothing(driver, text, code):
    dev = driver.devices[0]
    before = (dev.ras.err_count("memory"), dev.ras.bad_pages(), len(dev.faults.records))
    with pytest.raises(DriverError) as exc:
        dev.ras.inject(text)
    assert exc.value.errno == code and exc.value.message
    assert (dev.ras.err_count("memory"), dev.ras.bad_pages(), len(dev.faults.records)) == before


def test_correctable_errors_count_and_the_second_at_a_page_retires_it(driver):
    dev = driver.devices[0]
    free = dev.memory.free_bytes()
    dev.ras.inject("inject memory ce 0x5010")
    assert records(dev) == [(92, 0x5010)] and dev.ras.bad_pages() == ""
    dev.ras.inject("inject memory ce 20484")  # decimal, the same page (0x5004)
    assert records(dev)[1:] == [(92, 0x5004), (63, 0x5000)]
    assert dev.ras.bad_pages() == "0x00000005 : 0x00001000 : R"
    assert dev.ras.err_count("memory") == "ue: 0\nce: 2" and dev.ras.retired_pages() == "1"
    assert dev.memory.free_bytes() == free - PAGE and dev.memory_used == 0
    dev.ras.inject("inject memory ce 0x5000")  # in the table already: counted, recorded
    assert records(dev)[3:] == [(92, 0x5000)] and dev.ras.retired_pages() == "1"


def test_uncorrectable_errors_by_who_holds_the_page(driver):
    dev = driver.devices[0]
    with OfflineDev(driver) as victim, OfflineDev(driver) as other, OfflineDev(driver) as peer:
        ctx, other_ctx, peer_ctx = victim.ctx_create(), other.ctx_create(), peer.ctx_create()
        mine = victim.mem_alloc(ctx, 8 * PAGE)
        theirs = other.mem_alloc(other_ctx, 8 * PAGE)
        shared = other.mem_alloc(other_ctx, 8 * PAGE)
        exp = other.call(uapi.ACCEL_CMD_MEM_EXPORT, uapi.accel_mem_export(
            ctx_id=other_ctx, handle=shared.handle))
        peer.call(uapi.ACCEL_CMD_MEM_IMPORT, uapi.accel_mem_import(
            ctx_id=peer_ctx, export_handle=exp.export_id, token=exp.token))
        def at(c: int, alloc) -> int:
            return dev.contexts[c].allocations[alloc.handle].backing.offset

        dev.ras.inject(f"inject memory ue {at(ctx, mine) + 3 * PAGE + 8:#x}")
        assert "MEMORY_UE_CONTAINED" in (dev.contexts[ctx].lost or "")
        assert dev.contexts[other_ctx].lost is None and dev.contexts[peer_ctx].lost is None
        rec = dev.faults.records[-2]
        assert (rec["code"], rec["context"], rec["pid"], rec["contexts"]) == (
            94, ctx, victim.file.pid, [ctx])
        assert dev.faults.records[-1]["code"] == 64  # held: pending
        assert dev.ras.bad_pages().endswith(": P")
        assert dev.state == uapi.DeviceState.OPERATIONAL
        assert errname(lambda: victim.mem_alloc(ctx, PAGE)) == "ENODEV"
        other.mem_alloc(other_ctx, PAGE)  # the others go on
        dev.ras.inject(f"inject memory ue {at(ctx, mine):#x}")  # a lost context's: no reset
        assert [r["code"] for r in dev.faults.records][-2:] == [48, 64]
        assert dev.state == uapi.DeviceState.OPERATIONAL
        assert at(other_ctx, theirs) not in (at(ctx, mine), at(other_ctx, shared))
        dev.ras.inject(f"inject memory ue {at(other_ctx, shared):#x}")  # exporter and importer
        rec = dev.faults.records[-3]
        assert (rec["code"], sorted(rec["contexts"])) == (95, sorted([other_ctx, peer_ctx]))
        assert dev.ras.err_count("memory") == "ue: 3\nce: 0"
        assert dev.state == uapi.DeviceState.IN_RESET
        assert "MEMORY_UE_UNCONTAINED" in dev.reset_reason
    # everything freed: the pending pages stay out of the free list
    assert dev.memory_used == 0
    assert dev.memory.free_bytes() == dev.memory_total - 3 * PAGE
    dev.ras.retire_pending()  # what the reset's boot does
    assert [line[-1] for line in dev.ras.bad_pages().splitlines()] == ["R", "R", "R"]


def test_an_error_where_nothing_is_allocated_retires_the_page_now(driver):
    dev = driver.devices[0]
    dev.ras.inject("inject memory ue 0x3fffff")
    assert records(dev) == [(48, 0x3FFFFF), (63, 0x3FF000)]
    assert dev.faults.records[0]["bank"] == 7
    assert dev.ras.bad_pages() == "0x000003ff : 0x00001000 : R"
    assert driver.devices[1].ras.bad_pages() == ""  # per device


def test_a_full_table_fails_the_retirement_and_the_page_stays_in_service(driver, monkeypatch):
    monkeypatch.setattr(ras, "MAX_BAD_PAGES", 2)
    dev = driver.devices[0]
    for page in (1, 2, 3):
        dev.ras.inject(f"inject memory ue {page * PAGE:#x}")
    assert dev.ras.bad_pages().splitlines()[2] == "0x00000003 : 0x00001000 : F"
    assert dev.faults.records[-1]["code"] == 65
    assert dev.memory.free_bytes() == dev.memory_total - 2 * PAGE


def test_engine_errors(driver):
    dev = driver.devices[0]
    dev.ras.inject("inject compute ce 0")
    dev.ras.inject("inject copy ce 0x2")
    assert records(dev) == [(121, 0), (123, 2)] and dev.state == uapi.DeviceState.OPERATIONAL
    dev.ras.inject("inject copy ue 0")
    assert [r["code"] for r in dev.faults.records][2:] == [124, 120]
    assert dev.state == uapi.DeviceState.IN_RESET
    assert dev.ras.err_count("copy") == "ue: 1\nce: 1"
    assert dev.ras.err_count("compute") == "ue: 0\nce: 1"
    with pytest.raises(DriverError) as exc:  # not while it resets
        dev.ras.inject("inject compute ue 0")
    assert exc.value.errno == errno.EAGAIN and dev.ras.err_count("compute") == "ue: 0\nce: 1"


def test_the_table_persists_per_uuid(driver, tmp_path):
    dev = driver.devices[0]
    first = ras.Ras(dev, tmp_path)
    dev.ras = first
    first.inject("inject memory ue 0x7000")
    saved = json.loads((tmp_path / "ras" / f"{dev.identity.uuid}.json").read_text())
    assert [(p["pfn"], p["status"], p["cause"]) for p in saved["bad_pages"]] == [(7, "R", "ue")]
    with OfflineDev(driver) as holder:  # a page pending when the daemon stops
        ctx = holder.ctx_create()
        held = holder.mem_alloc(ctx, PAGE)
        offset = dev.contexts[ctx].allocations[held.handle].backing.offset
        first.inject(f"inject memory ue {offset:#x}")
    assert [line[-1] for line in first.bad_pages().splitlines()] == ["R", "P"]
    fresh = OfflineDriver(IMAGE_DIR, devices=1, memory=4 * MIB)  # the next daemon's device
    try:
        again = ras.Ras(fresh.devices[0], tmp_path)
        assert fresh.devices[0].memory.vram.reserved == 2 * PAGE  # out of the free list
        again.retire_pending()  # its first boot
        assert [line[-1] for line in again.bad_pages().splitlines()] == ["R", "R"]
    finally:
        fresh.close()
    assert ras.Ras(driver.devices[1], tmp_path).bad_pages() == ""  # another UUID: its own
    other = tmp_path / "ras" / f"{driver.devices[1].identity.uuid}.json"
    other.write_text("{not json")
    assert ras.Ras(driver.devices[1], tmp_path).bad_pages() == ""  # logged, started empty
    assert other.with_suffix(".corrupt").read_text() == "{not json" and not other.exists()
