"""Launch plans (torch_accel/ops/_plans.py): an elementwise call's host work is done once per
key (operator, dtypes, shapes, strides, device, scalars, in place or not), and a later call
of that key launches the planned kernel on its own tensors. These check, from torch's side,
that a call is planned and reused only where that is right: every variation of the key is
another plan (or none, for what the full path must do) and every result equals the CPU's,
on the first call of a key and on the calls that reuse its plan, and a forked child never
reaches them. (A device reset drops them with the device's context: test_accel_reset.py.)"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(300)

#: ``check(name, got, want)`` compares with the CPU's result exactly; ``plans(d)`` is
#: device d's table
PLAN_HELPERS = """
from torch_accel.ops import _plans
def plans(d=0):
    return _plans.table(d)
bad = []
def check(name, got, want):
    # exactly (the arithmetic here is correctly rounded on both), NaN equal to NaN
    try:
        torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0, equal_nan=True)
    except AssertionError:
        bad.append(name)
"""

VARIATIONS = PLAN_HELPERS + """
torch.manual_seed(0)
a, b = torch.randn(64, 32), torch.randn(64, 32)
da, db = a.to("accel"), b.to("accel")
before = dict(plans())
for i in range(3):  # the first call makes each plan, the others reuse it
    check(f"add {i}", da + db, a + b)
made = {k: v for k, v in plans().items() if k not in before}
report(first=len(made), planned=[v is not None for v in made.values()])
same = next(iter(made.values()))
check("add again", da + db, a + b)
report(reused=next(iter({k: v for k, v in plans().items() if k not in before}.values())) is same)

cases = {
    # each is a new key: its own plan (or none), and the CPU's result
    "float64": (lambda: da.double() + db.double(), lambda: a.double() + b.double()),
    "int64": (lambda: da.long() * db.long(), lambda: a.long() * b.long()),
    "other shape": (lambda: da[:10] + db[:10], lambda: a[:10] + b[:10]),
    "offset": (lambda: da[5:] + db[5:], lambda: a[5:] + b[5:]),
    "transposed": (lambda: da.t() + db.t(), lambda: a.t() + b.t()),
    "mixed strides": (lambda: da + db.t().contiguous().t(), lambda: a + b),
    "broadcast": (lambda: da + db[0], lambda: a + b[0]),
    "promotion": (lambda: da + db.double(), lambda: a + b.double()),
    "number": (lambda: da * 2.5, lambda: a * 2.5),
    "other number": (lambda: da * -3.0, lambda: a * -3.0),
    "int number": (lambda: da * 2, lambda: a * 2),
    "alpha": (lambda: torch.add(da, db, alpha=0.5), lambda: torch.add(a, b, alpha=0.5)),
    "other op": (lambda: da - db, lambda: a - b),
    "div": (lambda: da / db, lambda: a / b),
    "int div": (lambda: da.long() / 3, lambda: a.long() / 3),
    "nan number": (lambda: da + float("nan"), lambda: a + float("nan")),
    "relu": (lambda: torch.relu(da), lambda: torch.relu(a)),
    "relu float64": (lambda: torch.relu(da.double()), lambda: torch.relu(a.double())),
    "neg transposed": (lambda: da.t().neg(), lambda: a.t().neg()),
    "leaky_relu": (lambda: torch.nn.functional.leaky_relu(da, 0.2),
                   lambda: torch.nn.functional.leaky_relu(a, 0.2)),
    "accel:1": (lambda: da.to("accel:1") + db.to("accel:1"), lambda: a + b),
    # a DLPack import's storage is a window of the producer's block, not a block of its own:
    # the plan's buffers come from the block holding it, at the window's offset
    "dlpack import": (lambda: torch.from_dlpack(da[8:]) * torch.from_dlpack(db[8:]),
                      lambda: a[8:] * b[8:]),
}
for name, (dev, cpu) in cases.items():
    for i in range(2):
        got = dev()
        check(f"{name} {i}", got, cpu())
report(keys=len(plans()), keys1=len(plans(1)))

