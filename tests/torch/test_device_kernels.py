"""torch_accel.kernels against numpy, end to end on the session daemon.

Each test is one scenario in a fresh process (the runtime's state is per process: a fork
of the torch tests' zygote, ``torch_runner`` of tests/torch/conftest.py) that checks many
functions and prints ``name ok`` lines. A kernel's first launch with new
argument dtypes is a numba compile of seconds in the firmware, cached by the session
daemon, so the tests use few dtypes (float32 mostly, the same ones across tests).
"""

from __future__ import annotations

import textwrap

import pytest
from scenario import Runner

PRELUDE = """
import math, numpy as np, runtime
import torch_accel.kernels as K
rng = np.random.default_rng(0)
dev = runtime.to_device
def host(a):
    runtime.synchronize()
    return a.copy_to_host()
def check(name, got, want, **tol):
    got, want = np.asarray(got), np.asarray(want)
    ok = got.shape == want.shape and (np.allclose(got, want, equal_nan=True, **tol) if tol
                                      else np.array_equal(got, want, equal_nan=got.dtype.kind == "f"))
    assert ok, f"{name}: got {got!r}, want {want!r}"
    print(name, "ok")
"""


def run(runner: Runner, body: str, timeout: float) -> list[str]:
    out = runner.run_py(PRELUDE + textwrap.dedent(body), timeout=timeout)
    assert out.returncode == 0, out.stderr + out.stdout
    return out.stdout.split("\n")[:-1]


@pytest.mark.timeout(200)
def test_elementwise_float32(torch_runner):
    lines = run(torch_runner, """
        for n in (0, 1, 257, 1000):
            a = (rng.standard_normal(n) * 4).astype(np.float32)
            b = (rng.standard_normal(n) * 4).astype(np.float32)
            if n:
                a[0], b[-1] = np.nan, np.inf
            da, db, out = dev(a), dev(b), runtime.empty(n, np.float32)
            with np.errstate(all="ignore"):
                want = {"add": a + np.float32(2) * b, "sub": a - b, "mul": a * b, "div": a / b,
                        "floor_divide": np.floor_divide(a, b), "remainder": np.remainder(a, b),
                        "maximum": np.maximum(a, b), "minimum": np.minimum(a, b)}
            for op, w in want.items():
                K.binary(op, out, da, db, alpha=2 if op == "add" else 1)
                check(f"binary {op} {n}", host(out), w)
            K.binary("mul", out, da, 0.5)
            check(f"scalar mul {n}", host(out), a * np.float32(0.5))
            one = dev(np.array([3.0], np.float32))
            K.binary("sub", out, da, one, b_stride=0)
            check(f"broadcast sub {n}", host(out), a - np.float32(3))
            ob = runtime.empty(n, np.bool_)
            for op, f in (("lt", np.less), ("ge", np.greater_equal), ("ne", np.not_equal)):
                K.compare(op, ob, da, db)
                check(f"compare {op} {n}", host(ob), f(a, b))
            K.predicate("isnan", ob, da)
            check(f"isnan {n}", host(ob), np.isnan(a))
            K.where(out, ob, da, db)
            check(f"where {n}", host(out), np.where(np.isnan(a), a, b))
            K.arange(out, 1.5, 0.25)
            check(f"arange {n}", host(out), (1.5 + np.arange(n) * 0.25).astype(np.float32))
        x = np.array([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 0.49999997, -3.7, 3.7, 1e10, np.nan,
                      np.inf, -np.inf, -0.0], np.float32)
        dx, out = dev(x), runtime.empty(x.size, np.float32)
        with np.errstate(all="ignore"):
            want = {"round": np.round(x), "floor": np.floor(x), "ceil": np.ceil(x),
                    "trunc": np.trunc(x), "neg": -x, "abs": np.abs(x), "relu": np.maximum(x, 0),
                    "exp": np.exp(x), "tanh": np.tanh(x), "sigmoid": 1 / (1 + np.exp(-x))}
        for op, w in want.items():
            K.unary(op, out, dx)
            check(f"unary {op}", host(out), w, rtol=1e-6, atol=0) if op in ("exp", "tanh", "sigmoid") \\
                else check(f"unary {op}", host(out), w)
        K.unary("clamp", out, dx, -1.0, 2.0)
        check("clamp", host(out), np.clip(x, -1, 2))
        x = np.concatenate([np.linspace(-9, 9, 4001), rng.standard_normal(1000)]).astype(np.float32)
        dx, out = dev(x), runtime.empty(x.size, np.float32)
        xd = x.astype(np.float64)
        erf = np.vectorize(math.erf)
        with np.errstate(all="ignore"):
            want = {"gelu": 0.5 * xd * (1 + erf(xd / math.sqrt(2))),
                    "log1p": np.log1p(np.abs(xd)), "expm1": np.expm1(xd), "sqrt": np.sqrt(np.abs(xd)),
                    "silu": xd / (1 + np.exp(-xd)), "sin": np.sin(xd), "log2": np.log2(np.abs(xd))}
        for op, w in want.items():
            src = dev(np.abs(x)) if op in ("log1p", "sqrt", "log2") else dx
            K.unary(op, out, src)
            got = host(out).astype(np.float64)
            err = np.abs(got - w)
            ok = np.all((err <= 1e-6) | (err <= 1.3e-6 * np.abs(w)) | (np.isinf(w) & (got == w)))
            assert ok, (op, err.max())
            print("unary", op, "ok")
    """, timeout=190)
    assert "unary gelu ok" in lines and "binary remainder 1000 ok" in lines


