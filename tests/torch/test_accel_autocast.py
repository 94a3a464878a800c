"""Autocast on accel (OpenReg's test_autocast): torch.autocast(device_type="accel") takes
the dtypes torch.accel.get_amp_supported_dtype names (float16 by default), runs matrix
products in that dtype and reductions/losses in float32, passes every other operator
through, and refuses float32 with torch's warning."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(120)


def test_autocast_casts_by_torch_cudas_lists(torch_run):
    lines = torch_run("""
        print(torch.get_autocast_dtype("accel"), torch.accel.get_amp_supported_dtype())
        a, b = torch.randn(2, 3, device="accel"), torch.randn(3, 3, device="accel")
        h = torch.randn(4, device="accel", dtype=torch.half)
        with torch.autocast(device_type="accel"):
            print(torch.is_autocast_enabled("accel"), torch.mm(a, b).dtype, (a @ b).dtype,
                  (a + 1).dtype, torch.dot(h, h).dtype, torch.softmax(h, 0).dtype)
            with torch.autocast(device_type="accel", enabled=False):
                print(torch.mm(a, b).dtype)
        with torch.amp.autocast(device_type="accel", dtype=torch.bfloat16):
            lin = torch.nn.Linear(3, 2).accel()
            out = lin(a)
            print(out.dtype, torch.bmm(a[None], b[None]).dtype)
        out.float().sum().backward()
        print(lin.weight.grad.dtype, lin.weight.grad.device, torch.is_autocast_enabled("accel"))
        ref = torch.mm(a.cpu().half().float(), b.cpu().half().float())
        with torch.autocast(device_type="accel"):
            got = torch.mm(a, b).float().cpu()
            print("apart", (~torch.isclose(got, ref, atol=1e-2)).sum().item(), (got - ref).abs().max().item())
    """)
    assert lines == ["torch.float16 [torch.float16, torch.bfloat16]",
                     "True torch.float16 torch.float16 torch.float32 torch.float32 torch.float32",
                     "torch.float32", "torch.bfloat16 torch.bfloat16",
                     "torch.float32 accel:0 False", lines[-1]]
    assert lines[-1].startswith("apart 0 "), lines  # elements np.allclose finds apart, widest gap



def test_unsupported_dtype_warns_and_disables_autocast(torch_run):
    lines = torch_run("""
        import warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.autocast(device_type="accel", dtype=torch.float32):
                print(torch.is_autocast_enabled("accel"),
                      torch.mm(torch.ones(2, 2, device="accel"), torch.ones(2, 2, device="accel")).dtype)
        print([(w.category.__name__, str(w.message)) for w in caught])
    """)
    assert lines == ["False torch.float32", str([(
        "UserWarning", "In accel autocast, but the target dtype is not supported. Disabling "
        "autocast.\naccel Autocast only supports dtypes of torch.float16, torch.bfloat16 currently.")])]


def test_attention_runs_in_the_autocast_dtype(torch_run):
    """scaled_dot_product_attention is on torch.cuda's lower-precision list: under
    autocast it takes and returns the autocast dtype, and its gradients reach float32
    leaves, close to float32 attention of the rounded inputs."""
    lines = torch_run("""
        import torch.nn.functional as F
        torch.manual_seed(0)
        q = torch.randn(2, 2, 16, 8)
        leaf = q.to("accel").requires_grad_()
        with torch.autocast("accel"):
            out = F.scaled_dot_product_attention(leaf, leaf, leaf, is_causal=True)
        out.float().sum().backward()
        ref_leaf = q.half().float().requires_grad_()
        ref = F.scaled_dot_product_attention(ref_leaf, ref_leaf, ref_leaf, is_causal=True)
        ref.sum().backward()
        print(out.dtype, leaf.grad.dtype, out.grad_fn.name())
        print((out.float().cpu() - ref).abs().max().item() < 1e-2,
              (leaf.grad.cpu() - ref_leaf.grad).abs().max().item() < 2e-2)
    """)
    assert lines == ["torch.float16 torch.float32 ScaledDotProductFusedAttentionOverrideableBackward0",
                     "True True"]
