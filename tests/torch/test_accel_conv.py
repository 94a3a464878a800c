"""Convolutions on the device (im2col + the matrix unit, col2im for the input gradient):
forward and every gradient match the CPU over a grid of 1-D/2-D/3-D shapes, groups,
strides, padding, dilation and bias; the plane kernels (unit stride and dilation: thin
convolutions direct, a block per tile of output rows) match it too and serve the cases
they should; the forward's columns, kept for the weight gradient,
live no longer than they may and are not used for an input written since; max, average
and adaptive pooling (on the device) match the CPU; a small CNN trains three SGD steps to
the CPU's weights from the same initialisation."""

from __future__ import annotations

import textwrap

import pytest

pytestmark = pytest.mark.timeout(600)

#: forward, then backward of a random output gradient, on accel and on the CPU; reports
#: the largest gap of the output and of each gradient, and what ran through the fallback
COMPARE = """
import torch.nn.functional as F
def compare(fn, *inputs, **kw):
    res = {}
    for dev in ("cpu", "accel"):
        leaves = [t.to(dev).detach().requires_grad_() for t in inputs if t is not None]
        out = fn(*leaves, *[None] * (len(inputs) - len(leaves)), **kw)
        g = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape).to(dev)
        out.backward(g)
        res[dev] = [out.detach().cpu()] + [t.grad.cpu() for t in leaves]
    gaps = {}
    for i, (a, c) in enumerate(zip(res["accel"], res["cpu"])):
        assert a.shape == c.shape, (i, a.shape, c.shape)
        gaps["out" if i == 0 else f"grad {i - 1}"] = (
            (a - c).abs().max().item() / max(c.abs().max().item(), 1.0))
    return gaps
"""


def with_compare(body: str) -> str:
    return COMPARE + textwrap.dedent(body)


def test_convolution_grid_matches_cpu_forward_and_backward(torch_json):
    r = torch_json(with_compare("""
        r = lambda *s, dt=torch.float32: torch.randn(*s, dtype=dt)
        cases = {
            "1d stride 2 pad 1 bias": (F.conv1d, r(2, 4, 9), r(6, 4, 3), r(6), dict(stride=2, padding=1)),
            "1d groups 2 dilation 2": (F.conv1d, r(2, 4, 11), r(6, 2, 3), None, dict(groups=2, dilation=2)),
            "2d stride pad dilation bias": (F.conv2d, r(2, 3, 7, 6), r(4, 3, 3, 2), r(4),
                                           dict(stride=(2, 1), padding=(1, 0), dilation=(1, 2))),
            "2d depthwise": (F.conv2d, r(2, 3, 5, 5), r(6, 1, 3, 3), r(6), dict(padding=1, groups=3)),
            "2d 1x1 no bias": (F.conv2d, r(3, 5, 4, 4), r(2, 5, 1, 1), None, {}),
            "2d padding same": (F.conv2d, r(1, 2, 6, 5), r(3, 2, 3, 3), r(3), dict(padding="same")),
            "2d float64": (F.conv2d, r(2, 2, 5, 5, dt=torch.float64), r(3, 2, 2, 2, dt=torch.float64),
                           r(3, dt=torch.float64), dict(stride=2)),
            "3d groups stride pad dilation": (F.conv3d, r(2, 4, 4, 5, 3), r(2, 2, 2, 3, 1), r(2),
                                              dict(groups=2, stride=(1, 2, 1), padding=(1, 1, 0),
                                                   dilation=(2, 1, 1))),
            "2d unbatched": (F.conv2d, r(3, 5, 5), r(2, 3, 3, 3), r(2), {}),
            "2d transposed stride pad output_padding": (
                F.conv_transpose2d, r(2, 4, 3, 3), r(4, 2, 3, 3), r(2),
                dict(stride=2, padding=1, output_padding=1)),
            "2d transposed groups dilation": (
                F.conv_transpose2d, r(2, 4, 4, 3), r(4, 3, 2, 3), None,
                dict(groups=2, dilation=(2, 1), stride=(1, 2), output_padding=(0, 1))),
            "1d transposed": (F.conv_transpose1d, r(3, 2, 6), r(2, 5, 4), r(5), dict(stride=3, padding=2)),
            "1d transposed unbatched float64": (
                F.conv_transpose1d, r(2, 5, dt=torch.float64), r(2, 3, 3, dt=torch.float64),
                r(3, dt=torch.float64), dict(padding=1)),
            "3d transposed": (F.conv_transpose3d, r(1, 2, 3, 2, 3), r(2, 2, 2, 2, 2), r(2),
                              dict(stride=2)),
            "2d float16 (CPU)": (F.conv2d, r(1, 2, 4, 4, dt=torch.float16),
                                 r(2, 2, 3, 3, dt=torch.float16), None, {}),
        }
        gaps = {name: compare(fn, x, w, b, **kw) for name, (fn, x, w, b, kw) in cases.items()}
        report(gaps=gaps, fallback=dict(torch_accel.fallback_counts))
    """), timeout=500)
    for name, gaps in r["gaps"].items():
        for label, gap in gaps.items():
            assert gap < (1e-2 if "float16" in name else 1e-5), (name, label, gap)
    # only float16 (no kernel type) went to the CPU's convolution; transposed ones ran here
    assert r["fallback"].get("aten::convolution") == 1, r["fallback"]
    assert r["fallback"].get("aten::convolution_backward") == 1, r["fallback"]