@pytest.mark.timeout(200)
def test_elementwise_int_and_bool(torch_runner):
    lines = run(torch_runner, """
        a = np.array([7, -7, 7, -7, 0, 5, -1, 2**40], np.int64)
        b = np.array([2, 2, -2, -2, 3, -3, 3, 5], np.int64)
        da, db, out = dev(a), dev(b), runtime.empty(a.size, np.int64)
        for op, w in {"floor_divide": a // b, "remainder": a % b, "add": a + 3 * b,
                      "mul": a * b, "maximum": np.maximum(a, b), "bitwise_and": a & b,
                      "bitwise_xor": a ^ b, "lshift": a << np.abs(b), "pow": a ** np.abs(b)}.items():
            K.binary(op, out, da, dev(np.abs(b)) if op in ("lshift", "pow") else db,
                     alpha=3 if op == "add" else 1)
            check(f"int64 {op}", host(out), w)
        K.binary("floor_divide", out, da, -2)
        check("int64 scalar floor_divide", host(out), a // -2)
        for op, w in {"neg": -a, "abs": np.abs(a), "sign": np.sign(a), "square": a * a,
                      "bitwise_not": ~a}.items():
            K.unary(op, out, da)
            check(f"int64 unary {op}", host(out), w)
        K.unary("clamp", out, da, -3, 4)
        check("int64 clamp", host(out), np.clip(a, -3, 4))
        ob = runtime.empty(a.size, np.bool_)
        K.compare("le", ob, da, db)
        check("int64 le", host(ob), a <= b)
        K.fill(out, -5)
        check("int64 fill", host(out), np.full(a.size, -5))
        p = rng.random(300) < 0.5
        q = rng.random(300) < 0.5
        dp, dq, o = dev(p), dev(q), runtime.empty(300, np.bool_)
        for op, w in {"add": p | q, "mul": p & q, "logical_xor": p ^ q, "bitwise_or": p | q,
                      "maximum": p | q}.items():
            K.binary(op, o, dp, dq)
            check(f"bool {op}", host(o), w)
        K.unary("bitwise_not", o, dp)
        check("bool not", host(o), ~p)
        K.arange(out, -2, 3)
        check("int64 arange", host(out), -2 + 3 * np.arange(a.size))
    """, timeout=190)
    assert "int64 remainder ok" in lines and "bool not ok" in lines


