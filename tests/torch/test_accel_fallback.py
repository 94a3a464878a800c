"""The CPU fallback (torch_accel/ops/fallback.py) keeps each operator's meaning: what an
operator writes is written on the device (BatchNorm's running statistics included), a view
stays a view of its base's device storage, and a factory asked for ``device="accel"`` makes
its result on the device instead of dispatching back to the fallback for ever.

The last two tests do not trust a hand-picked list: they walk every aten schema that
reaches the fallback (no accel kernel, no composite one), check that the fallback's rule
covers each class of operator (written arguments of any type, views, factories), and run
a sample of them (every factory that takes plain numbers, the OpInfo entries of the others)
on accel against the CPU: results, the arguments after the call, and which results share
their input's storage.
"""

from __future__ import annotations

import textwrap

import pytest

pytestmark = pytest.mark.timeout(600)

#: the aten overloads that reach the fallback: no accel kernel and no composite kernel
#: (torch runs a composite one instead, made of other operators)
REACHES_FALLBACK = """
from torch_accel.ops import fallback as fb
C = torch._C
OWN = ("PrivateUse1", "CompositeExplicitAutograd", "CompositeImplicitAutograd",
       "CompositeExplicitAutogradNonFunctional")
def reaches(name):
    return C._dispatch_has_kernel(name) and not any(
        C._dispatch_has_kernel_for_dispatch_key(name, k) for k in OWN)
schemas = [s for s in C._jit_get_all_schemas()
           if s.name.startswith("aten::") and reaches(fb._overload_name(s))]
"""


def test_batch_norm_training_updates_running_stats(torch_json):
    """native_batch_norm writes the running statistics although its schema does not say so:
    three training steps of BatchNorm1d and BatchNorm2d, then eval, match the CPU (float32:
    the device's batch norm, ops/norm.py); F.batch_norm in bfloat16, which has no device
    kernel, takes the fallback, and its running statistics are copied back."""
    r = torch_json("""
        torch.manual_seed(0)
        out = {}
        for cls, shape in ((torch.nn.BatchNorm1d, (8, 4)), (torch.nn.BatchNorm1d, (8, 4, 5)),
                           (torch.nn.BatchNorm2d, (4, 3, 5, 5))):
            cpu = cls(shape[1])
            acc = cls(shape[1]).to("accel")
            for _ in range(3):
                x = torch.randn(shape)
                torch.testing.assert_close(acc(x.to("accel")).cpu(), cpu(x))
            cpu.eval(); acc.eval()
            x = torch.randn(shape)
            for name in ("running_mean", "running_var", "num_batches_tracked"):
                torch.testing.assert_close(getattr(acc, name).cpu(), getattr(cpu, name))
            torch.testing.assert_close(acc(x.to("accel")).cpu(), cpu(x))
            out[f"{cls.__name__}{len(shape)}"] = float(cpu.running_var.sub(1).abs().max())
        bf = torch.bfloat16
        mean, var = torch.zeros(4, device="accel", dtype=bf), torch.ones(4, device="accel", dtype=bf)
        x = torch.randn(8, 4, dtype=bf)
        torch_accel.fallback_counts.clear()
        torch.nn.functional.batch_norm(x.to("accel"), mean, var, training=True, momentum=0.5)
        cm, cv = torch.zeros(4, dtype=bf), torch.ones(4, dtype=bf)
        torch.nn.functional.batch_norm(x, cm, cv, training=True, momentum=0.5)
        torch.testing.assert_close((mean.cpu(), var.cpu()), (cm, cv))
        report(moved=out, functional=float(cm.abs().max()),
               fallback=torch_accel.fallback_counts.get("aten::native_batch_norm", 0))
    """)
    assert all(v > 0 for v in r["moved"].values()), r  # the statistics did change
    assert r["functional"] > 0 and r["fallback"] == 1, r


def test_views_through_the_fallback_alias_their_base(torch_json):
    """unfold, view_as_real and view_as_complex have CPU kernels only: on accel they are
    views of the argument's device storage, written through both ways."""
    r = torch_json("""
        torch_accel.ops.fallback.fallback_counts.clear()
        base = torch.arange(10.0, device="accel")
        u = base.unfold(0, 4, 3)
        u[1, 0] = 100.0           # base[3]
        base[7] = -1.0            # u[2, 1]
        c = torch.randn(3, dtype=torch.complex64).to("accel")
        vr = torch.view_as_real(c)
        vr[0, 1] = 5.0
        f = torch.arange(8.0, device="accel").reshape(4, 2)[1:]
        vc = torch.view_as_complex(f)
        vc[0] = 0.5 + 0.25j
        counts = {k: v for k, v in torch_accel.ops.fallback.fallback_counts.items()
                  if "view_as" in k or "unfold" in k}
        report(base=base.cpu().tolist(), u=u.cpu().tolist(), unfold_meta=[list(u.stride()), u.storage_offset()],
               same_storage=[v.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
                             for v, b in ((u, base), (vr, c), (vc, f))],
               bases=[u._base is base, vr._base is c, vc._base is not None],
               c_imag0=float(c[0].imag.cpu()), f=f.cpu().tolist(), counts=counts)
    """)
    assert r["base"] == [0, 1, 2, 100, 4, 5, 6, -1, 8, 9], r
    assert r["u"] == [[0, 1, 2, 100], [100, 4, 5, 6], [6, -1, 8, 9]], r
    assert r["unfold_meta"] == [[3, 1], 0], r
    assert r["same_storage"] == [True] * 3 and r["bases"] == [True] * 3, r
    assert r["c_imag0"] == 5.0 and r["f"] == [[0.5, 0.25], [4, 5], [6, 7]], r
    assert r["counts"] == {"aten::unfold": 1, "aten::view_as_real": 1, "aten::view_as_complex": 1}, r


