"""Scaled dot-product attention on accel (OpenReg's test_sdpa): ``_fused_sdp_choice`` picks
torch's OVERRIDEABLE backend, and ``F.scaled_dot_product_attention`` and the fused
operator's forward and backward match the CPU (masks, causal, scale, dropout, float16)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(600)


def test_fused_sdp_choice_is_the_overrideable_backend(torch_run):
    """Every case the fused operator runs takes it; grouped-query attention (which torch
    does not pass to it) takes MATH, and ``sdpa_kernel`` is obeyed as on CUDA."""
    lines = torch_run("""
        from torch.nn.attention import SDPBackend, sdpa_kernel
        q = torch.rand(4, 2, 16, 8, dtype=torch.float16).to("accel")
        mask = torch.rand(4, 2, 16, 16, dtype=torch.float16).to("accel")
        kv2 = torch.rand(4, 1, 16, 8).to("accel")
        name = lambda v: SDPBackend(v).name
        print(name(torch._fused_sdp_choice(q, q, q)), name(torch._fused_sdp_choice(q, q, q, mask)),
              name(torch._fused_sdp_choice(q, q, q, dropout_p=0.1, is_causal=True)),
              name(torch._fused_sdp_choice(q.float(), kv2, kv2, enable_gqa=True)))
        with sdpa_kernel(SDPBackend.MATH):
            print(name(torch._fused_sdp_choice(q, q, q)))
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            try:
                torch._fused_sdp_choice(q, q, q)
            except RuntimeError as e:
                print("refused:", e)
    """)
    assert lines == ["OVERRIDEABLE OVERRIDEABLE OVERRIDEABLE MATH", "MATH",
                     "refused: No available kernel. Aborting execution."]


def test_sdpa_matches_cpu_forward_and_backward(torch_json):
    r = torch_json("""
        import torch.nn.functional as F
        torch.manual_seed(0)
        paths = []  # the backward of each accel result: which road F.sdpa took
        def compare(q, k, v, mask=None, **kw):
            res = {}
            for dev in ("cpu", "accel"):
                leaves = [t.to(dev).detach().requires_grad_(t.is_floating_point())
                          if t is not None else None for t in (q, k, v, mask)]
                out = F.scaled_dot_product_attention(*leaves[:3], attn_mask=leaves[3], **kw)
                out.backward(torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape).to(dev))
                res[dev] = [out] + [t.grad for t in leaves if t is not None and t.requires_grad]
            paths.append(out.grad_fn.name())
            return max((a.detach().cpu() - c.detach()).abs().max().item() / max(c.abs().max().item(), 1.0)
                       for a, c in zip(res["accel"], res["cpu"]))
        q, k, v = torch.randn(2, 3, 16, 8), torch.randn(2, 3, 12, 8), torch.randn(2, 3, 12, 5)
        hide = torch.rand(16, 12) > 0.3
        hide[3] = False  # a row that sees no key: zeros, as on the CPU
        gaps = {
            "plain": compare(q, k, v),
            "bool mask": compare(q, k, v, hide),
            "float mask": compare(q, k, v, torch.randn(2, 1, 16, 12)),
            "causal": compare(q, k, v, is_causal=True),
            "scale": compare(q, k, v, scale=0.3),
            "3-d": compare(q[0], k[0], v[0]),
            "broadcast": compare(q[0], k, v),
            "float64": compare(q.double(), k.double(), v.double(), torch.randn(16, 12).double()),
            "gqa": compare(torch.randn(2, 4, 16, 8), k[:, :2], v[:, :2], enable_gqa=True),
        }
        fallback = dict(torch_accel.fallback_counts)
        from torch.testing._internal.common_methods_invocations import op_db
        info, = [o for o in op_db if o.name == "nn.functional.scaled_dot_product_attention"]
        samples = [s for s in info.sample_inputs("cpu", torch.float32) if s.kwargs["dropout_p"] == 0]
        for s in samples:
            d = s.transform(lambda t: t.to("accel") if isinstance(t, torch.Tensor) else t)
            ref = info(s.input, *s.args, **s.kwargs)  # scores reach ~200: float32 rounding scales
            torch.testing.assert_close(info(d.input, *d.args, **d.kwargs).cpu(), ref,
                                       rtol=1.3e-6, atol=1e-5 * max(1.0, ref.abs().max().item()))
        report(gaps=gaps, fallback=fallback, opinfo_samples=len(samples), paths=paths)
    """)
    for label, gap in r["gaps"].items():
        assert gap < 1e-5, (label, gap)
    # every case but grouped-query attention ran the fused operator, not torch's math
    assert r["paths"] == ["ScaledDotProductFusedAttentionOverrideableBackward0"] * 8 + [
        r["paths"][-1]] and "Overrideable" not in r["paths"][-1], r["paths"]
    assert r["opinfo_samples"] >= 7  # torch's OpInfo samples without dropout, forward
    # the fused operator left nothing to the CPU; the GQA case's math path did (its
    # _safe_softmax's isneginf and where.out, once)
    assert r["fallback"] == {"aten::isneginf.out": 1, "aten::where.self_out": 1}, r["fallback"]


def test_fused_operator_in_float16_matches_cpu(torch_json):
    """The fused operator called as OpenReg's test calls it (float16, an additive mask,
    every gradient), against float32 attention of the same numbers on the CPU."""
    r = torch_json("""
        import torch.nn.functional as F
        torch.manual_seed(0)
        shape = (2, 2, 64, 32)
        q, k, v, bias = (torch.rand(s, dtype=torch.float16) for s in (shape, shape, shape, (2, 2, 64, 64)))
        up = torch.rand(shape, dtype=torch.float16)
        dev = [t.to("accel") for t in (q, k, v, bias, up)]
        (out, lse, cq, ck, max_q, max_k, seed, offset, debug) = \\
            torch.ops.aten._scaled_dot_product_fused_attention_overrideable(*dev[:3], attn_bias=dev[3])
        grads = torch.ops.aten._scaled_dot_product_fused_attention_overrideable_backward(
            dev[4], *dev[:4], [True, True, True, True], out, lse, cq, ck, max_q, max_k,
            dropout_p=0.0, is_causal=False, philox_seed=seed, philox_offset=offset)
        ref = [t.float().requires_grad_() for t in (q, k, v, bias)]
        ref_out = F.scaled_dot_product_attention(*ref[:3], attn_mask=ref[3])
        ref_out.backward(up.float())
        ref_lse = torch.logsumexp(ref[0] @ ref[1].transpose(-2, -1) / 32 ** 0.5 + ref[3], -1)
        gap = lambda a, c: ((a.cpu().float() - c.detach()).abs().max() / c.abs().max()).item()
        report(dtypes=[str(t.dtype) for t in (out, lse, *grads)], sizes=[max_q, max_k],
               out=gap(out, ref_out), lse=gap(lse, ref_lse),
               grads=[gap(g, t.grad) for g, t in zip(grads, ref)])
    """)
    assert r["dtypes"] == ["torch.float16", "torch.float32"] + ["torch.float16"] * 4
    assert r["sizes"] == [64, 64]
    assert r["out"] < 2e-3 and r["lse"] < 1e-5, r
    assert max(r["grads"]) < 5e-3, r  # float16's own rounding of each result


def test_dropout_mask_is_drawn_once_for_forward_and_backward(torch_json):
    """With dropout, the output and every gradient are those of one mask: the mask
    ``bernoulli_(1 - p)`` draws from the same seed on the device, redrawn in the backward
    from the (seed, offset) the forward returned."""
    r = torch_json("""
        import torch.nn.functional as F
        torch.manual_seed(0)
        q, k, v = torch.randn(2, 2, 16, 8), torch.randn(2, 2, 16, 8), torch.randn(2, 2, 16, 8)
        g = torch.randn(2, 2, 16, 8)
        leaves = [t.to("accel").requires_grad_() for t in (q, k, v)]
        torch.accel.manual_seed(7)
        out = F.scaled_dot_product_attention(*leaves, dropout_p=0.3, is_causal=True)
        out.backward(g.to("accel"))
        torch.accel.manual_seed(7)
        again = F.scaled_dot_product_attention(*leaves, dropout_p=0.3, is_causal=True)
        torch.accel.manual_seed(7)
        keep = torch.empty(2, 2, 16, 16, device="accel").bernoulli_(0.7).cpu()
        ref = [t.clone().requires_grad_() for t in (q, k, v)]
        scores = (ref[0] @ ref[1].transpose(-2, -1) / 8 ** 0.5).masked_fill(
            ~torch.ones(16, 16, dtype=torch.bool).tril(), -float("inf"))
        ref_out = (torch.softmax(scores, -1) * keep / 0.7) @ ref[2]
        ref_out.backward(g)
        gap = lambda a, c: (a.detach().cpu() - c.detach()).abs().max().item()
        report(same=bool(torch.equal(out.cpu(), again.cpu())), kept=keep.mean().item(),
               out=gap(out, ref_out), grads=[gap(a.grad, c.grad) for a, c in zip(leaves, ref)])
    """)
    assert r["same"] and 0.5 < r["kept"] < 0.9, r
    assert r["out"] < 1e-5 and max(r["grads"]) < 1e-5, r
