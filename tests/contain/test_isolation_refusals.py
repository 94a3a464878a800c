"""Reaching for another tenant's resources: refused with EPERM or EACCES, counted, logged.

Root's process (this test's, through raw transactions) holds a context, a queue, an
allocation, an export and a module on device 0. Another user, in a fresh interpreter that
never was root (``other_user``), names each of them from a context of its own; every
attempt fails with its exact errno, each kind's counter in
``sys/class/accel/accel0/isolation/`` moves by exactly the attempts of that kind, the daemon
logs who tried (rate-limited), and root's resources are intact and still work.
"""

from __future__ import annotations

import errno
import json
import os
import re

import pytest
from rawdev import RawDev
from refusals import isolation_refusals

from abi import uapi
from kmod_emul.isolation import KINDS
from kmod_emul.ratelimit import LOG_BURST
from runtime._shm import sealed_memfd
from runtime.kernels import compile_module
from testkit.contained import assert_contained, snapshot

pytestmark = pytest.mark.timeout(180)

#: root's module: its handle is what the other user names
MODULE = json.dumps(compile_module('def fill(out: "float32", v: "float32"):\n    out[0] = v\n')
                    ).encode()

#: The other user's attempts, one per line: "<what> <errno name or ok>"
ATTEMPTS = """
import errno, os, sys
from rawdev import RawDev, errname
from abi import uapi
ids = dict(a.split("=") for a in sys.argv[1:])
ids = {k: int(v) for k, v in ids.items()}
root = os.environ["ACCEL_EMU_ROOT"]
cls = root + "/sys/class/accel/accel0/"
with RawDev(__import__("pathlib").Path(root) / "dev/accel/accel0") as dev:
    mine = dev.ctx_create()
    tries = {
        "ctx_destroy": lambda: dev.call(uapi.ACCEL_CMD_CTX_DESTROY,
                                        uapi.accel_ctx_destroy(ctx_id=ids["ctx"])),
        "noop": lambda: dev.call(uapi.ACCEL_CMD_SUBMIT_NOOP,
                                 uapi.accel_submit_noop(ctx_id=ids["ctx"])),
        "queue_destroy": lambda: dev.call(uapi.ACCEL_CMD_QUEUE_DESTROY,
                                          uapi.accel_queue_destroy(ctx_id=mine,
                                                                   queue_id=ids["queue"])),
        "mem_free": lambda: dev.call(uapi.ACCEL_CMD_MEM_FREE,
                                     uapi.accel_mem_free(ctx_id=mine, handle=ids["alloc"])),
        "mem_export": lambda: dev.call(uapi.ACCEL_CMD_MEM_EXPORT,
                                       uapi.accel_mem_export(ctx_id=mine, handle=ids["alloc"])),
        "mem_import": lambda: dev.call(uapi.ACCEL_CMD_MEM_IMPORT, uapi.accel_mem_import(
            ctx_id=mine, export_handle=ids["export"], token=ids["token"] ^ 1)),
        "module_unload": lambda: dev.call(uapi.ACCEL_CMD_MODULE_UNLOAD,
                                          uapi.accel_module_unload(ctx_id=mine,
                                                                   module_id=ids["module"])),
        "reset": lambda: open(cls + "reset", "w").write("1"),
        "debugfs": lambda: os.listdir(root + "/sys/kernel/debug/accel/accel0"),
        "unknown_queue": lambda: dev.call(uapi.ACCEL_CMD_QUEUE_DESTROY,
                                          uapi.accel_queue_destroy(ctx_id=mine,
                                                                   queue_id=1 << 40)),
    }
    for name, fn in tries.items():
        print(name, errname(fn) or "ok", flush=True)
    print("pid", os.getpid())
"""

#: each attempt's errno, and the counter it moves (None: not an isolation refusal)
EXPECTED = {
    "ctx_destroy": ("EPERM", "context"),
    "noop": ("EPERM", "context"),
    "queue_destroy": ("EPERM", "queue"),
    "mem_free": ("EPERM", "allocation"),
    "mem_export": ("EPERM", "allocation"),
    "mem_import": ("EACCES", "export"),
    "module_unload": ("EPERM", "module"),
    "reset": ("EACCES", "privileged"),
    "debugfs": ("EACCES", "privileged"),
    "unknown_queue": ("ENOENT", None),
}