@pytest.mark.timeout(150)
def test_strided_copy(torch_runner):
    lines = run(torch_runner, """
        x = (rng.standard_normal((3, 4, 5)) * 5).astype(np.float32)
        x[0, 0, 0] = np.nan
        dx, out = dev(x), runtime.empty(60, np.float32)
        K.strided_copy(out, dx, (5, 4, 3), (1, 5, 20), 0, (12, 3, 1), 0)
        check("permute", host(out).reshape(5, 4, 3), x.transpose(2, 1, 0))
        K.fill(out, 0.0)
        K.strided_copy(out, dx, (4, 5), (0, 1), 5, (5, 1), 10)  # a row broadcast at an offset
        want = np.zeros(60, np.float32)
        want[10:30] = np.broadcast_to(x.ravel()[5:10], (4, 5)).ravel()
        check("broadcast", host(out), want)
        K.strided_copy(out, dx, (3, 2), (20, 1), 2, (2, 1), 0)  # slice x[:, 0, 2:4]
        check("slice", host(out)[:6], x[:, 0, 2:4].ravel())
        K.strided_copy(out, dx, (0, 5), (0, 1), 0, (5, 1), 0)  # empty: a no-op
        y = x.copy()
        y[0, 0, 0] = -2.7
        dy = dev(y)
        i32 = runtime.empty(60, np.int32)
        K.strided_copy(i32, dy, (60,), (1,), 0, (1,), 0)
        check("float->int32 truncates", host(i32), y.ravel().astype(np.int32))
        ob = runtime.empty(60, np.bool_)
        K.strided_copy(ob, dx, (60,), (1,), 0, (1,), 0)
        check("float->bool", host(ob), x.ravel() != 0)
        K.strided_copy(out, ob, (60,), (1,), 0, (1,), 0)
        check("bool->float", host(out), (x.ravel() != 0).astype(np.float32))
        big = np.arange(2**53, 2**53 + 10, dtype=np.int64)
        d64 = runtime.empty(10, np.float64)
        K.strided_copy(d64, dev(big), (10,), (1,), 0, (1,), 0)
        check("int64->float64", host(d64), big.astype(np.float64))
        cat = runtime.empty((2, 9), np.float32)  # cat of [2,4] and [2,5] along dim 1
        a, b = x[0, :2, :4].copy(), x[1, :2, :].copy()
        K.strided_copy(cat, dev(a), (2, 4), (4, 1), 0, (9, 1), 0)
        K.strided_copy(cat, dev(b), (2, 5), (5, 1), 0, (9, 1), 4)
        check("cat", host(cat), np.concatenate([a, b], 1))
    """, timeout=140)
    assert "cat ok" in lines


@pytest.mark.timeout(300)
def test_reduce_rows(torch_runner):
    lines = run(torch_runner, """
        for rows, n in ((1, 1), (37, 300), (5, 1000)):  # short rows; a long one below
            x = rng.standard_normal((rows, n)).astype(np.float32)
            if n > 10:
                x[min(3, rows - 1), 5] = np.nan
                x[0, 7] = x[0, 9] = 50.0
            if rows > 4:
                x[4, :] = -np.inf
            dx = dev(x)
            of, oi, ob = (runtime.empty(rows, t) for t in (np.float32, np.int64, np.bool_))
            xd = x.astype(np.float64)
            for op, w in (("sum", xd.sum(1)), ("mean", xd.mean(1)), ("amax", x.max(1)),
                          ("min", x.min(1)), ("prod", np.prod(xd, 1))):
                K.reduce_rows(op, of, dx, rows, n)
                check(f"{op} {rows}x{n}", host(of), w.astype(np.float32), rtol=1e-5, atol=1e-6)
            for op, f in (("argmax", np.argmax), ("argmin", np.argmin)):
                K.reduce_rows(op, oi, dx, rows, n)
                check(f"{op} {rows}x{n}", host(oi), f(x, 1))
            for op, f in (("any", np.any), ("all", np.all)):
                K.reduce_rows(op, ob, dx, rows, n)
                check(f"{op} {rows}x{n}", host(ob), f(x != 0, 1))
        x = rng.standard_normal((37, 300)).astype(np.float32)
        dx, of = dev(x), runtime.empty(37, np.float32)
        K.var_rows(of, dx, 37, 300)
        check("var", host(of), x.astype(np.float64).var(1, ddof=1), rtol=1e-5)
        K.var_rows(of, dx, 37, 300, correction=0, std=True)
        check("std", host(of), x.astype(np.float64).std(1), rtol=1e-5)
        of = runtime.empty(3, np.float32)
        K.reduce_rows("sum", of, runtime.empty(0, np.float32), 3, 0)
        check("sum of empty rows", host(of), np.zeros(3, np.float32))
        n = 4_000_000
        x = rng.random(n, dtype=np.float32)
        x[3_999_000] = 2.0
        dx, of, oi = dev(x), runtime.empty(1, np.float32), runtime.empty(1, np.int64)
        K.reduce_rows("sum", of, dx, 1, n)
        check("sum 4M", host(of), [x.astype(np.float64).sum()], rtol=1e-6)
        K.reduce_rows("argmax", oi, dx, 1, n)
        check("argmax 4M", host(oi), [3_999_000])
        xi = rng.integers(-50, 50, (6, 333)).astype(np.int64)
        dxi, oi = dev(xi), runtime.empty(6, np.int64)
        for op, w in (("sum", xi.sum(1)), ("amax", xi.max(1)), ("argmin", xi.argmin(1))):
            K.reduce_rows(op, oi, dxi, 6, 333)
            check(f"int64 {op}", host(oi), w)
    """, timeout=290)
    assert "argmax 4M ok" in lines and "int64 argmin ok" in lines


