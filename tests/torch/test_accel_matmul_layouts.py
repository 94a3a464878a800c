"""Matrix products read their operands in place: ``mm``, ``addmm``, ``matmul``, ``bmm``
and ``linear`` (forward and backward) with operands stored transposed (``x.t()``,
``w.t()``), or otherwise strided, match the CPU's and launch no strided copy for a
transposed operand (the matrix unit's ``ta``/``tb``, docs/kernels.md); a bias row is
filled by the product's own kernel, and its gradient (a sum over leading dimensions)
reads the columns in place."""

from __future__ import annotations

import textwrap

import pytest

pytestmark = pytest.mark.timeout(300)

#: counts the device kernels ``fn`` launches, by name (runtime.profile); indented as the
#: snippets it precedes
LAUNCHES = textwrap.indent("""
def launches(fn):
    with runtime.profile() as p:
        fn()
        torch.accel.synchronize()
    names = {}
    for e in p.device_events:
        names[e.name] = names.get(e.name, 0) + 1
    return names
""", " " * 8)


def test_products_of_transposed_and_strided_operands_match_cpu(torch_json):
    r = torch_json(LAUNCHES + """
        torch.manual_seed(0)
        results = {}
        for dtype in (torch.float32, torch.float64):
            A, B = torch.randn(70, 45, dtype=dtype), torch.randn(45, 300, dtype=dtype)
            bias = torch.randn(300, dtype=dtype)
            def strided(x):  # every other column of a wider matrix, on the device
                s = torch.zeros(x.shape[0], 2 * x.shape[1], dtype=x.dtype, device="accel")
                return s[:, ::2].copy_(x)
            def sliced(x, first):  # columns first.. of a matrix 7 wider
                s = torch.zeros(x.shape[0], x.shape[1] + 7, dtype=x.dtype, device="accel")
                return s[:, first:first + x.shape[1]].copy_(x)
            layouts = {"plain": lambda x: x.to("accel"),
                       "transposed": lambda x: x.t().contiguous().t().to("accel"),
                       "strided": strided,
                       # the storage holds the whole [rows, ld] window: read in place
                       "sliced": lambda x: sliced(x, 0),
                       "sliced transposed": lambda x: sliced(x.t(), 0).t(),
                       # the window from column 3 runs past the storage: copied
                       "sliced at 3": lambda x: sliced(x, 3)}
            pairs = [(la, lb) for la in layouts for lb in layouts
                     if lb == "plain" or not la.startswith(("strided", "sliced at"))
                     and not lb.startswith(("strided", "sliced at"))]
            for la, lb in pairs:
                fa, fb = layouts[la], layouts[lb]
                a, b = fa(A), fb(B)
                for t, lay in ((a, la), (b, lb)):
                    assert (t.is_contiguous(), t.t().is_contiguous()) == (
                        lay == "plain", lay == "transposed"), (lay, t.stride())
                got = {}
                n = launches(lambda: got.update(
                    mm=torch.mm(a, b), addmm=torch.addmm(bias.to("accel"), a, b, beta=0.5,
                                                         alpha=2.0),
                    matmul=a @ b, bmm=torch.bmm(a.unsqueeze(0).expand(2, -1, -1),
                                                b.unsqueeze(0).expand(2, -1, -1))))
                want = dict(mm=A @ B, addmm=torch.addmm(bias, A, B, beta=0.5, alpha=2.0),
                            matmul=A @ B, bmm=torch.stack([A @ B] * 2))
                gap = max((got[k].cpu() - want[k]).abs().max().item() for k in want)
                results[f"{dtype} {la} {lb}"] = {
                    "gap": gap, "copies": n.get("strided_copy", 0)}
        report(results=results, fallbacks=sum(torch_accel.fallback_counts.values()))
    """)
    assert r["fallbacks"] == 0
    for case, v in r["results"].items():
        assert v["gap"] < (1e-3 if "float32" in case else 1e-10), (case, v)
    # mm, addmm and matmul copy nothing for a transposed or column-sliced operand (bmm's
    # expanded batch is copied whatever the layout: its batch stride is 0); every other
    # column, or a slice whose rows' window runs past its storage, is copied
    in_place = ("plain", "transposed", "sliced", "sliced transposed")
    for dtype in ("torch.float32", "torch.float64"):
        plain = r["results"][f"{dtype} plain plain"]["copies"]
        for la in in_place:
            for lb in in_place:
                assert r["results"][f"{dtype} {la} {lb}"]["copies"] == plain, (la, lb, r)
        for copied in ("strided", "sliced at 3"):
            assert r["results"][f"{dtype} {copied} plain"]["copies"] > plain, (copied, r)


