"""The shim's C++ kernels of add, sub, mul and div (csrc/shim.cpp, "hot arithmetic"): a
call whose kind has a launch plan launches it from C++, every other call goes to the
Python kernel behind it. These check, from torch's side, that the C++ path is the one a
planned call takes (no Python kernel runs), and that every case it must hand on -- type
promotion, broadcasting, numbers (a Scalar overload's, a wrapped number's, a 0-d tensor's),
alpha, in place on views, out=, mixed devices, autograd, the profiler -- gives the CPU's
result or torch's error, on the first call of its kind and on the calls after."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(300)

HELPERS = """
bad = []
def check(name, got, want):
    # exactly (this arithmetic is correctly rounded on both), NaN equal to NaN
    try:
        assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape)
        torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0, equal_nan=True)
        if want.is_floating_point():  # zeros by their signs too
            assert torch.equal(torch.signbit(got.cpu()), torch.signbit(want))
    except AssertionError:
        bad.append(name)
def error_of(f):
    try:
        f()
    except Exception as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0]}"
    return None
torch.manual_seed(0)
a, b = torch.randn(16, 8), torch.randn(16, 8)
da, db = a.to("accel"), b.to("accel")
"""

PYTHON_FREE = HELPERS + """
import sys
from torch_accel.ops import elementwise
called = []
def profile(frame, event, arg):
    if event == "call":
        called.append(frame.f_code.co_name)
calls = {
    "add": lambda: da + db, "sub": lambda: da - db, "mul": lambda: da * db,
    "div": lambda: da / db, "alpha": lambda: torch.add(da, db, alpha=0.5),
    "number": lambda: da * 2.5, "add_": lambda: da.clone().add_(db, alpha=-0.1),
    "Scalar overload": lambda: torch.ops.aten.add.Scalar(da, 3, 2),
}
seen = {}
for name, f in calls.items():
    f(); f()  # the first call makes the plan (Python), the second copies it to the shim
    called.clear()
    sys.setprofile(profile)
    f()
    sys.setprofile(None)
    seen[name] = sorted(set(called))
torch.accel.synchronize()
report(seen=seen)
"""


def test_a_planned_call_runs_no_python_kernel(torch_json):
    r = torch_json(PYTHON_FREE)
    for name, called in r["seen"].items():
        # the launch and the allocation are Python (the runtime's); the kernel, its key
        # and the plan lookup are not
        assert "__call__" in called, (name, called)
        for kernel_frame in ("functional", "in_place", "_binary_planned", "_binary_key",
                             "hot_plan", "lookup", "call", "kernel"):
            assert kernel_frame not in called, (name, called)


CASES = HELPERS + """
A = torch.ops.aten
i, di = torch.randint(-5, 5, (16, 8)), None
di = i.to("accel")
i32, di32 = i.int(), i.int().to("accel")
flag, dflag = a > 0, (a > 0).to("accel")
cases = {
    # planned here
    "add": (lambda: da + db, lambda: a + b),
    "sub alpha": (lambda: torch.sub(da, db, alpha=3), lambda: torch.sub(a, b, alpha=3)),
    "mul": (lambda: da * db, lambda: a * b),
    "div": (lambda: da / db, lambda: a / b),
    "float64": (lambda: da.double() - db.double(), lambda: a.double() - b.double()),
    "int64": (lambda: di * di, lambda: i * i),
    "python float": (lambda: da * 0.25, lambda: a * 0.25),
    "python int": (lambda: da + 7, lambda: a + 7),
    "python bool": (lambda: da * True, lambda: a * True),
    "zero": (lambda: da * 0.0, lambda: a * 0.0),
    "negative zero": (lambda: da * -0.0, lambda: a * -0.0),
    "plus zero": (lambda: (da * 0.0) + 0.0, lambda: (a * 0.0) + 0.0),
    "plus negative zero": (lambda: (da * -0.0) + -0.0, lambda: (a * -0.0) + -0.0),
    "reversed number": (lambda: 3.0 - da, lambda: 3.0 - a),
    "Scalar overload": (lambda: A.add.Scalar(da, 2.0, 0.5), lambda: A.add.Scalar(a, 2.0, 0.5)),
    "mul.Scalar": (lambda: A.mul.Scalar(da, 3), lambda: A.mul.Scalar(a, 3)),
    "div.Scalar": (lambda: A.div.Scalar(da, 4.0), lambda: A.div.Scalar(a, 4.0)),
    "sub.Scalar alpha": (lambda: A.sub.Scalar(da, 1, 2), lambda: A.sub.Scalar(a, 1, 2)),
    "contiguous slice": (lambda: da[4:] + db[4:], lambda: a[4:] + b[4:]),
    "one element": (lambda: da[0, :1] * db[0, :1], lambda: a[0, :1] * b[0, :1]),
    # handed to the Python kernel
    "promotion": (lambda: da + db.double(), lambda: a + b.double()),
    "int and float": (lambda: di * da, lambda: i * a),
    "int32 and int64": (lambda: di32 + di, lambda: i32 + i),
    "int by float number": (lambda: di * 0.5, lambda: i * 0.5),
    "int div": (lambda: di / di.clamp(min=1), lambda: i / i.clamp(min=1)),
    "int div number": (lambda: di32 / 2, lambda: i32 / 2),
    "bool and number": (lambda: dflag + 1, lambda: flag + 1),
    "broadcast row": (lambda: da + db[0], lambda: a + b[0]),
    "broadcast column": (lambda: da * db[:, :1], lambda: a * b[:, :1]),
    "0-d accel": (lambda: da * db[0, 0], lambda: a * b[0, 0]),
    "0-d CPU tensor": (lambda: da * torch.tensor(2.0), lambda: a * torch.tensor(2.0)),
    "0-d CPU float64": (lambda: da + torch.tensor(0.1, dtype=torch.float64),
                        lambda: a + torch.tensor(0.1, dtype=torch.float64)),
    "transposed": (lambda: da.t() - db.t(), lambda: a.t() - b.t()),
    "strided": (lambda: da[:, ::2] / db[:, ::2], lambda: a[:, ::2] / b[:, ::2]),
    "empty": (lambda: da[:0] + db[:0], lambda: a[:0] + b[:0]),
    "nan number": (lambda: da * float("nan"), lambda: a * float("nan")),
    "nan alpha": (lambda: torch.add(da, db, alpha=float("nan")),
                  lambda: torch.add(a, b, alpha=float("nan"))),
    "float alpha": (lambda: torch.add(da, db, alpha=0.5), lambda: torch.add(a, b, alpha=0.5)),
}
for name, (dev, cpu) in cases.items():
    for k in range(3):  # the first call of a kind, the one that copies its plan, a copy's
        check(f"{name} {k}", dev(), cpu())

