"""The package/link scope, injected through ``ras_ctrl``: an uncorrectable link error on
device 0 loses device 0's contexts (record 74; the runtime refuses their arrays), makes a
copy packet across the link fail with ENOLINK on its stream only (record 76) while local work on device 1 goes on, drains
device 1, resets device 0 (package reset) and brings the link back; a correctable one is
counted and recorded and changes nothing. A tenant of device 1 never notices."""

from __future__ import annotations

import json

import pytest

from testkit.bystander import Bystander
from testkit.contained import assert_contained, snapshot

#: a on device 0, copied across the link into b on device 1; ``copied`` counts the
#: elements that arrived wrong
PEER_COPY = """
import json, os, sys, numpy as np, runtime
from abi import userq
x = np.arange(1 << 14, dtype=np.float32)
a = runtime.to_device(x, device=0)
b = runtime.empty(x.shape, np.float32, device=1)
runtime.enable_peer_access(0, device=1)
s1 = runtime.Stream(1)
s1.wait_stream(runtime.current_stream(0))
b.copy_(a, stream=s1); s1.synchronize()
copied = int(np.count_nonzero(b.copy_to_host() != x))
"""

LINK_USER = PEER_COPY + """
debug = os.path.join(os.environ["ACCEL_EMU_ROOT"], "sys/kernel/debug/accel/accel0/")
out = {"before": copied}
open(debug + "reset_hold", "w").write("1")        # keep the package in reset a while
open(debug + "ras_ctrl", "w").write("inject link ue 0x1000")
try:
    a.copy_to_host()
except runtime.DeviceLostError as exc:
    out["lost"] = exc.record["code"]
try:
    b.copy_(a, stream=runtime.Stream(1))
except runtime.DeviceLostError as exc:          # the runtime refuses a lost source
    out["runtime copy"] = exc.record["code"]
s1 = runtime.Stream(1)                          # a raw packet reaches the link: ENOLINK
s1.submit([userq.Copy(b.va, a.va, a.nbytes)])
try:
    s1.synchronize()
except runtime.DeviceFaultError as exc:
    out["peer copy"] = (exc.record["code"], exc.record["errno"], exc.record["scope"])
local = runtime.to_device(x * 2, device=1)          # device 1's own work goes on
out["local"] = int(np.count_nonzero(local.copy_to_host() != x * 2))
out["link while held"] = open(os.path.join(os.environ["ACCEL_EMU_ROOT"],
                              "sys/class/accel/accel0/link_state")).read().strip()
open(debug + "reset_hold", "w").write("0")
print(json.dumps(out), flush=True)
"""

AFTER = PEER_COPY + """
print(json.dumps(copied))
"""



@pytest.mark.timeout(120)
def test_a_link_error_drains_the_peer_and_resets_the_package(make_daemon):
    d = make_daemon(devices=2)
    before = snapshot(d)
    with Bystander(d, 1) as tenant:
        out = d.run_py(LINK_USER, timeout=90)
        assert out.returncode == 0, out.stderr
        got = json.loads(out.stdout)
        assert got == {"before": 0, "lost": 74, "runtime copy": 74,
                       "peer copy": [76, "ENOLINK", "queue"], "local": 0,
                       "link while held": "down"}, got
        d.wait_state(0, "operational")
        tenant.check()
    assert d.attr(0, "link_state") == "up"
    assert d.attr(0, "reset_count") == "1"
    assert "link error on fabric0:port0" in d.attr(0, "reset_reason")
    link = [r for r in d.fault_log(0) if r["code"] == 74]
    assert len(link) == 1 and link[0]["scope"] == "package"
    assert (link[0]["link"], link[0]["action"], link[0]["address"]) == (
        "fabric0:port0", "drain-and-reset", 0x1000)
    assert [r["code"] for r in d.fault_log(1)] == [76]  # only the copy across the link
    assert d.attr(1, "reset_count") == "0"
    after = d.run_py(AFTER, timeout=60)  # the link is back for a fresh process
    assert after.returncode == 0, after.stderr
    assert json.loads(after.stdout) == 0, after.stdout  # elements wrong

    assert_contained(d, before, reset=(0,))  # device 1's firmware is the one from before


def test_a_correctable_link_error_is_counted_and_changes_nothing(make_daemon):
    d = make_daemon(devices=2)
    before = snapshot(d)
    with Bystander(d, 0) as tenant:
        d.debug(0, "ras_ctrl").write_text("inject link ce 0")
        tenant.check()
    assert_contained(d, before)
    assert [(r["code"], r["corrected"], r["link"]) for r in d.fault_log(0)] == [
        (125, True, "fabric0:port0")]
    assert d.attr(0, "ras/link_err_count").splitlines() == ["ue: 0", "ce: 1"]
    assert (d.attr(0, "link_state"), d.attr(0, "reset_count")) == ("up", "0")
