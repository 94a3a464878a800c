"""RAS on a real mount (kmod_emul/ras.py, docs/faults.md "RAS and page retirement"):
errors injected through debugfs ``ras_ctrl``, counted and recorded; memory errors retire
pages, which no allocation gets again and which stay retired across a daemon restart;
uncorrectable engine and firmware errors reset the device. Raw clients (tests/rawdev.py)
hold the memory the errors hit; the runtime's view of a lost context is
tests/runtime/test_fault_scope_context.py's."""

from __future__ import annotations

import errno
import json
import time

import pytest
from rawdev import RawDev, errname

from abi import uapi, userq
from testkit.tenants import tenant_code
from testkit.waiting import wait_until

PAGE = uapi.ACCEL_PAGE_SIZE
MIB = 1 << 20


NOP = userq.Nop().encode()


def inject(d, text: str, dev: int = 0) -> None:
    d.debug(dev, "ras_ctrl").write_text(text)


def codes(d, dev: int = 0) -> list[int]:
    return [json.loads(line)["code"] for line in d.attr(dev, "fault_log").splitlines()]


def last_records(d, n: int, dev: int = 0) -> list[dict]:
    return [json.loads(line) for line in d.attr(dev, "fault_log").splitlines()[-n:]]


def vram_mm(d, dev: int = 0) -> list[tuple[int, int, int, str]]:
    """(offset, size, pid, contexts) of each device-local allocation (debugfs vram_mm)."""
    rows = d.debug(dev, "vram_mm").read_text().splitlines()[1:]
    return [(int(o, 16), int(s, 16), int(p), c) for o, s, p, c in (r.split() for r in rows)]


def offset_of(d, ctx: int, dev: int = 0) -> int:
    """Where the (one) allocation context ``ctx`` alone reaches starts in VRAM."""
    (offset,) = [o for o, _, _, c in vram_mm(d, dev) if c == str(ctx)]
    return offset


def test_correctable_errors_retire_a_page_on_the_second_and_it_is_never_allocated_again(
        make_daemon):
    d = make_daemon(extra=["--memory", "16M"])
    total = 16 * MIB
    bad = 5 * MIB + 512 * 1024  # a page in the middle, so both sides have room
    inject(d, f"inject memory ce {bad + 0x10:#x}")
    rec = last_records(d, 1)[0]
    assert (rec["code"], rec["address"], rec["bank"], rec["corrected"]) == (92, bad + 0x10, 2, True)
    assert d.attr(0, "ras/memory_err_count") == "ue: 0\nce: 1"
    assert d.attr(0, "bad_pages") == "" and d.attr(0, "retired_pages") == "0"
    inject(d, f"inject memory ce {bad + 0x800}")  # decimal, the same page
    assert codes(d) == [92, 92, 63]
    assert d.attr(0, "bad_pages") == f"0x{bad // PAGE:08x} : 0x00001000 : R"
    assert d.attr(0, "retired_pages") == "1"
    assert d.attr(0, "ras/bad_page_details").startswith(f"0x{bad // PAGE:08x} : R : ce : ")
    assert (d.attr(0, "memory_used"), d.attr(0, "memory_free")) == ("0", str(total - PAGE))
    # the whole device, in 1 MiB pieces then in pages: no allocation covers the bad page
    with RawDev(d.node(0)) as dev:
        ctx = dev.ctx_create()
        for size in (MIB, PAGE):
            def alloc(size: int = size) -> str:
                return errname(lambda: dev.mem_alloc(ctx, size))

            while alloc() == "":
                pass
            assert alloc() == "ENOMEM"
        rows = vram_mm(d)
        assert not [r for r in rows if r[0] <= bad < r[0] + r[1]]
        assert sum(r[1] for r in rows) == total - PAGE
        assert (d.attr(0, "memory_used"), d.attr(0, "memory_free")) == (str(total - PAGE), "0")
    d.wait_attrs(0, {"memory_used": "0", "memory_free": str(total - PAGE), "contexts": "0"})


def test_an_uncorrectable_error_where_nothing_is_allocated_retires_the_page_now(make_daemon):
    d = make_daemon(devices=2)
    inject(d, "inject memory ue 0xfffffff")  # the last byte
    assert codes(d) == [48, 63] and codes(d, 1) == []
    assert [r["address"] for r in last_records(d, 2)] == [0xFFFFFFF, 0xFFFF000]
    assert d.attr(0, "bad_pages") == "0x0000ffff : 0x00001000 : R"
    assert d.attr(0, "ras/memory_err_count") == "ue: 1\nce: 0"
    assert d.attr(0, "reset_count") == "0" and d.attr(1, "bad_pages") == ""


