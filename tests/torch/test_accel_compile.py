"""torch.compile with its default backend (Inductor) on accel (torch_accel/inductor/): the
graph's pointwise and reduction work becomes kernels of the device's language, fused,
compiled by the firmware and launched on the current accel stream; what Inductor does not
lower runs as the eager accel operators. Every case compares with the same function run
eagerly on accel in the same process; the cases share a few processes to keep the file's
time down, each a fork of an interpreter that has imported Inductor as well as torch
(``compile_json``): Inductor's import is seconds of CPU every process would pay again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from conftest import SNIPPET_TIMEOUT, TORCH_PRELUDE
from scenario import run_json
from zygote import PRELOAD, Zygote


@pytest.fixture(scope="module")
def compile_json(daemon) -> Iterator[Callable[..., dict[str, Any]]]:
    """``torch_json`` in forks of a zygote that has also imported Inductor's entry point
    (which registers accel's code generator, torch_accel/_dynamo_hook.py): imports only, so
    each fork still makes its first compile, its first kernel and its first launch."""
    zygote = Zygote(daemon, PRELOAD + "; import torch._inductor.compile_fx")

    def run(body: str, timeout: float = SNIPPET_TIMEOUT, **kw) -> dict[str, Any]:
        return run_json(zygote, TORCH_PRELUDE, body, timeout=timeout, **kw)
    try:
        yield run
    finally:
        zygote.close()

#: the cases of the main matrix: name -> (function, input shapes, input dtype); the
#: inputs are ``randn`` in float32, then cast
MATRIX = """
import torch.nn.functional as F
from torch_accel.inductor import launcher
CASES = {
    "chain8": (lambda a: ((((a * 1.5 + 0.25).relu() - 0.5).exp() * 0.75).sqrt() + a).tanh(),
               [(4096,)], None),
    "broadcast": (lambda a, b, c: (a + b) * c.sigmoid() - b, [(64, 32), (32,), (64, 1)], None),
    "transposed_input": (lambda a: a.t() * 2 + 1, [(16, 24)], None),
    "sum_dim": (lambda a: a.sum(1), [(48, 33)], None),
    "sum_dim0_keepdim": (lambda a: a.sum(0, keepdim=True), [(48, 33)], None),
    "sum_all": (lambda a: a.sum(), [(3000,)], None),
    "mean_keepdim": (lambda a: a.mean(-1, keepdim=True), [(8, 5, 7)], None),
    "amax_amin": (lambda a: a.amax(1) - a.amin(1), [(16, 40)], None),
    "var": (lambda a: a.var(1), [(16, 40)], None),
    "argmax": (lambda a: a.argmax(1), [(16, 40)], None),
    "prod": (lambda a: (a * 0.1 + 1).prod(1), [(16, 10)], None),
    "fused_pointwise_reduction": (lambda a, b: ((a - b) ** 2).sum(1) + 1, [(32, 64), (32, 64)],
                                  None),
    "softmax": (lambda a: torch.softmax(a, -1), [(16, 40)], None),
    "layer_norm": (lambda a: F.layer_norm(a, (40,)), [(16, 40)], None),
    "cat": (lambda a, b: torch.cat([a, b]) * 2, [(4, 3), (5, 3)], None),
    "float64": (lambda a: (a.exp() + 1).log() * a, [(100,)], torch.float64),
    "int64": (lambda a: (a * 3 // 2 + a % 5 - 7).abs(), [(100,)], torch.int64),
    "bool": (lambda a: (a > 0) & ~(a > 1) | (a < -2), [(100,)], None),
    "int64_sum": (lambda a: a.sum(0), [(10, 7)], torch.int64),
    "bool_any": (lambda a: (a > 1.5).any(1), [(10, 40)], None),
    "sign_floor_trunc": (lambda a: (a * 3).sign() + (a * 3).floor() - (a * 3).trunc()
                         + (a * 3).ceil() + (a * 2.5).round(), [(100,)], None),
    "where_clamp": (lambda a: torch.where(a > 0, a, a * 0.1).clamp(-0.1, 0.5), [(100,)], None),
    "fallback_cumsum": (lambda a: a.cumsum(0) * 2, [(100,)], None),
    "extern_mm": (lambda a, b: (a @ b).relu() + 1, [(16, 8), (8, 4)], None),
}

def inputs(shapes, dtype):
    out = []
    for s in shapes:
        t = torch.randn(*s) * (10 if dtype == torch.int64 else 1)
        out.append(t.to(dtype or torch.float32).to("accel"))
    return out

results = {}
torch.manual_seed(0)
for name, (fn, shapes, dtype) in CASES.items():
    args = inputs(shapes, dtype)
    before = dict(launcher.launches)
    got = torch.compile(fn)(*args)
    want = fn(*args)
    torch.accel.synchronize()
    ran = sorted(k for k, v in launcher.launches.items() if v > before.get(k, 0))
    results[name] = dict(
        same=bool(torch.allclose(got.cpu().double(), want.cpu().double(), rtol=1e-5,
                                 atol=1e-6, equal_nan=True)),
        meta=[str(got.dtype), list(got.shape), str(got.device)] == [str(want.dtype),
              list(want.shape), str(want.device)],
        kernels=ran)
"""


@pytest.mark.timeout(600)
def test_default_backend_matches_eager_with_generated_kernels(torch_json, compile_json):
    """Pointwise chains, broadcasting, strided inputs, reductions over a dim, kept dims
    and everything, fused pointwise+reduction, softmax and layer norm (several reduction
    loops in one kernel), masked loads (cat), float32/float64/int64/bool: each equals eager
    on accel, and each ran at least one generated kernel (an ``accel_...`` launch), fused
    (the 8-op chain is one kernel). ``cumsum`` has no lowering and ``mm`` is an extern
    kernel: both run as the eager accel operators, around generated kernels. Import torch
    loads no Inductor."""
    imported = torch_json("import sys\nreport(inductor='torch._inductor' in sys.modules)")
    assert imported == {"inductor": False}
    r = compile_json(MATRIX + """
report(results=results, fallback=dict(torch_accel.fallback_counts))
""", timeout=580)
    results = r["results"]
    bad = {k: v for k, v in results.items() if not (v["same"] and v["meta"] and v["kernels"])}
    assert not bad, bad
    assert len(results["chain8"]["kernels"]) == 1, results["chain8"]
    assert len(results["fused_pointwise_reduction"]["kernels"]) == 1, results
    assert all(k.startswith("accel_") for v in results.values() for k in v["kernels"])
    # the op Inductor does not lower ran as aten (twice: compiled and eager)
    assert r["fallback"].get("aten::cumsum.out", 0) >= 2, r["fallback"]


@pytest.mark.timeout(400)
def test_generated_kernels_are_device_launches_on_the_current_stream(compile_json):
    """A generated kernel is a launch like any other: the profiler shows it by name on the
    device (category ``kernel``), it runs on the stream current when the compiled function
    runs (a side stream's work is not done until that stream is synchronized), on the
    device of its inputs (accel:1), and with ``dynamic=True`` one kernel serves two
    sizes. Generated again with Inductor's caches off, the code is the same text (the
    device's JIT cache keys on it). A Python number made a graph input is a scalar
    parameter."""
    r = compile_json("""
        from torch_accel.inductor import launcher
        fn = torch.compile(lambda x: (x * 2 + 1).exp())
        x = torch.randn(1000, device="accel")
        fn(x)
        with torch.profiler.profile() as prof:
            fn(x)
            torch.accel.synchronize()
        names = sorted({e["name"] for e in prof.accel_events if e["cat"] == "kernel"})
        side = torch.accel.Stream()
        side.wait_stream(torch.accel.current_stream())
        with torch.accel.stream(side):
            y = fn(x)
        side.synchronize()
        x1 = torch.randn(300, device="accel:1")
        y1 = fn(x1)
        dyn = torch.compile(lambda x: (x + 1) * x.sum(), dynamic=True)
        sizes = [bool(torch.allclose(dyn(v).cpu(), ((v + 1) * v.sum()).cpu(), rtol=1e-5))
                 for v in (torch.randn(40, device="accel"), torch.randn(77, device="accel"))]
        # dynamic=True makes a Python number a graph input (a 0-d CPU tensor): a scalar
        # parameter of the kernel
        scaled = torch.compile(lambda x, v: torch.addcdiv(x, x, x * x + 2, value=v),
                               dynamic=True)
        sizes += [bool(torch.allclose(scaled(x1, v).cpu(),
                                      torch.addcdiv(x1, x1, x1 * x1 + 2, value=v).cpu()))
                  for v in (0.5, 0.25)]
        import re
        from torch._inductor import config as inductor_config
        from torch._inductor.utils import run_and_get_code
        codes = []
        for _ in range(2):  # Inductor's caches off: the code generated again, the same
            torch._dynamo.reset()
            with inductor_config.patch(fx_graph_cache=False):
                _, code = run_and_get_code(torch.compile(lambda x: (x * 3).sum(0) + 1), x1)
            codes.append(re.findall(r"Generated\\(.*?\\)$", code[0], re.S | re.M))
        report(deterministic=codes[0] == codes[1] != [], code=codes[0],
               names=names, side=bool(torch.allclose(y.cpu(), (x * 2 + 1).exp().cpu())),
               dev1=[str(y1.device), bool(torch.allclose(y1.cpu(), (x1 * 2 + 1).exp().cpu()))],
               sizes=sizes, launches=launcher.launches)
    """, timeout=380)
    assert any(n.startswith("accel_fused_add_exp_mul") for n in r["names"]), r
    assert r["side"] and r["dev1"] == ["accel:1", True] and r["sizes"] == [True] * 4, r
    assert r["deterministic"] and "def accel_fused_" in r["code"][0], r["code"]


@pytest.mark.timeout(400)
def test_16_bit_floats_round_and_compute_as_torchs_casts(compile_json):
    """float16 and bfloat16 have no buffers in the kernel language: generated kernels take
    them as their bits (torch_accel/inductor/halfbits.py). A compiled cast from float32
    gives torch's CPU cast bit for bit (ties to even, subnormals, overflow to inf, NaN,
    signed zero), a compiled cast back is exact, and arithmetic with a reduction agrees
    with eager within one unit of the last place (it rounds once, eager per op)."""
    r = compile_json("""
        torch.manual_seed(0)
        special = torch.tensor([0.0, -0.0, 1.0, -1.0, 65504.0, 65519.0, 65520.0, 1e6, -1e6,
                                6.1e-5, 5.96e-8, 2.9e-8, 3.0e-8, 1e-10, float("inf"),
                                float("-inf"), float("nan"), 1 / 3, 2049.0, 2051.0, 1e38,
                                3.4e38, 1e-40])
        x = torch.cat([special, torch.randn(4000) * 100, torch.randn(4000) * 1e-5])
        out = {}
        for dt in (torch.float16, torch.bfloat16):
            got = torch.compile(lambda a: a.to(dt))(x.to("accel")).cpu()
            want = x.to(dt)
            bits = (got.view(torch.int16) == want.view(torch.int16)) | (got.isnan() & want.isnan())
            back = torch.compile(lambda a: a.float())(want.to("accel")).cpu()
            w = torch.randn(10, 10).to(dt).to("accel")
            f = lambda a: (a * 2 + 1).sum(0)
            g, e = torch.compile(f)(w).cpu(), f(w).cpu()
            ulp = (e.float().abs() * 2.0 ** -(10 if dt == torch.float16 else 7)).clamp(min=1e-3)
            out[str(dt)] = [bool(bits.all()), bool(torch.equal(back, want.float()) or
                            torch.allclose(back, want.float(), equal_nan=True)),
                            str(g.dtype), bool(((g.float() - e.float()).abs() <= ulp).all())]
        report(**out)
    """, timeout=380)
    assert r == {"torch.float16": [True, True, "torch.float16", True],
                 "torch.bfloat16": [True, True, "torch.bfloat16", True]}, r


@pytest.mark.timeout(400)
def test_short_sums_are_one_block_per_row(compile_json):
    """A sum over a static range of at most 256 elements (an MLP's bias gradient: a sum
    over the batch) is one block per output row, one thread per element adding into
    block-shared memory (codegen.py, ``should_use_persistent_reduction``): no loop, so the
    firmware runs it inline. Over either dimension, a mean with work after it, int64, fed
    by fused pointwise work, over ``cat``'s masked loads: each equals eager. A longer sum
    and a max keep the loop."""
    r = compile_json("""
        from torch._inductor.utils import run_and_get_code
        torch.manual_seed(0)
        a, g = torch.randn(64, 256, device="accel"), torch.randn(64, 256, device="accel")
        cases = {
            "sum0": (lambda a: a.sum(0), (a,)),
            "mean1_plus": (lambda a: a.mean(1) + 1, (a,)),
            "int64": (lambda a: (a * 10).long().sum(1), (a,)),
            "relu_grad_sum": (lambda r, g: torch.where(r <= 0, 0.0, g).sum(0), (a, g)),
            "cat_sum": (lambda a, b: torch.cat([a, b], 1).sum(1), (a[:, :100], g[:, :50])),
            "long_sum": (lambda a: a.sum(1), (torch.randn(8, 1000, device="accel"),)),
            "amax": (lambda a: a.amax(0), (a,)),
        }
        out = {}
        for name, (fn, args) in cases.items():
            got, code = run_and_get_code(torch.compile(fn), *args)
            want = fn(*args)
            kernels = code[0].split("def call(")[0]
            out[name] = [bool(torch.allclose(got.cpu().double(), want.cpu().double(),
                                             rtol=1e-5, atol=1e-4)),
                         "block=" in kernels, "for r0_index" in kernels]
        report(out=out)
    """, timeout=380)
    want = {name: [True, True, False]
            for name in ("sum0", "mean1_plus", "int64", "relu_grad_sum", "cat_sum")}
    want |= {"long_sum": [True, False, True], "amax": [True, False, True]}
    assert r["out"] == want, r["out"]


@pytest.mark.timeout(500)
def test_matrix_products_lower_without_layout_copies(compile_json):
    """Products hand the eager operators their operands in the layouts the matrix unit reads
    in place (torch_accel/inductor/matmul.py), so the device runs no ``strided_copy``:
    transposed graph inputs, a slice at an offset and a transposed value the graph computes
    launch no copy at all; an expanded operand, strided columns and a column slice get one
    generated (loop-free) copy kernel. Products are ``launcher.product`` calls (the
    unit's kernel through a launch plan), never ``extern_kernels.mm``/``addmm``; with a
    row bias (a linear layer) or ``beta=0`` over a NaN bias (ignored, as torch does) the
    kernel takes the bias; a 2-D bias is a generated epilogue. Each case equals eager;
    float64 too."""
    r = compile_json("""
        import runtime
        import torch.nn.functional as F
        from torch._inductor.utils import run_and_get_code
        torch.manual_seed(0)
        dev = lambda *s, dt=torch.float32: torch.randn(*s, dtype=dt).to("accel")
        x, w, b, m, v = dev(8, 96), dev(32, 96), dev(32), dev(8, 32), dev(48, 32)
        nan = torch.full((32,), float("nan"), device="accel")
        cases = {
            "linear_relu": (lambda x, w, b: F.linear(x, w, b).relu(), (x, w, b)),
            "addmm_scaled": (lambda m, x, w: torch.addmm(m, x, w.t(), beta=0.5, alpha=2.0),
                             (m, x, w)),
            "addmm_beta0_nan": (lambda n, x, w: torch.addmm(n, x, w.t(), beta=0), (nan, x, w)),
            "mm_transposed": (lambda a, b: a.t() @ b.t(), (dev(12, 8), dev(20, 12))),
            "bmm_transposed": (lambda a, b: torch.bmm(a.transpose(1, 2), b),
                               (dev(3, 6, 5), dev(3, 6, 4))),
            "linear_float64": (lambda x, w, b: F.linear(x, w, b).relu(),
                               (dev(8, 96, dt=torch.float64), dev(32, 96, dt=torch.float64),
                                dev(32, dt=torch.float64))),
            "offset_rows": (lambda x, w: x[2:] @ w.t(), (x, w)),
            "computed_transposed": (lambda a, b: (a * 2).t() @ b, (dev(16, 8), dev(16, 4))),
            "expanded": (lambda v, w: v.expand(8, 96) @ w.t(), (dev(1, 96), w)),
            "strided_columns": (lambda x, v: x[:, ::2] @ v, (x, v)),
            "column_slice": (lambda x, v: x[:, :48] @ v, (x, v)),
            "strided_input": (lambda a, v: a @ v, (x[:, 1::2], v)),
            "offset_input": (lambda a, w: a @ w.t(), (x[3:], w)),
        }
        out = {}
        for name, (fn, args) in cases.items():
            compiled = torch.compile(fn)
            got, code = run_and_get_code(compiled, *args)
            call = code[0].split("def call(")[1]
            with runtime.profile() as p:
                compiled(*args)
                torch.accel.synchronize()
            kernels = [e.name for e in p.device_events if e.cat == "kernel"]
            out[name] = dict(same=bool(torch.allclose(got.cpu(), fn(*args).cpu(), rtol=1e-5,
                                                      atol=1e-5)),
                             bias_in_product=any("accel_product(" in ln and "beta=" in ln
                                                 for ln in call.splitlines()),
                             eager_call="extern_kernels.mm(" in call
                             or "extern_kernels.addmm(" in call,
                             strided_copy=kernels.count("strided_copy"),
                             generated=sum(k.startswith("accel_fused") for k in kernels))
        report(out=out)
    """, timeout=480)
    # (the bias filled by the product's kernel, generated kernels launched) per case
    want = {"linear_relu": (True, 1), "addmm_scaled": (False, 1),
            "addmm_beta0_nan": (True, 0),
            "mm_transposed": (False, 0), "bmm_transposed": (False, 0),
            "linear_float64": (True, 1), "offset_rows": (False, 0),
            "computed_transposed": (False, 1), "expanded": (False, 1),
            "strided_columns": (False, 1), "column_slice": (False, 1),
            "strided_input": (False, 1), "offset_input": (False, 0)}
    got = {k: v for k, v in r["out"].items()
           if v != {"same": True, "bias_in_product": want[k][0], "eager_call": False,
                    "strided_copy": 0, "generated": want[k][1]}}
    assert not got, got


#: the eager issue's MLP (784-256-10) on accel, ``make()`` seeded, and a batch ``x``, ``y``
#: (indented as the snippets it begins, which run dedented)
MLP = """
        from torch import nn
        def make():
            torch.manual_seed(0)
            return nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 10)).to("accel")
        x = torch.randn(64, 784, device="accel")
        y = torch.randint(0, 10, (64,), device="accel")
"""


@pytest.mark.timeout(500)
def test_mlp_training_compiled_matches_eager(compile_json):
    """The MLP of the eager issue (784-256-10, cross entropy, SGD): three steps of a
    compiled model (AOTAutograd: a compiled forward and a compiled backward) give eager's
    losses and weights, and a step with ``loss.backward()`` inside the compiled function
    (a graph break; the eager backward runs our operators, which Dynamo must not trace)
    gives eager's gradients."""
    r = compile_json(MLP + """
        from torch_accel.inductor import launcher
        losses = {}
        models = {}
        for mode in ("eager", "compiled"):
            m = make()
            run = torch.compile(m) if mode == "compiled" else m
            opt = torch.optim.SGD(m.parameters(), lr=0.1)
            losses[mode] = []
            for _ in range(3):
                opt.zero_grad()
                loss = nn.functional.cross_entropy(run(x), y)
                loss.backward()
                opt.step()
                losses[mode].append(loss.item())
            models[mode] = m
        diff = max((a - b).abs().max().item() for a, b in
                   zip(models["eager"].parameters(), models["compiled"].parameters()))
        def step(m, x, y):
            loss = nn.functional.cross_entropy(m(x), y)
            loss.backward()
            return loss
        m1, m2 = make(), make()
        torch.compile(step)(m1, x, y)
        step(m2, x, y)
        grad = max((a.grad - b.grad).abs().max().item() for a, b in
                   zip(m1.parameters(), m2.parameters()))
        report(losses=losses, diff=diff, grad=grad,
               backward_kernels=sorted(k for k in launcher.launches if "backward" in k))
    """, timeout=480)
    for a, b in zip(r["losses"]["eager"], r["losses"]["compiled"]):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), r["losses"]
    assert r["diff"] <= 1e-5 and r["grad"] <= 1e-6, r
    assert r["backward_kernels"], r


@pytest.mark.timeout(500)
def test_mlp_whole_training_step_compiled_matches_eager(compile_json):
    """The bench's step compiled whole, as a training loop compiles it (``zero_grad``,
    forward, cross entropy, ``backward()``, ``opt.step()`` in one compiled function):
    three steps give eager's losses and weights, and a step launches fewer kernels than
    eager's 18 (the loss and its backward fused into the graphs, SGD's update of the four
    parameters one foreach: two horizontal kernels)."""
    r = compile_json(MLP + """
        out = {}
        for mode in ("eager", "compiled"):
            m = make()
            opt = torch.optim.SGD(m.parameters(), lr=0.1)
            def step():
                opt.zero_grad()
                loss = nn.functional.cross_entropy(m(x), y)
                loss.backward()
                opt.step()
                return loss
            run = torch.compile(step) if mode == "compiled" else step
            losses = [run().item() for _ in range(3)]
            with runtime.profile() as p:
                run()
                torch.accel.synchronize()
            kernels = [e.name for e in p.device_events if e.cat == "kernel"]
            out[mode] = dict(losses=losses, params=[t.detach().cpu() for t in m.parameters()],
                             launches=len(kernels),
                             foreach=sum("foreach" in k for k in kernels))
        diff = max((a - b).abs().max().item() for a, b in
                   zip(out["eager"]["params"], out["compiled"]["params"]))
        report(diff=diff, **{mode: {k: v for k, v in o.items() if k != "params"}
                             for mode, o in out.items()})
    """, timeout=480)
    for a, b in zip(r["eager"]["losses"], r["compiled"]["losses"]):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), r
    assert r["diff"] <= 1e-5, r
    assert r["eager"]["launches"] == 18 and r["compiled"]["launches"] == 15, r
    assert r["compiled"]["foreach"] == 2, r