def _counts(d) -> dict[str, int]:
    return {k: int(d.attr(0, f"isolation/{k}")) for k in (*KINDS, "total")}


def _holdings(dev: RawDev, ctx: int) -> dict[str, int]:
    """Root's queue, allocation (exported) and module on ``ctx``: their handles."""
    queue = dev.queue_create(ctx)
    alloc = dev.mem_alloc(ctx, 1 << 20).handle
    export = dev.call(uapi.ACCEL_CMD_MEM_EXPORT, uapi.accel_mem_export(ctx_id=ctx, handle=alloc))
    fd = sealed_memfd("module", len(MODULE), MODULE)
    try:
        module = dev.call(uapi.ACCEL_CMD_MODULE_LOAD, uapi.accel_module_load(
            ctx_id=ctx, fd=fd, size=len(MODULE))).module_id
    finally:
        os.close(fd)
    return {"ctx": ctx, "queue": queue, "alloc": alloc, "export": export.export_id,
            "token": export.token, "module": module}


def test_another_users_reach_for_root_resources_is_refused_counted_and_logged(
        make_daemon, other_user):
    d = make_daemon(devices=1, tenants=True)
    before = snapshot(d)
    with RawDev(d.node(0)) as root:
        ctx = root.ctx_create()
        ids = _holdings(root, ctx)
        counts = _counts(d)
        assert counts == dict.fromkeys(counts, 0)  # a new daemon: nothing refused yet
        out = other_user.run(d, ATTEMPTS, *(f"{k}={v}" for k, v in ids.items()), timeout=120)
        assert out.returncode == 0, out.stderr
        seen = dict(line.split(" ", 1) for line in out.stdout.splitlines())
        pid = seen.pop("pid")
        assert seen == {k: v[0] for k, v in EXPECTED.items()}
        want = dict.fromkeys(KINDS, 0)
        for _errno, kind in EXPECTED.values():
            if kind is not None:
                want[kind] += 1
        want["total"] = sum(want.values())
        assert _counts(d) == want
        # root's resources are all still there and work
        seqno = root.noop(ctx)
        assert root.wait_done(ctx, seqno).completed >= seqno
        root.call(uapi.ACCEL_CMD_QUEUE_DESTROY, uapi.accel_queue_destroy(ctx_id=ctx,
                                                                         queue_id=ids["queue"]))
        root.call(uapi.ACCEL_CMD_MEM_FREE, uapi.accel_mem_free(ctx_id=ctx, handle=ids["alloc"]))
    log = d.log_text()
    lines = re.findall(rf"accel0: refused pid {pid} uid 65534: .*\((EPERM|EACCES)\)", log)
    assert len(lines) == want["total"], log[-4000:]
    assert_contained(d, before)


def test_the_log_of_refusals_is_rate_limited_and_the_count_is_not(make_daemon):
    """A tenant probing in a loop cannot flood the daemon's log: ``LOG_BURST`` lines per
    window, while every attempt is counted."""
    d = make_daemon(devices=1)
    with RawDev(d.node(0)) as victim, RawDev(d.node(0)) as prober:
        theirs = victim.ctx_create()
        prober.ctx_create()
        tries = 3 * LOG_BURST
        base = isolation_refusals(d)
        for _ in range(tries):
            with pytest.raises(OSError) as exc:
                prober.call(uapi.ACCEL_CMD_SUBMIT_NOOP, uapi.accel_submit_noop(ctx_id=theirs))
            assert exc.value.errno == errno.EPERM
        assert isolation_refusals(d) - base == tries
        assert int(d.attr(0, "isolation/context")) == tries
        seqno = victim.noop(theirs)
        assert victim.wait_done(theirs, seqno).completed >= seqno
    assert len(re.findall(r"accel0: refused pid \d+ uid 0: context", d.log_text())) == LOG_BURST