def test_a_page_in_use_is_pending_until_a_reset_and_stays_retired_across_a_restart(make_daemon):
    d = make_daemon()
    with RawDev(d.node(0)) as victim, RawDev(d.node(0)) as other:
        ctx, other_ctx = victim.ctx_create(), other.ctx_create()
        victim.mem_alloc(ctx, 64 * PAGE)
        other.mem_alloc(other_ctx, 64 * PAGE)
        queue = victim.queue_create(ctx)
        ring = victim.rings[queue][1]
        ran = victim.submit(queue, [NOP])
        wait_until(lambda: ring.completed, 10, f"the no-op {ran} to complete",
                   ok=lambda done: done >= ran)
        bad = offset_of(d, ctx) + 5 * PAGE
        inject(d, f"inject memory ue {bad + 4:#x}")
        contained, pending = last_records(d, 2)
        assert (contained["code"], contained["context"], contained["contexts"],
                contained["scope"]) == (94, ctx, [ctx], "context")
        assert (pending["code"], pending["address"]) == (64, bad)
        assert d.attr(0, "bad_pages") == f"0x{bad // PAGE:08x} : 0x00001000 : P"
        # that context alone is lost: its commands answer ENODEV, the lost word is set
        assert errname(lambda: victim.mem_alloc(ctx, PAGE)) == "ENODEV"
        assert errname(lambda: victim.noop(ctx)) == "ENODEV"
        assert victim.db.get(userq.DB_LOST) == errno.ENODEV
        victim.submit(queue, [NOP] * 3)  # the firmware no longer runs its queues
        time.sleep(0.5)
        assert ring.completed == ran
        other.mem_alloc(other_ctx, PAGE)
        seqno = other.noop(other_ctx)
        assert other.wait_done(other_ctx, seqno).completed >= seqno
        assert d.attr(0, "state") == "operational" and d.attr(0, "contexts") == "2"
    # freed: the page stays out of the free list, still pending until the reset
    d.wait_attrs(0, {"memory_used": "0", "contexts": "0",
                     "memory_free": str(256 * MIB - PAGE)})
    (d.root / uapi.CLASS_DIR / "accel0" / "reset").write_text("1")
    d.wait_attrs(0, {"state": "operational", "reset_count": "1"})
    assert d.attr(0, "bad_pages") == f"0x{bad // PAGE:08x} : 0x00001000 : R"
    assert codes(d)[-2:] == [120, 63]
    d.stop()
    d.start()  # the same state directory: the same UUID, its table
    assert d.attr(0, "bad_pages") == f"0x{bad // PAGE:08x} : 0x00001000 : R"
    assert d.attr(0, "retired_pages") == "1" and d.attr(0, "memory_free") == str(256 * MIB - PAGE)
    assert d.attr(0, "ras/memory_err_count") == "ue: 0\nce: 0"  # counters are this daemon's


def test_an_uncorrectable_error_in_shared_memory_resets_the_device(make_daemon):
    d = make_daemon()
    with RawDev(d.node(0)) as owner, RawDev(d.node(0)) as importer:
        ctx, imp_ctx = owner.ctx_create(), importer.ctx_create()
        alloc = owner.mem_alloc(ctx, 16 * PAGE)
        exp = owner.call(uapi.ACCEL_CMD_MEM_EXPORT, uapi.accel_mem_export(
            ctx_id=ctx, handle=alloc.handle))
        importer.call(uapi.ACCEL_CMD_MEM_IMPORT, uapi.accel_mem_import(
            ctx_id=imp_ctx, export_handle=exp.export_id, token=exp.token))
        (offset,) = [o for o, _, _, c in vram_mm(d) if sorted(c.split(",")) == sorted(
            [str(ctx), str(imp_ctx)])]
        inject(d, f"inject memory ue {offset:#x}")
        d.wait_attrs(0, {"state": "operational", "reset_count": "1"})
        assert errname(lambda: owner.noop(ctx)) == "ENODEV"
        assert errname(lambda: importer.noop(imp_ctx)) == "ENODEV"
    recs = [json.loads(line) for line in d.attr(0, "fault_log").splitlines()]
    assert [r["code"] for r in recs] == [95, 64, 120, 63]
    assert sorted(recs[0]["contexts"]) == sorted([ctx, imp_ctx])
    assert "MEMORY_UE_UNCONTAINED" in d.attr(0, "reset_reason")
    assert d.attr(0, "bad_pages") == f"0x{offset // PAGE:08x} : 0x00001000 : R"