@pytest.mark.timeout(400)
def test_foreach_is_horizontal_kernels_within_the_inline_bound(compile_json):
    """A foreach over static sizes (an optimizer's update) is written as horizontal
    kernels (codegen.py ``codegen_combo_kernel``): thread ``i`` updates element ``i`` of
    the concatenated ranges. As many subkernels share one kernel as the firmware still
    runs inline (its bound counts every branch's syntax nodes for every thread, at most
    256 of them): three small tensors are one launch, eight are fewer launches than
    tensors, and so is a large tensor with small ones, each within the bound. Each equals
    eager, float64 and int64 too; under dynamic shapes each tensor is a kernel of its own;
    the bound mirrors the firmware's."""
    r = compile_json("""
        import re
        from firmware import kernel_check, launches as fw_launches
        from torch_accel.inductor import codegen
        from torch._inductor.utils import run_and_get_code
        torch.manual_seed(0)
        def update(ps, gs):
            torch._foreach_add_(ps, gs, alpha=-3)
            return ps
        cases = {
            "three": ([(7,), (3, 5), (300,)], torch.float32, False),
            "eight": ([(7,), (3, 5), (300,), (2, 2, 2), (1,), (4,), (5,), (6,)], torch.float32,
                      False),
            "mlp": ([(256, 784), (256,), (10, 256), (10,)], torch.float32, False),
            "float64": ([(5,), (6, 7)], torch.float64, False),
            "int64": ([(5,), (6, 7)], torch.int64, False),
            "dynamic": ([(5,), (6, 7), (9,)], torch.float32, True),
        }
        quote = "'" * 3
        out = {}
        for name, (shapes, dt, dynamic) in cases.items():
            ps = [(torch.randn(*s) * 10).to(dt).to("accel") for s in shapes]
            gs = [(torch.randn(*s) * 10).to(dt).to("accel") for s in shapes]
            want = [p.cpu() - 3 * g.cpu() for p, g in zip(ps, gs)]
            compiled = torch.compile(update, dynamic=dynamic)
            _, code = run_and_get_code(compiled, [p.clone() for p in ps], gs)
            mine = [p.clone() for p in ps]
            with runtime.profile() as prof:
                compiled(mine, gs)
                torch.accel.synchronize()
            kernels = [e.name for e in prof.device_events if e.cat == "kernel"]
            inline = []
            for kname, body in re.findall(rf"(\\w+) = Generated\\('\\w+', {quote}(.*?){quote}",
                                          code[0], re.S):
                for numel in re.findall(rf"\\b{kname}\\(.*, (\\d+)\\)", code[0]):
                    inline.append(codegen._runs_inline(body, int(numel)))
            out[name] = dict(same=all(torch.allclose(m.cpu().double(), w.double(), rtol=1e-6,
                                                     atol=1e-5) for m, w in zip(mine, want)),
                             launches=len(kernels), inline=inline)
        report(out=out, bounds=[codegen.INLINE_NODES == kernel_check.INLINE_MAX_NODES,
                                codegen.INLINE_WORK == fw_launches.INLINE_WORK,
                                codegen.INLINE_THREADS == fw_launches.INLINE_THREADS])
    """, timeout=380)
    assert r["bounds"] == [True, True, True], r
    out = r["out"]
    assert all(o["same"] for o in out.values()), out
    assert all(out[k]["inline"] and all(out[k]["inline"])
               for k in ("three", "eight", "mlp", "float64", "int64")), out
    assert [out[k]["launches"] for k in ("three", "float64", "int64", "dynamic")] \
        == [1, 1, 1, 3], out
    assert 1 < out["eight"]["launches"] < 8 and 1 < out["mlp"]["launches"] < 4, out


