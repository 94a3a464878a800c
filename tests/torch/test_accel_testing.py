"""torch's device-type test framework on accel (OpenReg's test_testing and
test_device_type): ``instantiate_device_type_tests`` makes ``...ACCEL`` classes whose tests
get ``device="accel:0"``, the device decorators (``onlyPRIVATEUSE1``, ``onlyCUDA``,
``skipPRIVATEUSE1If``, ...) gate them as documented, and a backend that opts in with
``bypass_device_restrictions`` runs ``@onlyCUDA`` tests, so torch's own device-generic tests
can be pointed at accel."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(300)

#: device-generic test classes instantiated for the CPU and accel and run with unittest;
#: prints each test's outcome (ok, skip, fail) by its generated name
SUITE = """
import unittest
from torch.testing import make_tensor
from torch.testing._internal.common_device_type import (
    instantiate_device_type_tests, onlyCPU, onlyCUDA, onlyNativeDeviceTypes, onlyOn,
    onlyPRIVATEUSE1, skipPRIVATEUSE1If)
from torch.testing._internal.common_utils import TestCase

class TestTransfer(TestCase):
    def test_round_trip(self, device):
        x = torch.randn(3, 4)
        d = x.to(device)
        self.assertEqual(d.device.type, "accel")
        self.assertEqual(d.cpu(), x)
        self.assertEqual(d.to(device).data_ptr(), d.data_ptr())
        self.assertNotEqual(d.to(device, copy=True).data_ptr(), d.data_ptr())
        host = torch.empty(3, 4)
        host.copy_(d)
        self.assertEqual(host, x)

    def test_dtypes(self, device):
        y = torch.randn(3, 4, device=device, dtype=torch.float64)
        self.assertEqual((y * 2).dtype, torch.float64)
        self.assertEqual(y.to(torch.float32).device, torch.device(device))
        self.assertTrue(torch.all(~torch.zeros(3, device=device, dtype=torch.bool)))
        self.assertEqual(torch.randint(0, 9, (3,), device=device).dtype, torch.int64)

class TestGates(TestCase):
    @onlyCPU
    def test_cpu_only(self, device):
        self.assertEqual(device, "cpu")

    @onlyCUDA
    def test_cuda_only(self, device):
        self.fail("ran on " + device)

    @onlyPRIVATEUSE1
    def test_privateuse1_only(self, device):
        self.assertEqual(torch.device(device).type, torch._C._get_privateuse1_backend_name())

    @onlyNativeDeviceTypes
    def test_native(self, device):
        self.assertEqual(make_tensor((2, 2), device=device, dtype=torch.float32).device,
                         torch.device(device))

    @skipPRIVATEUSE1If(True, "skipped on the custom device")
    def test_skipped_on_privateuse1(self, device):
        self.assertEqual(device, "cpu")

class TestBypass(TestCase):
    ran = []

    def setUp(self):
        self.bypass_device_restrictions = True  # the backend opts in, as OpenReg's test
        super().setUp()

    @onlyCUDA
    def test_only_cuda(self, device):
        type(self).ran.append(device)

    @onlyOn(["cuda"])
    def test_only_on_cuda(self, device):
        type(self).ran.append(device)

instantiate_device_type_tests(TestTransfer, globals(), only_for="accel")
instantiate_device_type_tests(TestGates, globals(), only_for=("cpu", "accel"))
instantiate_device_type_tests(TestBypass, globals(), only_for="accel")

class Outcomes(unittest.TextTestResult):
    seen = {}
    def addSuccess(self, test):
        super().addSuccess(test); self.seen[test.id().split(".")[-1]] = "ok"
    def addSkip(self, test, reason):
        super().addSkip(test, reason); self.seen[test.id().split(".")[-1]] = "skip"
    def addFailure(self, test, err):
        super().addFailure(test, err); self.seen[test.id().split(".")[-1]] = "fail"
    def addError(self, test, err):
        super().addError(test, err); self.seen[test.id().split(".")[-1]] = "error"

generated = sorted(n for n in globals() if n.startswith("Test") and n.endswith(("ACCEL", "PRIVATEUSE1", "CPU")))
suite = unittest.TestSuite(unittest.defaultTestLoader.loadTestsFromTestCase(globals()[n]) for n in generated)
unittest.TextTestRunner(stream=io.StringIO(), resultclass=Outcomes).run(suite)
print(generated)
print(sorted(Outcomes.seen.items()))
print(TestBypassACCEL.ran)
"""


def test_device_type_tests_instantiate_and_gate_for_accel(torch_run):
    lines = torch_run(SUITE)
    # torch names the first class it makes for the custom device by the key
    # (PrivateUse1TestBase.device_type is "privateuse1" until a setUpClass has run, which
    # common_device_type's own comments describe), later ones by the backend's name
    assert lines[0] == str(["TestBypassACCEL", "TestGatesACCEL", "TestGatesCPU",
                            "TestTransferPRIVATEUSE1"])
    outcomes = dict(eval(lines[1]))  # noqa: S307 - our own subprocess's list
    assert outcomes == {
        "test_dtypes_accel": "ok", "test_round_trip_accel": "ok",
        "test_cpu_only_accel": "skip", "test_cpu_only_cpu": "ok",
        "test_cuda_only_accel": "skip", "test_cuda_only_cpu": "skip",
        "test_privateuse1_only_accel": "ok", "test_privateuse1_only_cpu": "skip",
        "test_native_accel": "ok", "test_native_cpu": "ok",
        "test_skipped_on_privateuse1_accel": "skip", "test_skipped_on_privateuse1_cpu": "ok",
        "test_only_cuda_accel": "ok", "test_only_on_cuda_accel": "ok",
    }, outcomes
    assert lines[2] == "['accel:0', 'accel:0']"