@pytest.mark.timeout(300)
def test_nn_kernels(torch_runner):
    lines = run(torch_runner, """
        for rows, n in ((70, 10), (3, 64)):  # rows of a thread each (nn.SHORT_ROW), 3 blocks
            x = (rng.standard_normal((rows, n)) * 3).astype(np.float32)
            dx, y = dev(x), runtime.empty((rows, n), np.float32)
            e = np.exp(x - x.max(1, keepdims=True))
            sm = e / e.sum(1, keepdims=True)
            g = rng.standard_normal((rows, n)).astype(np.float32)
            gi = runtime.empty((rows, n), np.float32)
            K.softmax_rows(y, dx, rows, n)
            check(f"short softmax {n}", host(y), sm, rtol=1e-5, atol=1e-7)
            K.softmax_backward_rows(gi, dev(g), y, rows, n)
            check(f"short softmax backward {n}", host(gi), sm * (g - (g * sm).sum(1, keepdims=True)),
                  rtol=1e-4, atol=1e-6)
            K.softmax_rows(y, dx, rows, n, log=True)
            check(f"short log_softmax {n}", host(y), np.log(sm), rtol=1e-5, atol=1e-6)
            K.softmax_backward_rows(gi, dev(g), y, rows, n, log=True)
            check(f"short log_softmax backward {n}", host(gi), g - sm * g.sum(1, keepdims=True),
                  rtol=1e-4, atol=1e-6)
        rows, n = 7, 300
        x = (rng.standard_normal((rows, n)) * 3).astype(np.float32)
        dx, y = dev(x), runtime.empty((rows, n), np.float32)
        e = np.exp(x - x.max(1, keepdims=True))
        sm = e / e.sum(1, keepdims=True)
        K.softmax_rows(y, dx, rows, n)
        check("softmax", host(y), sm, rtol=1e-5, atol=1e-7)
        K.softmax_rows(y, dx, rows, n, log=True)
        check("log_softmax", host(y), np.log(sm), rtol=1e-5, atol=1e-6)
        g = rng.standard_normal((rows, n)).astype(np.float32)
        gi = runtime.empty((rows, n), np.float32)
        K.softmax_backward_rows(gi, dev(g), y, rows, n, log=True)
        check("log_softmax backward", host(gi), g - sm * g.sum(1, keepdims=True), rtol=1e-4, atol=1e-6)
        K.softmax_backward_rows(gi, dev(g), dev(sm), rows, n)
        check("softmax backward", host(gi), sm * (g - (g * sm).sum(1, keepdims=True)), rtol=1e-4, atol=1e-6)
        lp = np.log(sm)
        tgt = np.array([1, 5, -100, 299, 0, 7, 2])
        keep = tgt != -100
        dt, loss = dev(tgt), runtime.empty(rows, np.float32)
        picked = -lp[np.arange(rows)[keep], tgt[keep]]
        total = runtime.empty(1, np.float32)
        for red, w in (("mean", [picked.mean()]), ("sum", [picked.sum()])):
            K.nll_loss_rows(loss, y, dt, rows, n, red, total=total)
            check(f"nll {red}", host(loss)[:1], w, rtol=1e-5)
            check(f"nll {red} total weight", host(total), [keep.sum()])
        K.nll_loss_rows(loss, y, runtime.empty(0, np.int64), 0, n, "mean")
        check("nll mean of no rows", host(loss)[:1], [np.nan])
        K.nll_loss_rows(loss, y, dt, rows, n, "none", total=total)
        check("nll none total weight", host(total), [0])
        want = np.zeros(rows, np.float32)
        want[keep] = picked
        check("nll none", host(loss), want, rtol=1e-5)
        gl = runtime.empty((rows, n), np.float32)
        K.nll_loss_backward_rows(gl, dev(np.array([2.0], np.float32)), dt, rows, n, "mean")
        want = np.zeros((rows, n), np.float32)
        want[np.arange(rows)[keep], tgt[keep]] = -2.0 / keep.sum()
        check("nll backward", host(gl), want)
        w = rng.standard_normal((10, 6)).astype(np.float32)
        idx = np.array([3, 3, 9, 0, 1])
        dw, di, emb = dev(w), dev(idx), runtime.empty((5, 6), np.float32)
        K.index_rows(emb, dw, di, 5, 6)
        check("index_rows", host(emb), w[idx])
        acc = dev(np.zeros((10, 6), np.float32))
        K.index_add_rows(acc, di, emb, 5, 6)
        want = np.zeros((10, 6), np.float32)
        np.add.at(want, idx, w[idx])
        check("index_add_rows", host(acc), want, rtol=1e-6)
        v = np.linspace(-6, 6, 1201).astype(np.float32)
        gv = rng.standard_normal(1201).astype(np.float32)
        dv, dg, o = dev(v), dev(gv), runtime.empty(1201, np.float32)
        K.threshold_backward(o, dg, dv, 0.5)
        check("threshold_backward", host(o), np.where(v > 0.5, gv, 0))
        K.sigmoid_backward(o, dg, dv)
        check("sigmoid_backward", host(o), gv * v * (1 - v), rtol=1e-5, atol=1e-5)
        K.tanh_backward(o, dg, dv)
        check("tanh_backward", host(o), gv * (1 - v * v), rtol=1e-5, atol=1e-5)
        K.activation_backward("silu", o, dg, dv)
        sg = 1 / (1 + np.exp(-v.astype(np.float64)))
        check("silu_backward", host(o), gv * sg * (1 + v * (1 - sg)), rtol=1e-5, atol=1e-5)
        vd = v.astype(np.float64)
        erf = np.vectorize(math.erf)
        K.gelu_backward(o, dg, dv)
        d = 0.5 * (1 + erf(vd / math.sqrt(2))) + vd * np.exp(-vd * vd / 2) / math.sqrt(2 * math.pi)
        check("gelu_backward", host(o), gv * d, rtol=1e-5, atol=1e-6)
        t = np.tanh(math.sqrt(2 / math.pi) * (vd + 0.044715 * vd ** 3))
        d = 0.5 * (1 + t) + 0.5 * vd * (1 - t * t) * math.sqrt(2 / math.pi) * (1 + 3 * 0.044715 * vd * vd)
        K.gelu_backward(o, dg, dv, "tanh")
        check("gelu_backward tanh", host(o), gv * d, rtol=1e-5, atol=1e-6)
        # float64 gelu within 1e-7 of the exact value (math.erf)
        z = np.concatenate([np.linspace(-12, 12, 4801), rng.standard_normal(2000) * 2])
        dz, oz = dev(z), runtime.empty(z.size, np.float64)
        K.unary("gelu", oz, dz)
        err = np.abs(host(oz) - 0.5 * z * (1 + erf(z / math.sqrt(2))))
        assert err.max() <= 1e-7, err.max()
        print("gelu float64 ok", err.max())
        K.index_rows(emb, dw, dev(np.array([2, 10, 0, 0, 0])), 5, 6)  # row 10 of 10
        try:
            runtime.synchronize()
        except runtime.KernelFaultError as exc:
            print("bad index faults:", exc)
    """, timeout=290)
    assert "gelu float64 ok" in lines[-2], lines
    assert lines[-1].startswith("bad index faults:") and "index_rows" in lines[-1], lines


