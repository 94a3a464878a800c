"""Errors a torch user meets on accel are torch's: tensors on two devices raise torch's own
"Expected all tensors to be on the same device" RuntimeError (the CPU's and CUDA's
TensorIterator wording), and the runtime's device errors are RuntimeErrors, so code
written for torch.cuda catches them. What happens after a device reset is
test_accel_reset.py's."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(180)

TWO_DEVICES = "Expected all tensors to be on the same device, but found at least two devices"


def test_tensors_on_two_devices_raise_torchs_error(torch_json):
    r = torch_json("""
        a, b = torch.ones(4, device="accel:0"), torch.ones(4, device="accel:1")
        m0, m1 = torch.ones(2, 2, device="accel:0"), torch.ones(2, 2, device="accel:1")
        def refusal(fn):
            try:
                fn()
                return "ran"
            except Exception as exc:
                return [type(exc).__module__ + "." + type(exc).__name__, str(exc)]
        report(add=refusal(lambda: a + b), mul=refusal(lambda: b * a),
               add_=refusal(lambda: a.add_(b)),
               where=refusal(lambda: torch.where(a > 0, a, b)),
               mm=refusal(lambda: m0 @ m1), addmm=refusal(lambda: torch.addmm(m1, m0, m0)),
               cpu=refusal(lambda: a + torch.ones(4)),
               cpu_scalar=(a + torch.tensor(2.0)).cpu().tolist(),
               untouched=a.cpu().tolist())
    """)
    assert r["add"] == ["builtins.RuntimeError", f"{TWO_DEVICES}, accel:0 and accel:1!"], r
    assert r["mul"] == ["builtins.RuntimeError", f"{TWO_DEVICES}, accel:1 and accel:0!"], r
    for op in ("add_", "where", "mm"):
        assert r[op] == ["builtins.RuntimeError", f"{TWO_DEVICES}, accel:0 and accel:1!"], r
    assert r["addmm"] == ["builtins.RuntimeError", f"{TWO_DEVICES}, accel:1 and accel:0!"], r
    assert r["cpu"] == ["builtins.RuntimeError", f"{TWO_DEVICES}, accel:0 and cpu!"], r
    assert r["cpu_scalar"] == [3.0] * 4 and r["untouched"] == [1.0] * 4, r


def test_device_errors_are_runtime_errors_and_oom_is_torchs(torch_json):
    """torch.cuda's kinds: OOM is torch.OutOfMemoryError; a lost device or a fault is a
    RuntimeError that is also the runtime's own class (its errno, its fault record)."""
    r = torch_json("""
        try:
            torch.empty(1 << 40, dtype=torch.uint8, device="accel")
            oom = "allocated"
        except RuntimeError as exc:  # as torch.cuda's users catch it
            oom = type(exc).__module__ + "." + type(exc).__name__
        report(oom=oom, kinds={c.__name__: issubclass(c, RuntimeError) for c in (
            runtime.DeviceLostError, runtime.DeviceFaultError, runtime.KernelFaultError,
            runtime.OutOfMemoryError)})
    """)
    assert r["oom"] == "torch.OutOfMemoryError", r
    assert all(r["kinds"].values()), r


def test_a_refusal_in_any_shim_entry_point_is_a_catchable_exception(torch_json):
    """The shim's entry points that take a device index, given one out of range: each
    raises torch's RuntimeError (the Python hook's refusal, through C++), as torch.cuda
    does, and the process carries on."""
    r = torch_json("""
        def outcome(fn):
            try:
                fn()
                return "ran"
            except Exception as exc:
                return type(exc).__name__
        calls = {
            "setDevice": lambda: torch.accelerator.set_device_index(9),
            "exchangeDevice": lambda: torch.accelerator.device_index(9).__enter__(),
            "allocate": lambda: torch.empty(4, device="accel:9"),
            "empty_strided": lambda: torch.empty_strided((2,), (1,), device="accel:9"),
            "getNewStream": lambda: torch.Stream(device="accel:9"),
            "synchronizeDevice": lambda: torch.accelerator.synchronize(9),
            "getDeviceStats": lambda: torch.accelerator.memory_stats(9),
            "getMemoryInfo": lambda: torch.accelerator.get_memory_info(9),
            "resetPeakStats": lambda: torch.accelerator.reset_peak_memory_stats(9),
            "getDefaultGenerator": lambda: torch.accel.manual_seed_all(0) or
                torch_accel._C._default_generator(9),
        }
        report(outcomes={name: [outcome(call), outcome(call)] for name, call in calls.items()},
               after=torch.ones(2, device="accel").add(1).cpu().tolist())
    """)
    assert all(pair == ["RuntimeError"] * 2 for pair in r["outcomes"].values()), r
    assert r["after"] == [2.0, 2.0], r


def test_operators_through_the_fallback_refuse_two_devices_too(torch_json):
    """Operators without a device kernel (cat across devices, index_select, gather,
    masked_fill, dist) refused nothing: on the host every tensor was a CPU tensor, so
    ``torch.cat([on_accel0, on_accel1])`` returned a tensor. They raise the native
    operators' error now, with torch.cuda's exceptions: CPU indices for advanced indexing,
    0-d CPU tensors as numbers."""
    r = torch_json("""
        a0, a1 = torch.ones(2, 3, device="accel:0"), torch.ones(2, 3, device="accel:1")
        i1 = torch.tensor([0, 1], device="accel:1")
        def refusal(fn):
            try:
                return ["ran", fn().cpu().tolist()]
            except Exception as exc:
                return [type(exc).__module__ + "." + type(exc).__name__, str(exc)]
        x = torch.zeros(3, 3, device="accel:0")
        x[torch.tensor([0, 2])] = torch.ones(3, device="accel:0")
        report(cat=refusal(lambda: torch.cat([a0, a1])), stack=refusal(lambda: torch.stack([a0, a1])),
               cat_cpu=refusal(lambda: torch.cat([a0, torch.ones(2, 3)])),
               index_select=refusal(lambda: a0.index_select(0, i1)),
               gather=refusal(lambda: a0.gather(0, i1[None].expand(2, 2))),
               masked_fill=refusal(lambda: a1.masked_fill(a0 > 0, 2.0)),
               dist=refusal(lambda: torch.dist(a1, torch.ones(2, 3))),
               index_put=refusal(lambda: x.index_put_((torch.tensor([1]),), a1[0])),
               cpu_indices=refusal(lambda: x[torch.tensor([2, 1])]),
               cpu_scalar=refusal(lambda: torch.atan2(a0[0], torch.tensor(1.0))),
               untouched=x.cpu().tolist())
    """)
    two = lambda first, second: ["builtins.RuntimeError", f"{TWO_DEVICES}, {first} and {second}!"]
    for op in ("cat", "stack"):
        assert r[op] == two("accel:0", "accel:1"), r
    assert r["cat_cpu"] == two("accel:0", "cpu"), r
    assert r["index_select"] == two("accel:0", "accel:1") and r["gather"] == two("accel:0", "accel:1"), r
    assert r["masked_fill"] == two("accel:1", "accel:0") and r["dist"] == two("accel:1", "cpu"), r
    assert r["index_put"] == two("accel:0", "accel:1"), r
    assert r["cpu_indices"] == ["ran", [[1.0] * 3, [0.0] * 3]], r
    assert r["cpu_scalar"] == ["ran", [0.7853981852531433] * 3], r
    assert r["untouched"] == [[1.0] * 3, [0.0] * 3, [1.0] * 3], r