# in place: contiguous views, a non-contiguous view, a number, alpha
x, dx = a.clone(), da.clone()
for k in range(3):
    x[2:5].add_(b[2:5], alpha=-0.5); dx[2:5].add_(db[2:5], alpha=-0.5)
    x[:, 1].mul_(b[:, 1]); dx[:, 1].mul_(db[:, 1])
    x.div_(3.0); dx.div_(3.0)
    x.sub_(1, alpha=2); dx.sub_(1, alpha=2)
    x.t().add_(b.t()); dx.t().add_(db.t())
    check(f"in place {k}", dx, x)
# in place promotes b to self's dtype when it can, and refuses what it cannot
y, dy = a.double(), da.double()
for k in range(2):
    y.add_(b); dy.add_(db)
    check(f"in place float64 += float32 {k}", dy, y)
cast_error = error_of(lambda: di.add_(da))
# out=: the Python kernel's, with its resize
o = torch.empty(0, device="accel")
check("out=", torch.add(da, db, alpha=2, out=o), torch.add(a, b, alpha=2))
check("out= kept", o, torch.add(a, b, alpha=2))
# errors: torch's own
mixed = error_of(lambda: da + b)
mixed_devices = error_of(lambda: da + db.to("accel:1"))
shapes = error_of(lambda: da + db[:3])
report(bad=bad, cast_error=cast_error, mixed=mixed, mixed_devices=mixed_devices,
       shapes=shapes)
"""


def test_every_case_matches_the_cpu_or_raises_torchs_error(torch_json):
    r = torch_json(CASES)
    assert r["bad"] == [], r
    assert r["cast_error"].startswith("RuntimeError: result type Float can't be cast to "
                                      "the desired output type Long"), r
    assert "Expected all tensors to be on the same device" in r["mixed"], r
    assert "Expected all tensors to be on the same device" in r["mixed_devices"], r
    # (the Python kernel's broadcast: torch.broadcast_shapes' words, not the CPU's)
    assert r["shapes"].startswith("RuntimeError: Attempting to broadcast a dimension"), r


AUTOGRAD = HELPERS + """
def step(x, w, c):
    y = (x * w + c) / 2.0 - x
    return (y * y).sum()
grads = []
for dev in ("cpu", "accel"):
    x = a.to(dev).detach().requires_grad_()
    w = b.to(dev).detach().requires_grad_()
    c = torch.full((16, 8), 0.5, device=dev, requires_grad=True)
    for k in range(3):
        for t in (x, w, c):
            t.grad = None
        step(x, w, c).backward()
    grads.append([t.grad.cpu() for t in (x, w, c)])
for name, got, want in zip("xwc", grads[1], grads[0]):
    try:
        torch.testing.assert_close(got, want)
    except AssertionError:
        bad.append(name)
# a leaf that requires grad refuses an in-place op, as on the CPU
leaf = error_of(lambda: torch.ones(3, device="accel", requires_grad=True).add_(1))
report(bad=bad, leaf=leaf)
"""


def test_autograd_runs_above_the_cpp_kernels(torch_json):
    r = torch_json(AUTOGRAD)
    assert r["bad"] == [], r
    assert "a leaf Variable that requires grad is being used in an in-place operation" \
        in r["leaf"], r


PROFILED = HELPERS + """
for k in range(2):
    da + db; da * 2.0  # planned before the profiler starts
with torch.profiler.profile() as prof:
    for k in range(3):
        da + db
        da * 2.0
        da.sub_(db)
    torch.accel.synchronize()
names = [e.name for e in prof.events()]
report(adds=names.count("aten::add"), muls=names.count("aten::mul"),
       subs=names.count("aten::sub_"))
"""


def test_the_profiler_records_each_call(torch_json):
    r = torch_json(PROFILED)
    assert r == {"adds": 3, "muls": 3, "subs": 3}, r


FORK = HELPERS + """
for k in range(2):
    check(f"before {k}", da + db, a + b)
read, write = os.pipe()
pid = os.fork()
if pid == 0:
    try:
        da + db
        msg = "no error"
    except Exception as e:
        msg = str(e).splitlines()[0]
    os.write(write, msg.encode())
    os._exit(0)
os.waitpid(pid, 0)
check("parent after", da + db, a + b)
report(bad=bad, child=os.read(read, 1000).decode())
"""


def test_a_forked_child_gets_the_fork_error_not_a_copied_plan(torch_json):
    # (a reset: test_accel_reset.py, whose ``da + db`` takes these kernels)
    r = torch_json(FORK)
    assert r["child"].startswith("Cannot re-initialize accel in forked subprocess"), r
    assert r["bad"] == [], r