@pytest.mark.timeout(150)
def test_matmul_random_sleep(torch_runner):
    lines = run(torch_runner, """
        # then near-equal ragged tiles (matmul._config: an MLP's weight gradient in 400 and
        # 384 columns, 70 x 600 in 304 and 296) and a product cut in halves for two engines
        for m, k, n in ((1, 1, 1), (65, 130, 33), (129, 7, 257), (300, 40, 520), (4, 0, 3),
                        (256, 64, 784), (70, 300, 600), (256, 1030, 200)):
            a = rng.standard_normal((m, k)).astype(np.float32)
            b = rng.standard_normal((k, n)).astype(np.float32)
            c = rng.standard_normal((m, n)).astype(np.float32)
            dc = dev(c)
            K.mm(dc, dev(a), dev(b), beta=0.5, alpha=2.0)
            check(f"mm {m}x{k}x{n}", host(dc), 0.5 * c + 2 * (a @ b), rtol=1e-4, atol=1e-4)
            K.mm(dc, dev(a), dev(b))
            check(f"mm beta0 {m}x{k}x{n}", host(dc), a @ b, rtol=1e-4, atol=1e-4)
            for ta, tb in ((True, False), (False, True), (True, True)):  # stored transposed
                K.mm(dc, dev(np.ascontiguousarray(a.T) if ta else a),
                     dev(np.ascontiguousarray(b.T) if tb else b), ta=ta, tb=tb)
                check(f"mm {ta=} {tb=} {m}x{k}x{n}", host(dc), a @ b, rtol=1e-4, atol=1e-4)
        a = rng.standard_normal((3, 5, 6)).astype(np.float32)
        b = rng.standard_normal((3, 6, 4)).astype(np.float32)
        o = runtime.empty((3, 5, 4), np.float32)
        K.bmm(o, dev(a), dev(b))
        check("bmm", host(o), a @ b, rtol=1e-4, atol=1e-5)
        a = rng.standard_normal((65, 130)).astype(np.float32)  # rows of 130, a 100-deep product
        b = rng.standard_normal((33, 100)).astype(np.float32)  # b [n, k] transposed
        o = runtime.empty((65, 33), np.float32)
        K.mm(o, dev(a), dev(b), tb=True, k=100)
        check("mm of wide rows", host(o), a[:, :100] @ b.T, rtol=1e-4, atol=1e-4)
        bias = rng.standard_normal(33).astype(np.float32)
        K.mm(o, dev(a), dev(b), beta=0.5, alpha=2.0, tb=True, k=100, bias=dev(bias))
        check("mm with a bias row", host(o), 0.5 * bias + 2 * (a[:, :100] @ b.T), rtol=1e-4,
              atol=1e-4)
        try:
            K.mm(o, dev(a), dev(b), tb=True, k=100, bias=dev(bias[:5]))
        except ValueError as exc:
            print("short bias refused:", exc)
        a = rng.standard_normal((256, 1030)).astype(np.float32)  # cut in halves, b as [n, k]
        b = rng.standard_normal((200, 1030)).astype(np.float32)
        bias = rng.standard_normal(200).astype(np.float32)
        o = runtime.empty((256, 200), np.float32)
        K.mm(o, dev(a), dev(b), beta=0.5, alpha=2.0, tb=True, bias=dev(bias))
        check("mm of tiles for each engine with a bias row", host(o), 0.5 * bias + 2 * (a @ b.T),
              rtol=1e-4, atol=1e-3)
        try:  # a [5, 4] stored transposed is [4, 5]: no product into [5, 3]
            K.mm(runtime.empty((5, 3), np.float32), dev(np.ones((5, 4), np.float32)),
                 dev(np.ones((4, 3), np.float32)), ta=True)
        except ValueError as exc:
            print("transposed shapes refused:", exc)
        try:
            K.mm(runtime.empty((2, 2), np.int64), dev(np.ones((2, 2), np.int64)),
                 dev(np.ones((2, 2), np.int64)))
        except TypeError:
            print("int mm refused ok")

        M32 = np.uint64(0xFFFFFFFF)
        def philox(c, k0, k1):  # numpy Philox-4x32-10 on counters (c, 0) of 64 bits
            x0, x1 = c & M32, c >> np.uint64(32)
            x2 = x3 = np.zeros_like(x0)
            k0, k1 = np.uint64(k0), np.uint64(k1)
            for r in range(10):
                if r:
                    k0, k1 = (k0 + np.uint64(0x9E3779B9)) & M32, (k1 + np.uint64(0xBB67AE85)) & M32
                p0, p1 = np.uint64(0xD2511F53) * x0, np.uint64(0xCD9E8D57) * x2
                x0, x1, x2, x3 = (p1 >> np.uint64(32)) ^ x1 ^ k0, p1 & M32, (p0 >> np.uint64(32)) ^ x3 ^ k1, p0 & M32
            return np.stack([x0, x1, x2, x3], 1)
        kat = philox(np.zeros(1, np.uint64), 0, 0)[0]  # Random123's known answer
        assert [int(v) for v in kat] == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8], kat
        for seed, off, n in ((0, 0, 1), (0x123456789ABCDEF, 7, 1001), (2**64 - 1, 2**40, 6)):
            words = philox(np.arange(K.counters(n, np.float32), dtype=np.uint64) + np.uint64(off),
                           seed & 0xFFFFFFFF, seed >> 32).ravel()[:n]
            o32 = runtime.empty(n, np.float32)
            K.uniform(o32, seed, off, -1.0, 3.0)
            want = (-1.0 + 4.0 * (words & np.uint64(0xFFFFFF)).astype(np.float64) * 2.0**-24)
            check(f"uniform philox {seed:x}", host(o32), want.astype(np.float32))
            part = runtime.empty(n - 1, np.float32) if n > 1 else None
            if part is not None:  # the same numbers whatever the size of the launch
                K.uniform(part, seed, off, -1.0, 3.0)
                check(f"uniform prefix {seed:x}", host(part), host(o32)[:-1])
        o = runtime.empty(200_000, np.float32)
        K.normal(o, 42, 0, 1.0, 2.0)
        v = host(o)
        assert abs(v.mean() - 1.0) < 0.03 and abs(v.std() - 2.0) < 0.03, (v.mean(), v.std())
        print("normal ok")
        d = runtime.empty(100_001, np.float64)
        K.normal(d, 42, 0)
        v = host(d)
        assert abs(v.mean()) < 0.02 and abs(v.std() - 1.0) < 0.02 and K.counters(100_001, np.float64) == 50_001
        print("normal float64 ok")
        m = runtime.empty(100_000, np.bool_)
        K.bernoulli_mask(m, 3, 0, 0.3)
        assert abs(host(m).mean() - 0.3) < 0.01
        print("bernoulli ok")
        s = runtime.Stream()
        K.sleep(1000, stream=s)
        s.synchronize()
        import time
        t0 = time.perf_counter()
        K.sleep(20_000_000, stream=s)
        queued = time.perf_counter() - t0
        s.synchronize()
        print("sleep queued, ran", queued, time.perf_counter() - t0)
    """, timeout=140)
    assert "int mm refused ok" in lines and "bernoulli ok" in lines, lines
    assert "transposed shapes refused: mm shapes (5, 4).T @ (4, 3) -> (5, 3) (k 5)" in lines, lines
    assert ("short bias refused: mm bias float32(5,) for a float32 (65, 33) product: one "
            "element per column, its dtype") in lines, lines
    queued, ran = map(float, lines[-1].split()[-2:])
    assert lines[-1].startswith("sleep queued, ran") and queued < ran, lines  # asynchronous