@pytest.mark.timeout(500)
def test_cnn_training_compiled_matches_eager_and_cpu(compile_json):
    """The CNN of the eager issue (LeNet size: conv, batch norm, ReLU, max pooling, twice,
    then a linear layer; 1x28x28 inputs, batch 8), compiled and trained three SGD steps
    (AOTAutograd: a compiled forward and a compiled backward, the optimizer eager), ends
    with the weights, batch norm running statistics and eval output of the same model
    trained eagerly on accel and on the CPU. The convolutions are extern kernels (the eager
    accel operators); batch norm, ReLU and pooling, forward and backward, are generated
    kernels, and nothing is left to the CPU."""
    r = compile_json("""
        import copy
        from torch import nn
        from torch_accel.inductor import launcher
        torch.manual_seed(0)
        ref = nn.Sequential(nn.Conv2d(1, 6, 5), nn.BatchNorm2d(6), nn.ReLU(), nn.MaxPool2d(2),
                            nn.Conv2d(6, 16, 5), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
                            nn.Flatten(), nn.Linear(16 * 4 * 4, 10))
        x, y = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))
        xe = torch.randn(4, 1, 28, 28)
        models, losses, evals, backward_launches = {}, {}, {}, []
        for mode in ("cpu", "eager", "compiled"):
            dev = "cpu" if mode == "cpu" else "accel"
            m = copy.deepcopy(ref).to(dev)
            run = torch.compile(m) if mode == "compiled" else m
            opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
            losses[mode] = []
            for _ in range(3):
                opt.zero_grad()
                loss = nn.functional.cross_entropy(run(x.to(dev)), y.to(dev))
                before = sum(launcher.launches.values())
                loss.backward()
                if mode == "compiled":
                    backward_launches.append(sum(launcher.launches.values()) - before)
                opt.step()
                losses[mode].append(loss.item())
            m.eval()
            with torch.no_grad():  # eval: the running statistics normalise
                evals[mode] = run(xe.to(dev)).cpu()
            models[mode] = m
        def state(m):
            return {k: v.detach().cpu().double() for k, v in m.state_dict().items()}
        want = state(models["eager"])
        gaps = {other: {k: (v - want[k]).abs().max().item()
                        for k, v in state(models[other]).items()}
                for other in ("compiled", "cpu")}
        for other in ("compiled", "cpu"):
            gaps[other]["eval output"] = (evals[other] - evals["eager"]).abs().max().item()
        report(losses=losses, gaps=gaps, kernels=sorted(launcher.launches),
               backward_launches=backward_launches, fallback=dict(torch_accel.fallback_counts))
    """, timeout=480)
    for mode in ("compiled", "cpu"):
        for a, b in zip(r["losses"]["eager"], r["losses"][mode]):
            assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), r["losses"]
        assert {"1.running_mean", "1.running_var", "5.running_mean", "5.running_var",
                "5.num_batches_tracked"} <= set(r["gaps"][mode]), r["gaps"]
        for name, gap in r["gaps"][mode].items():
            assert gap < 1e-5, (mode, name, gap, r["losses"])
    # batch norm and ReLU fused forward; the compiled backward launched generated kernels
    assert any("native_batch_norm" in k and "relu" in k for k in r["kernels"]), r["kernels"]
    assert min(r["backward_launches"]) > 0, r
    assert r["fallback"] == {}, r["fallback"]


