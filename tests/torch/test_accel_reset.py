"""After a device reset (sysfs ``reset``, as an operator or the driver's recovery does it)
every entry point of the C++ shim (torch_accel/csrc/shim.cpp) either answers or raises an
exception the program catches, twice in a row, and the process lives on: a Python
exception must never leave the shim as std::terminate. Those torch calls from destructors
(a stream guard putting the stream back, deleters, event destruction) print it instead.
Each scenario is a fresh process on a private daemon: these tests reset its device."""

from __future__ import annotations

import pytest
from test_accel_plans import PLAN_HELPERS

pytestmark = pytest.mark.timeout(240)

#: ``reset()``: the device reset through sysfs, back to operational (its contexts lost)
RESET = """
from runtime import discovery
def reset():
    open(os.environ["ACCEL_EMU_ROOT"] + "/sys/class/accel/accel0/reset", "w").write("1")
    deadline = time.monotonic() + 30
    while discovery.read_attr("accel0", "state") != "operational":
        assert time.monotonic() < deadline
        time.sleep(0.02)
def outcome(fn):
    try:
        fn()
        return "ok"
    except Exception as exc:
        return type(exc).__name__
"""

#: one torch call per shim entry point that calls into Python (the guard's, the
#: allocators', the hooks', the kernels'), each made on state from before the reset
ENTRY_POINTS = RESET + """
x = torch.ones(4, device="accel")
s = torch.Stream(device="accel")
start, end = (torch.Event(device="accel", enable_timing=True) for _ in range(2))
start.record(); end.record()
pinned = torch.ones(4).pin_memory()
doomed = {"x": x, "event": start, "pinned": pinned}
torch.accelerator.synchronize()
reset()
def stream_context():
    with s:
        pass
def device_context():
    with torch.accelerator.device_index(0):
        pass
CALLS = {
    "getDevice": torch.accelerator.current_device_index,
    "setDevice": lambda: torch.accelerator.set_device_index(0),
    "exchangeDevice": device_context,
    "getStream": torch.accelerator.current_stream,
    "getNewStream": lambda: torch.Stream(device="accel"),
    "exchangeStream": stream_context,
    "queryStream": s.query,
    "synchronizeStream": s.synchronize,
    "synchronizeDevice": torch.accelerator.synchronize,
    "record": lambda: torch.Event(device="accel").record(),
    "block": lambda: end.wait(s),
    "queryEvent": end.query,
    "synchronizeEvent": end.synchronize,
    "elapsedTime": lambda: start.elapsed_time(end),
    "destroyEvent": lambda: doomed.pop("event", None),
    "allocate": lambda: torch.empty(4, device="accel"),
    "empty_strided": lambda: torch.empty_strided((2, 2), (1, 2), device="accel"),
    "free": lambda: doomed.pop("x", None),
    "resize_": lambda: torch.empty(0, device="accel").resize_(64),
    "resizePrivateUse1Bytes": lambda: torch.empty(0, device="accel").untyped_storage().resize_(64),
    "emptyCache": torch.accelerator.empty_cache,
    "getDeviceStats": torch.accelerator.memory_stats,
    "resetPeakStats": torch.accelerator.reset_peak_memory_stats,
    "getMemoryInfo": torch.accelerator.get_memory_info,
    "recordStream": lambda: torch.ones(4, device="accel").record_stream(s),
    "pinned allocate": lambda: torch.empty(4, pin_memory=True),
    "pinned free": lambda: doomed.pop("pinned", None),
    "isPinnedPtr": lambda: torch.ones(4).is_pinned(),
    "getNewGenerator": lambda: torch.Generator(device="accel"),
    "getDefaultGenerator": lambda: torch.accel.manual_seed(0),
    "deviceCount": torch.accelerator.device_count,
    "isAvailable": torch.accelerator.is_available,
    "tensor.cpu": lambda: torch.ones(4, device="accel").cpu(),
}
report(outcomes={name: [outcome(call), outcome(call)] for name, call in CALLS.items()})
try:
    torch.ones(4, device="accel").cpu()
    report(last="ran")
except RuntimeError as exc:
    report(last=[type(exc).__name__, isinstance(exc, runtime.DeviceLostError)])
"""