def test_factories_through_the_fallback_make_on_the_cpu_and_move(torch_json):
    r = torch_json("""
        a = torch.triu_indices(4, 5, 1, device="accel")
        b = torch.tril_indices(3, 3, device="accel:1")
        report(devices=[str(a.device), str(b.device)],
               same=[torch.equal(a.cpu(), torch.triu_indices(4, 5, 1)),
                     torch.equal(b.cpu(), torch.tril_indices(3, 3))])
    """)
    assert r == {"devices": ["accel:0", "accel:1"], "same": [True, True]}, r


def test_every_fallback_schema_class_has_a_rule(torch_json):
    """Every overload that reaches the fallback: one with a written argument (a tensor, an
    optional tensor or a list) copies each back, one whose result aliases an argument is a
    view made by a Meta kernel, the rest compute; every factory that takes plain numbers is
    then run on accel against the CPU."""
    r = torch_json(REACHES_FALLBACK + textwrap.dedent("""
        import re
        bad, kinds, classes = [], set(), {"writes": 0, "view": 0, "compute": 0}
        for s in schemas:
            name, text = fb._overload_name(s), str(s)
            declared = [a.name for a in s.arguments if a.alias_info is not None and a.alias_info.is_write]
            # read from the schema's text too, not only through the bindings the rule uses
            in_text = re.findall(r"\\(\\w!\\)(\\?|\\[\\])? (\\w+)", text.split(" -> ")[0])
            if sorted(n for _, n in in_text) != sorted(declared):
                bad.append(("text", name))
            kinds.update(str(a.type) for a in s.arguments if a.name in declared)
            rule = fb.rule(s)
            classes[rule] += 1
            if not set(declared) <= set(fb.written_arguments(s)):
                bad.append(("not copied back", name))
            if declared and rule != "writes":
                bad.append(("writes", name, rule))
            aliases = any(x.alias_info is not None for x in s.returns)
            if aliases and not declared and rule != "view":
                bad.append(("view", name, rule))
            # a view of a dense tensor needs the Meta kernel (sparse/nested ones have no CPU
            # kernel either: accel offers neither layout)
            if rule == "view" and C._dispatch_has_kernel_for_dispatch_key(name, "CPU") \\
                    and not C._dispatch_has_kernel_for_dispatch_key(name, "Meta") \\
                    and "nested" not in name:
                bad.append(("no meta", name))
        # factories: a Device? argument and no tensor; run those whose arguments are numbers
        # an empty-like factory's values are then NaN on both sides, not stale memory
        torch.use_deterministic_algorithms(True)
        sample = {"int": 3, "SymInt": 3, "float": 0.5, "bool": False, "List[int]": [2, 3]}
        factories = {}
        for s in schemas:
            if not any("Device" in str(a.type) for a in s.arguments) \\
                    or any("Tensor" in str(a.type) for a in s.arguments):
                continue
            name = fb._overload_name(s)
            need = [a for a in s.arguments if not a.kwarg_only and not a.has_default_value()]
            if any(str(a.type) not in sample for a in need):
                factories[name] = "no sample input"
                continue
            args = [sample[str(a.type)] for a in need]
            op = getattr(getattr(torch.ops.aten, s.name.split("::")[1]), s.overload_name or "default")
            try:
                expected = op(*args, device="cpu")
            except Exception as e:
                factories[name] = f"cpu refuses: {type(e).__name__}"
                continue
            try:
                got = op(*args, device="accel:1")
                assert got.device == torch.device("accel:1"), got.device
                torch.testing.assert_close(got.cpu(), expected, equal_nan=True, rtol=0, atol=0)
                factories[name] = "same"
            except AssertionError:
                factories[name] = "differs"
            except Exception as e:
                factories[name] = f"accel raises {type(e).__name__}: {str(e)[:80]}"
        report(bad=bad, kinds=sorted(kinds), classes=classes, factories=factories, n=len(schemas))
    """))
    assert r["bad"] == [], r["bad"]
    # the written arguments come in these types, each copied back
    assert {"Tensor", "List[Tensor]"} <= set(r["kinds"]) <= {"Tensor", "Optional[Tensor]", "List[Tensor]"}, r
    assert min(r["classes"].values()) > 0, r
    ran = {k: v for k, v in r["factories"].items() if v == "same" or v.startswith(("accel", "differs"))}
    assert {"aten::triu_indices", "aten::tril_indices"} <= set(ran), r["factories"]
    assert all(v == "same" for v in ran.values()), r["factories"]