@pytest.mark.timeout(400)
def test_openregs_compile_cases_on_the_default_backend(compile_json):
    """PyTorch's OpenReg test_compile.py cases, with Inductor instead of OpenReg's own
    backend: simple and full-graph compiles, recompilation only on a new shape, autograd
    through a compiled function, an nn.Module, dynamic shapes, a device transfer inside a
    full graph, a graph break, a default device, and autocast to float16 around ``mm``."""
    r = compile_json("""
        import torch._dynamo
        from torch._dynamo.testing import CompileCounterWithBackend
        out = {}
        x = torch.randn(4, device="accel")
        out["simple"] = bool(torch.equal(torch.compile(lambda x: x + 1)(x).cpu(), (x + 1).cpu()))
        full = torch.compile(lambda x: torch.relu((x + 1) * 2), fullgraph=True)
        out["fullgraph"] = bool(torch.equal(full(x).cpu(), torch.relu((x + 1) * 2).cpu()))
        counter = CompileCounterWithBackend("inductor")
        fn = torch.compile(lambda x: x + 1, backend=counter)
        fn(x); fn(x); once = counter.frame_count
        fn(torch.randn(8, device="accel"))
        out["recompile"] = [once, counter.frame_count]
        xg = torch.randn(4, device="accel", requires_grad=True)
        torch.compile(lambda x: (x * 2).sum())(xg).backward()
        out["autograd"] = xg.grad.cpu().tolist()
        lin = torch.nn.Linear(4, 4).to("accel")
        xs = torch.randn(2, 4, device="accel")
        got = torch.compile(lin)(xs)
        out["module"] = [str(got.device), list(got.shape),
                         bool(torch.allclose(got.cpu(), lin(xs).cpu(), atol=1e-6))]
        dyn = torch.compile(lambda x: x + 1, dynamic=True)
        out["dynamic"] = [bool(torch.equal(dyn(v).cpu(), (v + 1).cpu()))
                          for v in (torch.randn(4, device="accel"), torch.randn(8, device="accel"))]
        tr = torch.compile(lambda x: (x + 1).cpu() * 2, fullgraph=True)(x)
        out["transfer"] = [str(tr.device), bool(torch.equal(tr, (x + 1).cpu() * 2))]
        counter = CompileCounterWithBackend("inductor")
        def broken(x):
            y = x + 1
            torch._dynamo.graph_break()
            return y * 2
        out["graph_break"] = [bool(torch.equal(torch.compile(broken, backend=counter)(x).cpu(),
                                               ((x + 1) * 2).cpu())), counter.frame_count]
        with torch.device("accel"):
            dd = torch.compile(lambda x: x + torch.zeros(4))(x)
        out["default_device"] = str(dd.device)
        @torch.compile
        def autocast(a, b):
            with torch.autocast(device_type="accel", dtype=torch.float16):
                return torch.mm(a, b)
        ac = autocast(torch.randn(2, 3, device="accel"), torch.randn(3, 3, device="accel"))
        out["autocast"] = str(ac.dtype)
        report(**out)
    """, timeout=380)
    assert r.pop("recompile") == [1, 2] and r.pop("autograd") == [2.0] * 4, r
    ok, breaks = r.pop("graph_break")
    assert ok and breaks > 1, r
    assert r == {"simple": True, "fullgraph": True, "module": ["accel:0", [2, 4], True],
                 "dynamic": [True, True], "transfer": ["cpu", True],
                 "default_device": "accel:0", "autocast": "torch.float16"}, r