@pytest.mark.timeout(200)
def test_unfold_fold_swap01(torch_runner):
    """im2col against loops over numpy, also grouped and transposed; col2im as its adjoint
    (``<unfold x, c> == <x, fold c>``), which is what the input gradient of a convolution
    needs; the leading-dimension transpose with and without a bias."""
    lines = run(torch_runner, """
        def unfold_ref(x, kernel, stride, padding, dilation):
            n, c, *sp = x.shape
            out_sp = [(s + 2 * p - d * (k - 1) - 1) // st + 1
                      for s, p, d, k, st in zip(sp, padding, dilation, kernel, stride)]
            xp = np.pad(x, [(0, 0), (0, 0)] + [(p, p) for p in padding])
            cols = np.zeros((c, *kernel, n, *out_sp), x.dtype)
            for ko in np.ndindex(*kernel):
                for o in np.ndindex(*out_sp):
                    at = tuple(oi * st + ki * d for oi, st, ki, d in zip(o, stride, ko, dilation))
                    cols[(slice(None), *ko, slice(None), *o)] = xp[(slice(None), slice(None), *at)].T
            return cols.reshape(c * int(np.prod(kernel)), -1), out_sp
        for shape, kernel, stride, padding, dilation in (
                ((2, 3, 7, 6), (3, 2), (2, 1), (1, 0), (1, 2)),
                ((1, 2, 9), (3,), (2,), (2,), (3,)),
                ((2, 2, 4, 3, 5), (2, 1, 3), (1, 2, 1), (1, 0, 1), (2, 1, 1))):
            x = rng.standard_normal(shape).astype(np.float32)
            want, out_sp = unfold_ref(x, kernel, stride, padding, dilation)
            cols = runtime.empty(want.shape, np.float32)
            geometry = (shape[0], shape[1], shape[2:], out_sp, kernel, stride, padding, dilation)
            K.unfold(cols, dev(x), *geometry)
            check(f"unfold {shape}", host(cols), want)
            c = rng.standard_normal(want.shape).astype(np.float32)
            back = dev(np.zeros(shape, np.float32))
            K.fold(back, dev(c), *geometry)
            check(f"fold {shape}", np.vdot(host(back).astype(np.float64), x),
                  np.vdot(c.astype(np.float64), want), rtol=1e-5)
            groups = shape[1] if shape[1] % 2 else 2
            per_group = want.reshape(groups, -1, want.shape[1])
            cols_t = runtime.empty((groups, want.shape[1], per_group.shape[1]), np.float32)
            K.unfold(cols_t, dev(x), *geometry, groups=groups, transposed=True)
            check(f"unfold transposed {shape}", host(cols_t), per_group.transpose(0, 2, 1))
        src = rng.standard_normal((3, 4, 5)).astype(np.float32)
        bias = rng.standard_normal(3).astype(np.float32)
        out = runtime.empty((4, 3, 5), np.float32)
        K.swap01(out, dev(src), 3, 4, 5, bias=dev(bias))
        check("swap01 bias", host(out), src.transpose(1, 0, 2) + bias[None, :, None])
        K.swap01(out, dev(src), 3, 4, 5)
        check("swap01", host(out), src.transpose(1, 0, 2))
    """, timeout=180)
    assert sum(line.endswith(" ok") for line in lines) == 11