def test_plane_kernels_match_cpu_and_serve_the_convolutions_they_should(torch_json):
    """Unit stride and dilation in 2-D (1-D as 2-D): a thin convolution computed directly,
    the others unfolded by a block per tile of output rows and folded by a block per
    whole planes; each case checked against the CPU, and by the kernels that ran."""
    r = torch_json(with_compare("""
        import runtime
        r = lambda *s, dt=torch.float32: torch.randn(*s, dtype=dt)
        cases = {
            # 9 rows: direct; 13 x 11 outputs, 6 batch elements a block; input gradient
            # folded with the padding cut off, weight gradient from unfolded columns
            "thin pad bias": (F.conv2d, r(6, 1, 13, 11), r(5, 1, 3, 3), r(5), dict(padding=1)),
            "thin groups even kernel": (F.conv2d, r(3, 4, 9, 10), r(6, 2, 2, 3), None,
                                        dict(groups=2, padding=(1, 0))),
            "thin odd batch, LeNet's first": (F.conv2d, r(7, 1, 28, 28), r(6, 1, 5, 5), r(6),
                                             dict(padding=2)),
            "thin 1d": (F.conv1d, r(3, 2, 50), r(4, 2, 5), r(4), dict(padding=2)),
            # 36 rows: a product; 40 x 40 outputs in two tiles of 20 rows, folded as before
            "product two row tiles": (F.conv2d, r(2, 4, 40, 40), r(4, 4, 3, 3), r(4),
                                      dict(padding=1)),
            "product LeNet's second": (F.conv2d, r(8, 6, 14, 14), r(16, 6, 5, 5), r(16), {}),
            "product float64 groups": (F.conv2d, r(4, 6, 7, 9, dt=torch.float64),
                                       r(4, 3, 5, 3, dt=torch.float64),
                                       r(4, dt=torch.float64), dict(groups=2, padding=(2, 0))),
            "product 1d": (F.conv1d, r(2, 8, 40), r(3, 8, 5), None, {}),
            "transposed": (F.conv_transpose2d, r(2, 4, 6, 6), r(4, 3, 3, 3), r(3), {}),
            "stride 2 (not theirs)": (F.conv2d, r(2, 3, 12, 12), r(4, 3, 3, 3), r(4),
                                      dict(stride=2, padding=1)),
        }
        names = {"conv_direct", "unfold_rows", "fold_rows", "unfold", "unfold_t", "fold"}
        gaps, ran = {}, {}
        for name, (fn, x, w, b, kw) in cases.items():
            with runtime.profile() as p:
                gaps[name] = compare(fn, x, w, b, **kw)
                torch.accel.synchronize()
            ran[name] = sorted({row.name for row in p.key_averages()} & names)
        report(gaps=gaps, ran=ran, fallback=dict(torch_accel.fallback_counts))
    """), timeout=500)
    for name, gaps in r["gaps"].items():
        for label, gap in gaps.items():
            assert gap < 1e-5, (name, label, gap)
    ran = r["ran"]
    for name in ("thin pad bias", "thin groups even kernel", "thin odd batch, LeNet's first",
                 "thin 1d"):
        assert ran[name] == ["conv_direct", "fold_rows", "unfold_rows"], (name, ran[name])
    assert ran["product two row tiles"] == ["fold", "unfold_rows"], ran
    for name in ("product LeNet's second", "product float64 groups", "product 1d"):
        assert ran[name] == ["fold_rows", "unfold_rows"], (name, ran[name])
    assert ran["transposed"] == ["conv_direct", "fold_rows", "unfold_rows"], ran
    assert ran["stride 2 (not theirs)"] == ["fold", "unfold"], ran  # columns kept
    assert r["fallback"] == {}, r["fallback"]