def test_linear_forward_and_backward_read_the_weight_in_place(torch_json):
    """A linear layer's products (forward x @ w.t() + bias, backward grad @ w and
    grad.t() @ x) and its bias gradient (grad.sum(0)) launch no copy, and match the CPU's
    values and gradients, also for an input that is itself a transposed view."""
    r = torch_json(LAUNCHES + """
        torch.manual_seed(1)
        cpu = torch.nn.Linear(96, 40)
        acc = torch.nn.Linear(96, 40).to("accel")
        acc.load_state_dict(cpu.state_dict())
        out = {}
        for name, x in (("plain", torch.randn(33, 96)), ("transposed", torch.randn(96, 33).t())):
            xc = x.clone().requires_grad_()
            xa = x.to("accel").requires_grad_()
            assert xa.stride() == x.stride()
            cpu.zero_grad(); acc.zero_grad()
            g = torch.randn(33, 40)  # dense (a sum's expanded ones would be copied)
            cpu(xc).backward(g)
            ga = g.to("accel")
            def step():
                acc(xa).backward(ga)
            n = launches(step)
            out[name] = {
                "x_grad": (xa.grad.cpu() - xc.grad).abs().max().item(),
                "w_grad": (acc.weight.grad.cpu() - cpu.weight.grad).abs().max().item(),
                "b_grad": (acc.bias.grad.cpu() - cpu.bias.grad).abs().max().item(),
                "mm": n.get("mm", 0), "copies": n.get("strided_copy", 0)}
        report(out=out, fallbacks=sum(torch_accel.fallback_counts.values()))
    """)
    assert r["fallbacks"] == 0
    for name, v in r["out"].items():
        assert v["x_grad"] < 1e-3 and v["w_grad"] < 1e-3 and v["b_grad"] < 1e-3, (name, v)
        assert v["mm"] == 3 and v["copies"] == 0, (name, v)


def test_addmm_bias_forms_and_sums_over_leading_dimensions_match_cpu(torch_json):
    """Every form of addmm's bias (a row, filled by the product's kernel; a [1, n] row;
    a column, a scalar and a full matrix, broadcast first; beta 0 ignoring NaN) and
    reductions over leading dimensions (columns read in place, or copied when too long)
    match the CPU's."""
    r = torch_json(LAUNCHES + """
        torch.manual_seed(2)
        A, B = torch.randn(37, 20, dtype=torch.float64), torch.randn(20, 300, dtype=torch.float64)
        a, b = A.to("accel"), B.to("accel")
        b_t = b.t().contiguous().t()
        biases = {"row": torch.randn(300), "row2d": torch.randn(1, 300),
                  "column": torch.randn(37, 1), "scalar": torch.tensor(1.5),
                  "full": torch.randn(37, 300)}
        gaps, copies = {}, {}
        for name, bias in biases.items():
            got, bias = {}, bias.double()
            bd = bias.to("accel")
            n = launches(lambda: got.update(v=torch.addmm(bd, a, b_t, beta=0.5, alpha=-2.0)))
            want = torch.addmm(bias, A, B, beta=0.5, alpha=-2.0)
            gaps[name] = (got["v"].cpu() - want).abs().max().item()
            copies[name] = n.get("strided_copy", 0)
        nan = torch.full((300,), float("nan")).to("accel")
        gaps["beta0 nan"] = (torch.addmm(nan, a, b, beta=0).cpu() - A @ B).abs().max().item()
        x, long = torch.randn(6, 5, 70), torch.randn(1100, 30)
        sums = {}
        for name, t, fn in (("sum0", x, lambda t: t.sum(0)), ("sum01", x, lambda t: t.sum((0, 1))),
                            ("mean0", x, lambda t: t.mean(0)), ("amax0", x, lambda t: t.amax(0)),
                            ("argmin0", x, lambda t: t.argmin(0)),
                            ("sum0 long", long, lambda t: t.sum(0))):
            td, got = t.to("accel"), {}
            n = launches(lambda: got.update(v=fn(td)))
            sums[name] = {"gap": (got["v"].cpu().double() - fn(t).double()).abs().max().item(),
                          "copies": n.get("strided_copy", 0)}
        report(gaps=gaps, copies=copies, sums=sums,
               fallbacks=sum(torch_accel.fallback_counts.values()))
    """)
    assert r["fallbacks"] == 0
    assert all(g < 1e-10 for g in r["gaps"].values()), r["gaps"]
    assert r["copies"] == {"row": 0, "row2d": 0, "column": 1, "scalar": 1, "full": 1}, r
    for name, v in r["sums"].items():
        assert v["gap"] < 1e-4, (name, v)
        # a short leading reduction reads in place; 1100 elements per column are copied
        assert v["copies"] == (1 if name == "sum0 long" else 0), (name, v)