def test_engine_errors_count_and_an_uncorrectable_one_resets_the_device(make_daemon):
    d = make_daemon(devices=2)
    inject(d, "inject compute ce 0")
    inject(d, "inject copy ce 0x40")
    assert codes(d) == [121, 123] and d.attr(0, "reset_count") == "0"
    inject(d, "inject compute ue 0")
    d.wait_attrs(0, {"state": "operational", "reset_count": "1"})
    assert codes(d) == [121, 123, 122, 120]
    assert d.attr(0, "reset_reason") == ("uncorrectable compute-engine error (fault 122 "
                                         "COMPUTE_UE)")
    assert d.attr(0, "ras/compute_err_count") == "ue: 1\nce: 1"
    assert d.attr(0, "ras/copy_err_count") == "ue: 0\nce: 1"
    assert d.attr(1, "reset_count") == "0" and codes(d, 1) == []


def test_an_uncorrectable_firmware_error_kills_it_and_recovery_resets_the_device(make_daemon):
    d = make_daemon()
    fw = d.debug(0, "fw_pid").read_text().strip()
    inject(d, "inject firmware ce 0")
    assert codes(d) == [126] and d.debug(0, "fw_pid").read_text().strip() == fw
    inject(d, "inject firmware ue 0")
    d.wait_attrs(0, {"state": "operational", "reset_count": "1"})
    assert codes(d) == [126, 127, 79, 120]
    assert d.debug(0, "fw_pid").read_text().strip() != fw
    assert "firmware process exited unexpectedly (status -9)" in d.attr(0, "last_failure")
    assert d.attr(0, "ras/firmware_err_count") == "ue: 1\nce: 1"


MALFORMED = [
    ("inject memory ce", errno.EINVAL), ("inject memory ce 0x10 0x20", errno.EINVAL),
    ("disable memory ce 0x10", errno.EINVAL), ("inject umc ce 0x10", errno.EINVAL),
    ("inject memory fatal 0x10", errno.EINVAL), ("inject memory ce 0xzz", errno.EINVAL),
    ("inject memory ce -4096", errno.EINVAL), (f"inject memory ue {256 * MIB:#x}", errno.EINVAL),
    ("inject link ue", errno.EINVAL), ("inject thermal ce 90 C", errno.EINVAL),
]


def test_a_malformed_write_answers_its_errno_and_harms_nothing(make_daemon, other_user):
    d = make_daemon(tenants=True)
    with RawDev(d.node(0)) as bystander:
        ctx = bystander.ctx_create()
        bystander.mem_alloc(ctx, 16 * PAGE)
        before = {k: d.attr(0, k) for k in ("fault_log", "bad_pages", "memory_used",
                                            "ras/memory_err_count", "ras/link_err_count")}
        for text, code in MALFORMED:
            with pytest.raises(OSError) as exc:
                inject(d, text)
            assert exc.value.errno == code, text
        with pytest.raises(OSError) as exc:  # write-only, and bad_pages read-only
            d.debug(0, "ras_ctrl").read_text()
        assert exc.value.errno == errno.EACCES
        with pytest.raises(OSError) as exc:
            (d.root / uapi.CLASS_DIR / "accel0" / "bad_pages").write_text("")
        assert exc.value.errno == errno.EACCES
        out = other_user.run(d, tenant_code(f"""
            try:
                open({str(d.debug(0, "ras_ctrl"))!r}, "w").write("inject memory ue 0")
                print("written")
            except OSError as exc:
                print(errno.errorcode[exc.errno])
        """))
        assert out.stdout.strip() == "EACCES", out.stderr
        assert {k: d.attr(0, k) for k in before} == before
        seqno = bystander.noop(ctx)
        assert bystander.wait_done(ctx, seqno).completed >= seqno
    assert d.attr(0, "state") == "operational" and d.attr(0, "reset_count") == "0"