def test_kept_columns_live_from_forward_to_backward_and_follow_writes(torch_json):
    r = torch_json("""
        import torch.nn.functional as F
        from torch_accel.ops import conv as ops_conv
        torch.manual_seed(0)
        # 4 * 9 rows per group: a product (a thinner one is computed directly, unkept)
        w = torch.randn(8, 4, 3, 3, device="accel", requires_grad=True)
        x = torch.randn(16, 4, 30, 30, device="accel")
        kept = lambda: len(ops_conv._saved._by_input)
        sync, mem = torch.accel.synchronize, torch.accel.memory_allocated
        with torch.no_grad():
            F.conv2d(x, w)  # the backend's one-time buffers made before counting
        sync()
        base = mem()
        with torch.no_grad():
            F.conv2d(x, w)
        frozen = F.conv2d(x, w.detach())
        no_grad = (kept(), mem() - base - frozen.nbytes)
        del frozen
        out = F.conv2d(x, w)
        # the columns: 4 * 9 rows of 16 * 28 * 28, float32
        held = (kept(), mem() - base - out.nbytes)
        out.backward(torch.ones_like(out))
        after_backward = kept()
        del out
        w.grad = None
        del x
        sync()
        base = mem()
        x = torch.randn(16, 4, 30, 30, device="accel")
        out = F.conv2d(x, w)
        del out, x  # the graph and the input gone without a backward
        sync()
        after_input_died = (kept(), mem() - base)

        # an input written after its forward: the backward unfolds it again
        x = torch.randn(4, 4, 9, 9)
        dx, wc = x.to("accel"), w.detach().cpu()
        args = ([1, 1], [1, 1], [1, 1], False, [0, 0], 1)
        out = torch.ops.aten.convolution_overrideable(dx, w, None, *args)
        dx.mul_(-2.0)
        g = torch.linspace(-1, 1, out.numel()).reshape(out.shape)
        gw = torch.ops.aten.convolution_backward_overrideable(
            g.to("accel"), dx, w, *args, [False, True, False])[1]
        want = torch.ops.aten.convolution_backward(g, x * -2.0, wc, None, *args,
                                                   [False, True, False])[1]
        report(no_grad=no_grad, held=held, after_backward=after_backward,
               after_input_died=after_input_died, written_gap=(gw.cpu() - want).abs().max().item(),
               fallback=dict(torch_accel.fallback_counts))
    """, timeout=300)
    assert r["no_grad"] == [0, 0], r  # no gradient wanted, nothing kept
    assert r["held"] == [1, 4 * 9 * 16 * 28 * 28 * 4], r
    assert r["after_backward"] == 0 and r["after_input_died"] == [0, 0], r
    assert r["written_gap"] < 1e-4, r
    assert r["fallback"] == {}, r