# in place: the plan writes the tensor itself, which reuse must not mistake for a result
x, dx = a.clone(), da.clone()
for i in range(3):
    x.add_(b, alpha=-0.1)
    dx.add_(db, alpha=-0.1)
    check(f"add_ {i}", dx, x)
    x.relu_()
    dx.relu_()
    check(f"relu_ {i}", dx, x)
# an out= tensor takes the full path (its resize and cast rules)
out = torch.empty(3, device="accel")
check("out=", torch.add(da, db, out=out), a + b)

# a planned result is made like its first operand only when that has the standard
# contiguous strides: a contiguous (1, 64) whose size-1 dimension has stride 1 must not
# hand its strides on; results have the CPU's strides either way
col, col2 = torch.randn(64, 1), torch.randn(64, 1)
dcol, dcol2 = col.to("accel"), col2.to("accel")
strides = {}
for name, dev, cpu in (("standard", lambda: da * db, lambda: a * b),
                       ("size-1 stride", lambda: dcol.t() + dcol2.t(), lambda: col.t() + col2.t()),
                       ("unary size-1 stride", lambda: dcol.t().neg(), lambda: col.t().neg())):
    for i in range(2):
        got, want = dev(), cpu()
        check(f"{name} {i}", got, want)
        strides[f"{name} {i}"] = [got.stride(), want.stride()]
report(strides=strides, bad=bad)
"""


def test_a_plan_is_made_once_per_key_and_every_variation_matches_the_cpu(torch_json):
    r = torch_json(VARIATIONS)
    assert r["bad"] == [], r
    assert r["first"] == 1 and r["planned"] == [True], r
    assert r["reused"] is True, r
    # every variation above was a key of its own on device 0 (accel:1's on device 1)
    assert r["keys"] >= 20 and r["keys1"] == 1, r
    assert all(list(got) == list(want) for got, want in r["strides"].values()), r


PRODUCTS = PLAN_HELPERS + """
import torch.nn.functional as F
from torch_accel.ops import linalg
def close(name, got, want):
    # the unit and the CPU sum in other orders: close, not equal
    try:
        torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)
    except AssertionError:
        bad.append(name)
torch.manual_seed(0)
x, w, bias = torch.randn(64, 96), torch.randn(48, 96), torch.randn(48)
dx, dw, db = x.to("accel"), w.to("accel"), bias.to("accel")
def product_plans():
    return [v for k, v in plans().items() if k[0] is linalg._planned]
cases = {
    # linear's products: the weight read transposed in place, a row bias, none
    "addmm": (lambda: torch.addmm(db, dx, dw.t()), lambda: torch.addmm(bias, x, w.t())),
    "linear": (lambda: F.linear(dx, dw, db), lambda: F.linear(x, w, bias)),
    "mm, both transposed": (lambda: dw.t().t().mm(dx.t()), lambda: w.mm(x.t())),
    "mm, weight gradient": (lambda: dx.t().mm(dx), lambda: x.t().mm(x)),
    "beta, alpha, [1, n] bias": (
        lambda: torch.addmm(db[None], dx, dw.t(), beta=0.5, alpha=2.0),
        lambda: torch.addmm(bias[None], x, w.t(), beta=0.5, alpha=2.0)),
    "beta 0 ignores a NaN bias": (
        lambda: torch.addmm(torch.full_like(db, float("nan")), dx, dw.t(), beta=0),
        lambda: torch.addmm(torch.full_like(bias, float("nan")), x, w.t(), beta=0)),
    # not planned: the full path decides, with the same results
    "full bias": (lambda: torch.addmm(dx @ dw.t(), dx, dw.t()),
                  lambda: torch.addmm(x @ w.t(), x, w.t())),
    "column slice": (lambda: dx[:, :50].mm(dw[:, :50].t()), lambda: x[:, :50].mm(w[:, :50].t())),
    "float64": (lambda: dx.double().mm(dw.double().t()), lambda: x.double().mm(w.double().t())),
    "empty": (lambda: dx[:0].mm(dw.t()), lambda: x[:0].mm(w.t())),
}
made = {}
for name, (dev, cpu) in cases.items():
    before = len(product_plans())
    for i in range(3):  # the first call makes the plan, the others run it on new results
        close(f"{name} {i}", dev(), cpu())
    made[name] = [p is not None for p in product_plans()[before:]]