def test_every_shim_entry_point_survives_a_reset(make_daemon, torch_json):
    r = torch_json(ENTRY_POINTS)
    outcomes = r["outcomes"]
    assert len(outcomes) == 33, outcomes
    assert {o for pair in outcomes.values() for o in pair} <= {"ok", "DeviceLostError"}, outcomes
    # the lost context's work raises the loss, as an exception: the process is here
    for name in ("allocate", "empty_strided", "synchronizeDevice", "tensor.cpu"):
        assert outcomes[name][1] == "DeviceLostError", (name, outcomes)
    # what needs no device answers
    for name in ("getDevice", "setDevice", "deviceCount", "isAvailable", "free",
                 "destroyEvent", "pinned free", "isPinnedPtr", "getNewGenerator"):
        assert outcomes[name] == ["ok", "ok"], (name, outcomes)
    assert r["last"] == ["DeviceLostError", True], r


#: The crash of issue 31: a backward function that finds the device reset under it. The
#: autograd engine's stream guard puts the forward's stream back in its destructor; that
#: call raised DeviceLostError there, and the process aborted (std::terminate).
RESET_IN_BACKWARD = RESET + """
class ResetInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()
    @staticmethod
    def backward(ctx, grad):
        reset()
        return grad
a = torch.ones(4, device="accel", requires_grad=True)
loss = ResetInBackward.apply(a * 2).sum()
report(forward=loss.item())
report(backward=outcome(lambda: loss.backward()))
try:
    a.cpu()
    report(next_cpu="ran")
except RuntimeError as exc:
    report(next_cpu=[type(exc).__name__, isinstance(exc, runtime.DeviceLostError)])
"""


def test_a_reset_under_a_backward_function_raises_instead_of_aborting(make_daemon, torch_json):
    r = torch_json(RESET_IN_BACKWARD)
    assert r["forward"] == 8.0, r
    assert r["backward"] in ("ok", "DeviceLostError"), r
    assert r["next_cpu"] == ["DeviceLostError", True], r


PLANS_ACROSS_RESET = RESET + PLAN_HELPERS + """
a, b = torch.randn(4096), torch.randn(4096)
da, db = a.to("accel"), b.to("accel")
check("before", da + db, a + b)
old_table = plans()
old_plan = next(p for p in old_table.values() if p is not None)
torch.accel.synchronize()
reset()
try:
    da + db
    report(after="ran")
except RuntimeError as exc:
    report(after=type(exc).__name__)
runtime.recover(0)
da, db = a.to("accel"), b.to("accel")
check("recovered", da + db, a + b)
new_table = plans()
new_plan = next(p for p in new_table.values() if p is not None)
report(new_table=new_table is not old_table, old_kept=len(old_table),
       new_module=new_plan.launch.kernel.module is not old_plan.launch.kernel.module, bad=bad)
"""


def test_a_device_reset_drops_the_plans_with_the_context(make_daemon, torch_json):
    r = torch_json(PLANS_ACROSS_RESET)
    # the plan of before the reset is not launched on the lost context...
    assert r["after"] == "DeviceLostError", r
    # ...and the recovered device plans again, on its new module
    assert r["new_table"] is True and r["new_module"] is True, r
    assert r["bad"] == [], r


@pytest.fixture
def daemon(make_daemon):
    """A private daemon for each test (overrides the session's): these reset device 0."""
    return make_daemon(devices=2)


@pytest.fixture
def torch_runner(daemon):
    """The private daemon runs the snippets in new interpreters (the session's zygote
    serves the session's daemon)."""
    return daemon