#: every how many-th OpInfo entry (by name) with a written or view overload reaching the
#: fallback is run: all of them take minutes of first-launch kernel compiles for the
#: native operators among their arguments' copies and checks
STRIDE = 6


def test_sampled_fallback_operators_match_cpu(torch_json):
    """OpInfo entries whose overloads reach the fallback as writers or views (every view,
    every ``STRIDE``-th writer): functional, in-place and ``out=`` forms of their first
    float32 samples give the CPU's results, leave every argument as the CPU leaves it (so an
    undeclared write, like native_batch_norm's, is caught), and return results sharing
    their arguments' storage exactly where the CPU's do. The values of operators that draw
    random numbers are not compared: accel draws from its own generator."""
    r = torch_json(REACHES_FALLBACK + textwrap.dedent(f"""
        from torch.testing._internal.common_methods_invocations import op_db
        from torch.utils._pytree import tree_leaves, tree_map
        STRIDE = {STRIDE}
    """) + textwrap.dedent("""
        rules = {}
        for s in schemas:
            rules.setdefault(s.name.split("::")[1], set()).add(fb.rule(s))
        # operators that draw (a Generator argument): accel draws from its own generator
        drawing = {s.name.split("::")[1] for s in C._jit_get_all_schemas()
                   if any("Generator" in str(a.type) for a in s.arguments)}
        kind = lambda o: rules.get(o.aten_name, set()) | rules.get(o.aten_name + "_", set())
        entries = sorted((o for o in op_db if kind(o) & {"view", "writes"}), key=lambda o: o.name)
        views = [o for o in entries if "view" in kind(o)]
        chosen = views + [o for o in entries if o not in views][::STRIDE]

        def storages(tree):
            return [t.untyped_storage().data_ptr() if isinstance(t, torch.Tensor) and t.numel() else None
                    for t in tree_leaves(tree)]

        def sharing(results, inputs):
            ins = storages(inputs)
            return [ins.index(p) if p is not None and p in ins else None for p in storages(results)]

        def call(fn, sample, device, out_like=None):
            move = (lambda t: t.clone()) if device == "cpu" else (lambda t: t.to(device))
            inputs = tree_map(lambda t: move(t) if isinstance(t, torch.Tensor) else t,
                              (sample.input, sample.args, sample.kwargs))
            x, args, kwargs = inputs
            if "device" in kwargs:  # a factory's sample: made where the call is
                kwargs = dict(kwargs, device=device)
                inputs = (x, args, kwargs)
            if out_like is not None:
                kwargs = dict(kwargs, out=tree_map(
                    lambda t: torch.empty_like(t, device=device) if isinstance(t, torch.Tensor) else t, out_like))
                inputs = (x, args, kwargs)
            return fn(x, *args, **kwargs), inputs

        bad, ran = [], []
        for o in chosen:
            dtypes = o.supported_dtypes("cpu")
            dtype = torch.float32 if torch.float32 in dtypes else (
                torch.complex64 if "view" in kind(o) and torch.complex64 in dtypes else None)
            if dtype is None:
                continue
            random = o.aten_name in drawing or o.aten_name + "_" in drawing
            for i, sample in enumerate(o.sample_inputs("cpu", dtype)):
                if i == 2:
                    break
                forms = {"functional": o.op, "inplace": o.inplace_variant,
                         "out": o.op if o.supports_out else None}
                for form, fn in forms.items():
                    if fn is None:
                        continue
                    try:
                        like = call(o.op, sample, "cpu")[0] if form == "out" else None
                        want, want_in = call(fn, sample, "cpu", like)
                    except Exception:
                        continue  # the CPU refuses this form: nothing to compare
                    label = f"{o.name}[{i}] {form}"
                    try:
                        got, got_in = call(fn, sample, "accel", like)
                        cpu = lambda t: t.cpu() if isinstance(t, torch.Tensor) else t
                        if not random:
                            torch.testing.assert_close(tree_map(cpu, got), want, equal_nan=True)
                            tensors = lambda tree: [cpu(t) for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]
                            torch.testing.assert_close(tensors(got_in), tensors(want_in), equal_nan=True)
                        if sharing(got, got_in) != sharing(want, want_in):
                            bad.append((label, "aliasing", sharing(got, got_in), sharing(want, want_in)))
                        ran.append(label)
                    except Exception as e:
                        bad.append((label, type(e).__name__, str(e)[:200]))
        report(bad=bad, ran=ran, chosen=[o.name for o in chosen])
    """), timeout=550)
    assert r["bad"] == [], r["bad"]
    assert {"unfold", "view_as_real", "view_as_complex"} <= set(r["chosen"]), r["chosen"]
    assert len(r["ran"]) >= 40, r