@pytest.mark.timeout(200)
def test_max_pool_2x2_and_the_backward_that_writes_its_rows(torch_runner):
    """``max2x2`` (2x2 windows at stride 2, read straight) against numpy, ties to the
    first maximum and NaN winning, an odd input's last row and column in no window; and
    ``max_backward`` with ``rows`` writes the whole input gradient (over NaN garbage, no
    zeroing first) for windows that share no row, rows between windows and padding
    included, as the zeroed-and-atomic path does."""
    lines = run(torch_runner, """
        def max_ref(x, k, s, p):
            planes, h, w = x.shape
            oh, ow = (h + 2 * p[0] - k[0]) // s[0] + 1, (w + 2 * p[1] - k[1]) // s[1] + 1
            out, idx = np.empty((planes, oh, ow), x.dtype), np.empty((planes, oh, ow), np.int64)
            for pl, r, q in np.ndindex(planes, oh, ow):
                best, at = None, -1
                for a, b in np.ndindex(*k):
                    y, c = r * s[0] - p[0] + a, q * s[1] - p[1] + b
                    if 0 <= y < h and 0 <= c < w:
                        v = x[pl, y, c]
                        if at < 0 or v > best or v != v:
                            best, at = v, y * w + c
                out[pl, r, q], idx[pl, r, q] = best, at
            return out, idx
        x = rng.standard_normal((3, 7, 9)).astype(np.float32)
        x[0, :2, :2] = 1.0                 # a tie: the first wins
        x[1, 2, 2:4] = np.nan              # two NaNs in one window: the later wins
        want, want_idx = max_ref(x, (2, 2), (2, 2), (0, 0))
        out, idx = runtime.empty(want.shape, np.float32), runtime.empty(want.shape, np.int64)
        K.max_pool2d(out, idx, dev(x), 3, (7, 9), (3, 4), (2, 2), (2, 2), (0, 0), (1, 1))
        check("max2x2", host(out), want)
        check("max2x2 indices", host(idx), want_idx)
        for k, s, p in (((2, 2), (2, 2), (0, 0)), ((2, 3), (3, 2), (0, 1)),
                        ((3, 2), (3, 1), (1, 0))):
            assert K.disjoint_rows(k, s, (1, 1))
            want, want_idx = max_ref(x, k, s, p)
            g = rng.standard_normal(want.shape).astype(np.float32)
            zeroed = dev(np.zeros(x.shape, np.float32))
            K.max_pool2d_backward(zeroed, dev(g), dev(want_idx), 3, (7, 9), want.shape[1:])
            garbage = dev(np.full(x.shape, np.nan, np.float32))
            K.max_pool2d_backward(garbage, dev(g), dev(want_idx), 3, (7, 9), want.shape[1:],
                                  rows=(s[0], p[0]))
            ref = np.zeros((3, 63), np.float32)
            for pl in range(3):
                np.add.at(ref[pl], want_idx[pl].ravel(), g[pl].ravel())
            check(f"max backward {k} {s} {p} atomic", host(zeroed), ref.reshape(x.shape))
            check(f"max backward {k} {s} {p} rows", host(garbage), ref.reshape(x.shape))
        assert not K.disjoint_rows((3, 3), (2, 2), (1, 1))
        assert not K.disjoint_rows((2, 2), (2, 2), (2, 1))
    """, timeout=180)
    assert sum(line.endswith(" ok") for line in lines) == 8