def test_pooling_matches_cpu(torch_json):
    r = torch_json(with_compare("""
        x = torch.randn(2, 3, 9, 8)
        pools = lambda xs: torch.cat([
            F.max_pool2d(xs, 3, stride=2, padding=1).flatten(),
            F.max_pool2d(xs, (2, 3), stride=(2, 1), dilation=(2, 1), ceil_mode=True).flatten(),
            F.avg_pool2d(xs, 2).flatten(),
            F.avg_pool2d(xs, 3, stride=2, padding=1, count_include_pad=False).flatten(),
            F.avg_pool2d(xs, 3, stride=2, padding=1, ceil_mode=True).flatten(),
            F.avg_pool2d(xs, 2, divisor_override=3).flatten(),
            F.adaptive_avg_pool2d(xs, (4, 3)).flatten(), F.adaptive_max_pool2d(xs, 2).flatten(),
            F.adaptive_avg_pool2d(xs, (5, 11)).flatten(), F.adaptive_max_pool2d(xs, (3, 5)).flatten(),
            F.adaptive_max_pool2d(xs, (10, 3)).flatten(), F.adaptive_avg_pool2d(xs, (1, 2)).flatten(),
            F.adaptive_avg_pool2d(xs[0], 3).flatten(),
            # LeNet's 2x2 at stride 2 (the input's last row and column in no window), and
            # its partial last windows; windows sharing no row, with padding and with rows
            # between them, whose backwards write the gradient whole
            F.max_pool2d(xs, 2).flatten(), F.max_pool2d(xs, 2, ceil_mode=True).flatten(),
            F.max_pool2d(xs, (3, 2), stride=(3, 2), padding=1).flatten(),
            F.max_pool2d(xs, 2, stride=3).flatten(),
            # 2x2 windows tiling the input: the plane kernels both ways
            F.max_pool2d(xs[:, :, 1:, :], 2).flatten()])
        gaps = compare(pools, x)
        gaps64 = compare(lambda xs: F.max_pool2d(xs, 2) + F.avg_pool2d(xs, 2)
                         + F.adaptive_avg_pool2d(xs, 4) + F.adaptive_max_pool2d(xs, 4), x.double())
        idx = [F.max_pool2d(x.to(d), 3, 2, 1, return_indices=True)[1].cpu() for d in ("cpu", "accel")]
        # ties keep the first maximum, a NaN wins (the later of two): as the CPU
        xt = torch.randn(1, 4, 6, 8)  # 4 planes of 3 x 4 outputs: the plane kernel's
        xt[0, 0, :2, :2] = 1.0
        xt[0, 0, 2, 2:4] = float("nan")
        xt[0, 1, 3, 5] = float("nan")
        tidx = [F.max_pool2d(xt.to(d), 2, return_indices=True) for d in ("cpu", "accel")]
        same_2x2 = bool((tidx[0][1] == tidx[1][1].cpu()).all()) and bool(
            torch.equal(tidx[0][0].isnan(), tidx[1][0].cpu().isnan()))
        aidx = [F.adaptive_max_pool2d(x.to(d), (4, 3), return_indices=True)[1].cpu()
                for d in ("cpu", "accel")]
        import runtime
        with runtime.profile() as p:
            x8 = x[:, :, 1:, :].to("accel").requires_grad_()
            F.max_pool2d(x8, 2).sum().backward()
            torch.accel.synchronize()
        plane = sorted(r.name for r in p.key_averages() if "max" in r.name)
        report(plane=plane, gaps=gaps, gaps64=gaps64, same_indices=bool((idx[0] == idx[1]).all()),
               same_adaptive_indices=bool((aidx[0] == aidx[1]).all()), same_2x2=same_2x2,
               fallback=dict(torch_accel.fallback_counts))
    """), timeout=500)
    assert r["same_indices"] and r["same_adaptive_indices"] and r["same_2x2"], r
    assert r["plane"] == ["max2x2_back_plane", "max2x2_plane"], r["plane"]
    for label, gap in {**r["gaps"], **r["gaps64"]}.items():
        assert gap < 1e-6, (label, gap)
    # max, average and adaptive pooling all ran on the device
    assert not any("pool" in k for k in r["fallback"]), r["fallback"]


def test_small_cnn_trains_three_sgd_steps_like_cpu(torch_json):
    r = torch_json("""
        import copy
        import torch.nn as nn, torch.nn.functional as F
        torch.manual_seed(0)
        ref = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                            nn.MaxPool2d(2), nn.Conv2d(8, 8, 3, groups=2), nn.ReLU(),
                            nn.Flatten(), nn.Linear(8 * 2 * 2, 5))
        x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 5, (4,))
        cpu, acc = copy.deepcopy(ref), copy.deepcopy(ref).to("accel")
        oc = torch.optim.SGD(cpu.parameters(), lr=0.1, momentum=0.9)
        oa = torch.optim.SGD(acc.parameters(), lr=0.1, momentum=0.9)
        losses = []
        for step in range(3):
            for model, opt, xs, ys in ((cpu, oc, x, y), (acc, oa, x.to("accel"), y.to("accel"))):
                opt.zero_grad()
                loss = F.cross_entropy(model(xs), ys)
                loss.backward()
                opt.step()
                losses.append(loss.item())
        gaps = {n: (p.detach().cpu() - q.detach()).abs().max().item()
                for (n, p), q in zip(acc.named_parameters(), cpu.parameters())}
        bufs = {n: (p.cpu().float() - q.float()).abs().max().item()
                for (n, p), q in zip(acc.named_buffers(), cpu.buffers())}
        cpu.eval(), acc.eval()
        with torch.no_grad():  # eval: the running statistics normalise
            xe = torch.randn(3, 3, 8, 8)
            gaps["eval output"] = (acc(xe.to("accel")).cpu() - cpu(xe)).abs().max().item()
        report(gaps=gaps, bufs=bufs, losses=losses, tracked=acc[1].num_batches_tracked.item(),
               buffer_devices=sorted({str(b.device) for b in acc.buffers()}),
               conv_fallback=sum(v for k, v in torch_accel.fallback_counts.items() if "convolution" in k),
               norm_fallback={k: v for k, v in torch_accel.fallback_counts.items() if "norm" in k})
    """, timeout=500)
    assert r["conv_fallback"] == 0
    assert r["tracked"] == 3 and r["buffer_devices"] == ["accel:0"], r
    assert {"1.running_mean", "1.running_var", "1.num_batches_tracked"} <= set(r["bufs"]), r["bufs"]
    for name, gap in {**r["gaps"], **r["bufs"]}.items():
        assert gap < 1e-5, (name, gap, r["losses"])
    assert r["norm_fallback"] == {}, r["norm_fallback"]  # batch norm ran on the device
