"""Tensor basics on accel (OpenReg's test_ops): factories, copies, views and in-place
geometry, ``out=`` into strided slices, the CPU fallback's scalar, tensor and tensor-list
arguments, user operators and autograd functions, each against the CPU."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(300)


def test_factories_make_device_tensors(torch_run):
    lines = torch_run("""
        from torch._subclasses.fake_tensor import FakeTensorMode
        show = lambda t: (t.device.type, tuple(t.shape), tuple(t.stride()), str(t.dtype)[6:])
        print(show(torch.empty(3, device="accel")), show(torch.empty([2, 3], device="accel")))
        print(show(torch.zeros(3, device="accel")), show(torch.tensor((), device="accel")),
              show(torch.empty_strided((3, 4), (1, 3), device="accel")))
        cl = torch.empty(1, 2, 3, 4, device="accel", memory_format=torch.channels_last)
        print(show(cl), cl.is_contiguous(memory_format=torch.channels_last))
        x = torch.randn(3, 4, device="accel")
        print(torch.ones(3, 4, device="accel").cpu().unique().tolist(), torch.ones_like(x).cpu().unique().tolist(),
              torch.full((3, 4), 5.0, device="accel").cpu().unique().tolist(), show(x))
        with FakeTensorMode():
            z = torch.empty(3, 3, device="accel") + torch.empty(3, 3, device="accel:0")
            print(type(z).__name__, z.device, tuple(z.shape))
    """)
    assert lines == ["('accel', (3,), (1,), 'float32') ('accel', (2, 3), (3, 1), 'float32')",
                     "('accel', (3,), (1,), 'float32') ('accel', (0,), (1,), 'float32') "
                     "('accel', (3, 4), (1, 3), 'float32')",
                     "('accel', (1, 2, 3, 4), (24, 1, 8, 2), 'float32') True",
                     "[1.0] [1.0] [5.0] ('accel', (3, 4), (4, 1), 'float32')",
                     "FakeTensor accel:0 (3, 3)"]


def test_copies_between_host_devices_and_dtypes(torch_run):
    lines = torch_run("""
        a = torch.rand(10)
        print(torch.equal(a.to("accel").add(2).cpu(), a + 2),
              torch.equal(torch.ones(10, device="accel:0").to("accel:1").cpu(), torch.ones(10)))
        x = torch.randn(3, 4, device="accel")
        y = x.clone()
        print(y.device, torch.equal(y.cpu(), x.cpu()), y.data_ptr() != x.data_ptr(),
              x.to("accel").data_ptr() == x.data_ptr(), x.to("accel", copy=True).data_ptr() != x.data_ptr())
        d = torch.empty(3, 4, dtype=torch.float64, device="accel").copy_(x)
        print(d.dtype, torch.equal(d.cpu(), x.cpu().double()))
        nb = torch.empty(3, 4, device="accel")
        nb.copy_(x, non_blocking=True)
        host = torch.empty(3, 4)
        host.copy_(x)
        print(torch.equal(nb.cpu(), x.cpu()), torch.equal(host, x.cpu()),
              torch.equal(torch.empty(3, 4, device="accel").copy_(host).cpu(), host))
    """)
    assert lines == ["True True", "accel:0 True True True True", "torch.float64 True",
                     "True True True"]


def test_views_geometry_and_printing(torch_run):
    lines = torch_run("""
        x = torch.tensor([[1], [2], [3]], device="accel")
        e = x.expand(3, 2)
        print(e.cpu().tolist(), e.data_ptr() == x.data_ptr())
        t = torch.randn(2, 3, 4, device="accel")
        v, r = t.view(6, 4), t.reshape(6, 4)
        s = torch.as_strided(t, (2, 2), (4, 1), 1)
        print(v.data_ptr() == t.data_ptr(), r.data_ptr() == t.data_ptr(),
              torch.equal(s.cpu(), torch.as_strided(t.cpu(), (2, 2), (4, 1), 1)))
        print(torch.tensor([5.0], device="accel").item())
        m = torch.randn(4, 4).accel()
        print(m.untyped_storage().size() // 4, end=" ")
        m.resize_(2, 2, 2, 2)
        print(tuple(m.shape), m.untyped_storage().size() // 4, end=" ")
        m.resize_(5, 5)
        print(tuple(m.shape), m.untyped_storage().size() // 4)
        src = torch.randn(3, 4, device="accel")
        a, b = torch.empty(3, 4, device="accel"), torch.empty(3, 4, device="accel")
        a.set_(src)
        b.set_(src.untyped_storage(), 0, b.size())
        src.add_(1)  # both now alias it
        print(torch.equal(a.cpu(), src.cpu()), torch.equal(b.cpu(), src.cpu()), end=" ")
        try:
            a.set_(src.double())
        except RuntimeError as e:
            print(e, end=" ")
        a.set_()
        print(tuple(a.shape), a.stride(), a.untyped_storage().size(), a.device)
        print(repr(torch.ones(3, device="accel:1")))
    """)
    assert lines == ["[[1, 1], [2, 2], [3, 3]] True", "True True True", "5.0",
                     "16 (2, 2, 2, 2) 16 (5, 5) 25",
                     "True True Could not set tensor of type double to a tensor of type float "
                     "(0,) (1,) 0 accel:0",
                     "tensor([1., 1., 1.], device='accel:1')"]


def test_out_arguments_into_strided_slices(torch_run):
    """``out=`` a non-contiguous slice: the right size is written in place, the wrong size
    is resized as torch does (TensorIterator's resize flag), both as on the CPU."""
    lines = torch_run("""
        x = torch.randn(2, 2, 3)
        o = torch.randn(2, 2, 6)
        oa, xa = o.accel(), x.accel()
        for sl in (slice(0, 6, 2), slice(0, 6, 3)):
            torch.abs(x, out=o[:, :, sl])
            torch.abs(xa, out=oa[:, :, sl])
            print(torch.equal(o, oa.cpu()), end=" ")
        print()
        for fn in (torch.maximum, torch.minimum, torch.abs, torch.neg):
            args = (x, x.flip(0)) if fn in (torch.maximum, torch.minimum) else (x,)
            out = torch.empty(2, 2, 3, device="accel")
            ret = fn(*[a.accel() for a in args], out=out)
            print(ret is out and torch.equal(out.cpu(), fn(*args)), end=" ")
        print(torch.equal(torch.abs(xa.t() if xa.dim() == 2 else xa.transpose(0, 2)).cpu(),
                          x.transpose(0, 2).abs()))
    """)
    assert lines == ["True True ", "True True True True True"]


def test_matrix_product_out_arguments(torch_run):
    """``mm``/``addmm`` with ``out=`` (how a compiled graph calls every product) write the
    product straight into a contiguous ``out``; a bias of the result's shape is added, not
    taken for ``out``; an ``out`` an operand reads (``addmm_``'s own bias, ``out=a``), a
    transposed or wrong-size ``out`` still get the CPU's result, and a wrong dtype is
    torch's error, leaving ``out`` as it was."""
    lines = torch_run("""
        torch.manual_seed(0)
        a, b, bias = torch.randn(5, 5), torch.randn(5, 5), torch.randn(5)
        aa, ba, biasa = a.accel(), b.accel(), bias.accel()
        o = torch.empty(5, 5, device="accel")
        ret = torch.mm(aa, ba, out=o)
        print(ret is o, torch.allclose(o.cpu(), a @ b, atol=1e-5), end=" ")
        ret = torch.addmm(biasa, aa, ba, beta=0.5, alpha=2.0, out=o)
        print(ret is o, torch.allclose(o.cpu(), torch.addmm(bias, a, b, beta=0.5, alpha=2.0),
                                       atol=1e-5), end=" ")
        c = torch.randn(5, 5)
        ca = c.accel()
        print(torch.allclose(torch.addmm(ca, aa, ba).cpu(), torch.addmm(c, a, b), atol=1e-5),
              end=" ")
        ca.addmm_(aa, ba)
        print(torch.allclose(ca.cpu(), c.addmm(a, b), atol=1e-5), end=" ")
        x = aa.clone()
        torch.mm(x, ba, out=x)
        print(torch.allclose(x.cpu(), a @ b, atol=1e-5), end=" ")
        t = torch.empty(5, 5, device="accel").t()
        torch.mm(aa, ba, out=t)
        print(torch.allclose(t.cpu(), a @ b, atol=1e-5), end=" ")
        r = torch.empty(2, device="accel")
        torch.addmm(biasa, aa, ba, out=r)
        print(tuple(r.shape), torch.allclose(r.cpu(), torch.addmm(bias, a, b), atol=1e-5))
        d = torch.zeros(5, 5, dtype=torch.float64, device="accel")
        try:
            torch.mm(aa, ba, out=d)
        except RuntimeError as e:
            print(str(e).splitlines()[0], d.cpu().eq(0).all().item())
        try:
            torch.mm(a, b, out=torch.zeros(5, 5, dtype=torch.float64))
        except RuntimeError as e:
            print(str(e).splitlines()[0])
    """)
    assert lines[0] == "True True True True True True True True (5, 5) True"
    assert lines[1].rsplit(" ", 1) == [lines[2], "True"]


def test_fallback_takes_scalars_tensors_and_tensor_lists(torch_run):
    lines = torch_run("""
        print(torch.triu_indices(3, 3, device="accel").cpu().tolist())
        x = torch.tensor([[1.0, 2, 3], [2, 3, 4]], device="accel")
        y = torch.tensor([1.0, 0, 2], device="accel")
        idx = torch.tensor([1, 0], device="accel")
        print(torch.sub(x, y).cpu().tolist(), x[idx, idx].cpu().tolist())
        z = torch._foreach_add((y, y), (y, y))
        print([t.device.type for t in z], [t.cpu().tolist() for t in z])
        r = torch.randn(10)
        ra = r.accel()
        print(torch.equal(torch.masked_select(ra, ra.gt(0)).cpu(), r.masked_select(r.gt(0))))
        print((ra + 1.0).device, (ra * 2.0).device)
    """)
    assert lines == ["[[0, 0, 0, 1, 1, 2], [0, 1, 2, 1, 2, 2]]",
                     "[[0.0, 2.0, 1.0], [1.0, 3.0, 2.0]] [3.0, 1.0]",
                     "['accel', 'accel'] [[2.0, 0.0, 4.0], [2.0, 0.0, 4.0]]", "True",
                     "accel:0 accel:0"]


def test_user_operators_and_autograd_functions(torch_run):
    """A ``torch.library.custom_op`` with an accel kernel (OpenReg's custom_abs), and
    autograd functions that return their input itself or a view of it (OpenReg's
    custom_autograd_fn_returns_self/_aliasing), with gradients halved in the backward."""
    lines = torch_run("""
        @torch.library.custom_op("accel_test::my_abs", mutates_args=(), device_types="accel")
        def my_abs(x: torch.Tensor) -> torch.Tensor:
            return torch.where(x < 0, -x, x)
        x = torch.randn(2, 3, device="accel")
        print(my_abs(x).device, torch.equal(my_abs(x).cpu(), x.cpu().abs()))

        class ReturnsSelf(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x
            @staticmethod
            def backward(ctx, g):
                return g * 0.5

        class Aliasing(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x.view_as(x)
            @staticmethod
            def backward(ctx, g):
                return g * 0.5

        for fn in (ReturnsSelf, Aliasing):
            x = torch.randn(4, device="accel", requires_grad=True)
            y = fn.apply(x)
            y.sum().backward()
            plain = fn.apply(torch.randn(4, device="accel"))
            print(y.data_ptr() == x.data_ptr(), y.requires_grad, x.grad.cpu().tolist(), plain.requires_grad)
    """)
    assert lines == ["accel:0 True", "True True [0.5, 0.5, 0.5, 0.5] False",
                     "True True [0.5, 0.5, 0.5, 0.5] False"]


def test_quantized_tensors_are_refused_with_torchs_error(torch_run):
    """OpenReg makes quantized tensors on its device; accel does not offer the quantized
    dtypes (docs/torch.md, "Tensors and storage"), and says so with torch's own error."""
    lines = torch_run("""
        x = torch.randn(3, 4, device="accel")
        for make in (lambda: torch.quantize_per_tensor(x, 0.1, 10, torch.qint8),
                     lambda: torch.quantize_per_tensor(x.cpu(), 0.1, 10, torch.qint8).to("accel")):
            try:
                make()
                print("made")
            except NotImplementedError as e:
                print(type(e).__name__, "QuantizedAccel" in str(e) or "Quantized" in str(e))
    """)
    assert lines == ["NotImplementedError True", "NotImplementedError True"]