# out=, and the in-place form whose bias is its output (never planned: it reads what it
# writes)
o = torch.empty(64, 48, device="accel")
torch.addmm(db, dx, dw.t(), out=o)
close("out=", o, torch.addmm(bias, x, w.t()))
acc, cpu_acc = (x @ w.t()).to("accel"), x @ w.t()
for i in range(2):
    acc.addmm_(dx, dw.t())
    cpu_acc.addmm_(x, w.t())
close("addmm_", acc, cpu_acc)
report(made=made, bad=bad)
"""


def test_the_training_loops_products_are_planned_and_match_the_cpu(torch_json):
    """An eager product (``mm``, ``addmm``, ``linear``'s) of operands the unit reads as
    stored goes through a launch plan (~100 us of host time checked, ~40 us planned on a
    quiet machine); the rest takes the checked path; both match the CPU."""
    r = torch_json(PRODUCTS)
    assert r["bad"] == [], r
    made = r["made"]
    for name in ("addmm", "mm, both transposed", "mm, weight gradient",
                 "beta, alpha, [1, n] bias", "beta 0 ignores a NaN bias"):
        assert made[name] == [True], (name, r)
    assert made["linear"] in ([], [True]), r  # linear is addmm's key when it decomposes so
    for name in ("full bias", "column slice", "empty"):
        assert True not in made[name], (name, r)


FORK = PLAN_HELPERS + """
a, b = torch.randn(256), torch.randn(256)
da, db = a.to("accel"), b.to("accel")
check("parent", da + db, a + b)
read, write = os.pipe()
pid = os.fork()
if pid == 0:
    try:
        da + db
        msg = "ran"
    except RuntimeError as exc:
        msg = str(exc).split(".")[0]
    os.write(write, msg.encode())
    os._exit(0)
os.waitpid(pid, 0)
report(child=os.read(read, 1000).decode())
check("parent after", da + db, a + b)
report(bad=bad)
"""


def test_a_forked_child_never_launches_its_parents_plans(torch_json):
    r = torch_json(FORK)
    assert r["child"] == "Cannot re-initialize accel in forked subprocess", r
    assert r["bad"] == [], r


TRAINING_STEP_OPS = PLAN_HELPERS + """
import torch.nn.functional as F
A = torch.ops.aten
def close(name, got, want):
    # exp and log, and sums in another order: close to the CPU's, not equal
    try:
        if isinstance(want, (tuple, list)):
            for g, w in zip(got, want):
                torch.testing.assert_close(g.cpu(), w, equal_nan=True)
        else:
            torch.testing.assert_close(got.cpu(), want, equal_nan=True)
    except AssertionError:
        bad.append(name)
torch.manual_seed(0)
z, z64, wide = torch.randn(64, 10), torch.randn(33, 7).double(), torch.randn(5, 100)
z3, g3 = torch.randn(3, 7, 5), torch.randn(3, 7, 5)
g = torch.randn(64, 10)
y = torch.randint(0, 10, (64,))
y_ign = y.clone(); y_ign[::3] = -100
h, gh = torch.randn(64, 256), torch.randn(64, 256)
lp = torch.log_softmax(z, 1)
sm = torch.softmax(z, 1)
D = {name: t.to("accel") for name, t in dict(z=z, z64=z64, wide=wide, z3=z3, g3=g3, g=g, y=y,
                                               y_ign=y_ign, h=h, gh=gh, lp=lp, sm=sm).items()}
def both(f):
    # f(tensors) on accel and on the CPU
    return (lambda: f(D), lambda: f(dict(z=z, z64=z64, wide=wide, z3=z3, g3=g3, g=g, y=y,
                                        y_ign=y_ign, h=h, gh=gh, lp=lp, sm=sm)))
def loss_and_total(t, target, red, ignore=-100, dtype=None):
    logp = t["lp"] if dtype is None else t["lp"].to(dtype)
    return A.nll_loss_forward(logp, t[target], None, red, ignore)
def loss_grad(t, target, red):
    logp = t["lp"]
    loss, total = A.nll_loss_forward(logp, t[target], None, red, -100)
    return A.nll_loss_backward(torch.ones_like(loss) * 0.5, logp, t[target], None, red, -100,
                               total)
cases = {
    # planned: a training step's calls, and their shapes and dtypes
    "log_softmax": both(lambda t: A._log_softmax(t["z"], 1, False)),
    "softmax dim -1": both(lambda t: A._softmax(t["z"], -1, False)),
    "log_softmax float64": both(lambda t: A._log_softmax(t["z64"], 1, False)),
    "log_softmax 3-d": both(lambda t: A._log_softmax(t["z3"], 2, False)),
    "softmax wide rows": both(lambda t: A._softmax(t["wide"], 1, False)),
    "log_softmax backward": both(lambda t: A._log_softmax_backward_data(t["g"], t["lp"], 1,
                                                                        torch.float32)),
    "softmax backward": both(lambda t: A._softmax_backward_data(t["g"], t["sm"], 1,
                                                                torch.float32)),
    "log_softmax backward 3-d": both(lambda t: A._log_softmax_backward_data(
        t["g3"], torch.log_softmax(t["z3"], -1), -1, torch.float32)),
    "threshold_backward": both(lambda t: A.threshold_backward(t["gh"], t["h"], 0)),
    "threshold_backward 0.5": both(lambda t: A.threshold_backward(t["gh"], t["h"], 0.5)),
    "nll mean": both(lambda t: loss_and_total(t, "y", 1)),
    "nll sum": both(lambda t: loss_and_total(t, "y", 2)),
    "nll none": both(lambda t: loss_and_total(t, "y", 0)),
    "nll ignored": both(lambda t: loss_and_total(t, "y_ign", 1)),
    "nll float64": both(lambda t: loss_and_total(t, "y", 1, dtype=torch.float64)),
    "nll backward mean": both(lambda t: loss_grad(t, "y", 1)),
    "nll backward sum": both(lambda t: loss_grad(t, "y", 2)),
    "nll backward none": both(lambda t: loss_grad(t, "y", 0)),
    "nll backward ignored": both(lambda t: loss_grad(t, "y_ign", 1)),
    "bias gradient": both(lambda t: t["g"].sum(0, keepdim=True)),
    "bias gradient 256": both(lambda t: t["gh"].sum(0)),
    "mean of columns": both(lambda t: t["gh"].mean(0)),
    "sum of rows": both(lambda t: t["z64"].sum(1)),
    "sum of two leading dims": both(lambda t: t["z3"].sum((0, 1))),
    "ones_like": both(lambda t: torch.ones_like(t["g"])),
    "fill_ int": both(lambda t: t["y"].clone().fill_(3)),
    # not planned: the full path decides, with the same results
    "log_softmax dim 0": both(lambda t: A._log_softmax(t["z"], 0, False)),
    "log_softmax transposed": both(lambda t: A._log_softmax(t["z"].t(), 1, False)),
    "threshold_backward transposed": both(lambda t: A.threshold_backward(t["gh"].t(), t["h"].t(), 0)),
    "nll one sample": both(lambda t: A.nll_loss_forward(t["lp"][0], t["y"][0], None, 1, -100)),
    "sum of a middle dim": both(lambda t: t["z3"].sum(1)),
    "int sum": both(lambda t: t["y"].sum(0)),
}
# which calls ran a plan: every planned operator's host path is _plans.call, which answers
# None when the call has no plan
ran = []
planned_call = _plans.call
def counted(*args, **kwargs):
    result = planned_call(*args, **kwargs)
    ran.append(result is not None)
    return result
_plans.call = counted
made = {}
for name, (dev, cpu) in cases.items():
    for i in range(3):  # the first call makes the plan, the others reuse it
        ran.clear()
        close(f"{name} {i}", dev(), cpu())
    made[name] = ran[:]
# an SGD step's _foreach_add_: each pair in place, a pair the plans do not take included
ps = [torch.randn(256, 78), torch.randn(256), torch.randn(10, 256).t(), torch.randn(7).double()]
gs = [torch.randn(256, 78), torch.randn(256), torch.randn(256, 10), torch.randn(7).double()]
dps, dgs = [p.to("accel") for p in ps], [q.to("accel") for q in gs]
for i in range(3):
    torch._foreach_add_(ps, gs, alpha=-0.1)
    torch._foreach_add_(dps, dgs, alpha=-0.1)
    for j, (dp, p) in enumerate(zip(dps, ps)):
        close(f"foreach {i} {j}", dp, p)  # float64's a + alpha * b may be fused on the CPU
report(made=made, bad=bad, fallbacks=dict(torch_accel.fallback_counts))
"""


def test_a_training_steps_row_ops_are_planned_and_match_the_cpu(torch_json):
    """softmax, log_softmax and their backwards, relu's backward, nll_loss and its
    backward, a bias gradient's sum, the gradient's seed (``ones_like``) and SGD's
    ``_foreach_add_``, as a training step calls them: planned, one launch each, and equal to
    the CPU on the call that makes each plan and on those that reuse it; other layouts take
    the checked path, with the same results."""
    r = torch_json(TRAINING_STEP_OPS)
    assert r["bad"] == [], r
    assert r["fallbacks"] == {}, r
    made = r["made"]  # per case, whether each call of its third round ran a plan
    planned = [name for name, got in made.items() if True in got]
    assert planned == list(made)[:26], r


AXPY = PLAN_HELPERS + """
torch.manual_seed(0)
def kernels(fn):
    with runtime.profile() as p:
        got = fn()
        torch.accel.synchronize()
    return got, sorted({e.name for e in p.device_events if not e.name.startswith("compile ")})
cases = {}
# sizes on both sides of where the firmware stops running arith_f inline (~178 K
# elements) and where it stops running axpy_f inline (~860 K), odd so the last block is
# partial; float32 and float64; functional and in place; add and sub with an alpha
for n, dtype in ((1, torch.float32), (4097, torch.float64), (200_003, torch.float32),
                 (900_001, torch.float32)):
    a, b = torch.randn(n, dtype=dtype), torch.randn(n, dtype=dtype)
    da, db = a.to("accel"), b.to("accel")
    for i in range(2):  # the first call plans, the second reuses the plan
        got, names = kernels(lambda: torch.sub(da, db, alpha=0.25))
        check(f"sub {n} {dtype} {i}", got, torch.sub(a, b, alpha=0.25))
        cases[f"sub {n} {dtype}"] = names
        x, dx = a.clone(), da.clone()
        got, names = kernels(lambda: dx.add_(db, alpha=-0.01))
        x.add_(b, alpha=-0.01)
        try:  # torch's CPU rounds alpha * b to float32 first; the kernel rounds once
            torch.testing.assert_close(dx.cpu(), x)
        except AssertionError:
            bad.append(f"add_ {n} {dtype} {i}")
        cases[f"add_ {n} {dtype}"] = names
# what keeps arith_f: a device 0-d operand (read at stride 0), a number, an integer
# dtype, mul
m, z = torch.randn(300, 200), torch.tensor(2.5)
dm, dz = m.to("accel"), z.to("accel")
for name, dev, cpu in (("0-d", lambda: dm - dz, lambda: m - z),
                       ("number", lambda: dm - 1.5, lambda: m - 1.5),
                       ("int64", lambda: dm.long() + dm.long(), lambda: m.long() + m.long()),
                       ("mul", lambda: dm * dm, lambda: m * m)):
    got, names = kernels(dev)
    check(name, got, cpu())
    cases[name] = names
report(cases=cases, bad=bad)
"""


def test_contiguous_add_and_sub_take_the_lean_kernel_and_match_the_cpu(torch_json):
    """Contiguous float ``add``/``sub`` (an optimiser's update) run ``axpy_f``, whose few
    nodes keep a large launch inline (torch_accel/kernels/elementwise.py), with the CPU's
    results on both sides of the firmware's inline limits; other shapes of call keep
    ``arith_f``."""
    r = torch_json(AXPY)
    assert r["bad"] == [], r
    for name, kernels in r["cases"].items():
        if name.startswith(("sub", "add_")):
            assert kernels == ["axpy_f"], (name, r)
    assert r["cases"]["0-d"] == ["arith_f"], r
    assert r["cases"]["number"] == ["arith_f"], r
    assert r["cases"]["int64"] == ["arith_i", "strided_copy"], r
    assert r["cases"]["mul"] == ["arith_f"], r
