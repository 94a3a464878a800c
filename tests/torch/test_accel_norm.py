"""Batch norm on the device (ops/norm.py): ``nn.BatchNorm1d/2d/3d`` and ``F.batch_norm``
match the CPU in output, every gradient and the running statistics, in training and
evaluation, with and without affine parameters and running statistics; and they no longer
go through the CPU fallback (the CNN story end to end is test_accel_conv's)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(600)


def test_batch_norm_matches_cpu_in_training_and_evaluation(torch_json):
    r = torch_json("""
        import copy
        import torch.nn as nn
        torch.manual_seed(0)
        def compare(make, shape, dtype=torch.float32, steps=2):
            cpu = make().to(dtype)
            acc = copy.deepcopy(cpu).to("accel")
            gaps = {}
            for step in range(steps + 1):
                train = step < steps
                cpu.train(train), acc.train(train)
                x = torch.randn(shape, dtype=dtype) * 3 + 1
                xs = [x.clone().requires_grad_(), x.to("accel").requires_grad_()]
                outs = [cpu(xs[0]), acc(xs[1])]
                g = torch.randn(outs[0].shape, dtype=dtype)
                outs[0].backward(g), outs[1].backward(g.to("accel"))
                pairs = {"out": outs, "grad x": [t.grad for t in xs]}
                pairs.update({n: [p.grad, q.grad] for (n, p), q in zip(cpu.named_parameters(), acc.parameters())})
                pairs.update({n: [b, c] for (n, b), c in zip(cpu.named_buffers(), acc.buffers())})
                for n, (c, a) in pairs.items():
                    gap = (a.detach().cpu().double() - c.detach().double()).abs().max().item()
                    gaps[f"{n} {step}"] = max(gaps.get(f"{n} {step}", 0.0), gap / max(1.0, c.abs().max().item()))
                for m in (cpu, acc):
                    m.zero_grad()
            return max(gaps.values()), max(gaps, key=gaps.get)
        gaps = {
            "2d": compare(lambda: nn.BatchNorm2d(4), (5, 4, 6, 3)),
            "1d rows": compare(lambda: nn.BatchNorm1d(7), (9, 7)),
            "1d seq": compare(lambda: nn.BatchNorm1d(3, affine=False), (4, 3, 10)),
            "3d momentum": compare(lambda: nn.BatchNorm3d(2, momentum=0.3), (2, 2, 3, 4, 5)),
            "cumulative": compare(lambda: nn.BatchNorm2d(3, momentum=None), (4, 3, 5, 5), steps=3),
            "no running": compare(lambda: nn.BatchNorm2d(3, track_running_stats=False), (4, 3, 5, 5)),
            "float64": compare(lambda: nn.BatchNorm2d(4), (5, 4, 6, 3), torch.float64),
        }
        fallback = {k: v for k, v in torch_accel.fallback_counts.items() if "norm" in k}
        from torch.testing._internal.common_methods_invocations import op_db
        info, = [o for o in op_db if o.name == "nn.functional.batch_norm" and not o.variant_test_name]
        samples = list(info.sample_inputs("cpu", torch.float32))
        for s in samples:  # the running statistics are arguments: compare them after the call too
            d = s.transform(lambda t: t.to("accel") if isinstance(t, torch.Tensor) else t)
            got, ref = info(d.input, *d.args, **d.kwargs), info(s.input, *s.args, **s.kwargs)
            to_cpu = lambda t: t.cpu() if isinstance(t, torch.Tensor) else t
            torch.testing.assert_close([to_cpu(t) for t in (got, *d.args)], [ref, *s.args])
        report(gaps=gaps, fallback=fallback, opinfo_samples=len(samples))
    """)
    for label, (gap, where) in r["gaps"].items():
        assert gap < 1e-5, (label, where, gap)
    assert r["fallback"] == {}, r["fallback"]
    assert r["opinfo_samples"] >= 5, r  # torch's OpInfo samples of F.batch_norm, float32


def test_batch_norm_is_captured_by_a_graph(torch_run):
    """On the device, batch norm queues only device work, so a graph captures it (the CPU
    fallback needs the host, which a capture refuses): a replay gives the eager output and
    moves the running statistics as the eager step does."""
    lines = torch_run("""
        import copy
        torch.manual_seed(0)
        bn = torch.nn.BatchNorm2d(3).to("accel")
        eager = copy.deepcopy(bn)
        x = torch.randn(4, 3, 5, 5, device="accel")
        g = torch.accel.AccelGraph()
        with torch.accel.graph(g):
            y = bn(x)
        g.replay()
        ref = eager(x)  # a capture queues nothing: the replay is the one step
        print(torch.allclose(y.cpu(), ref.cpu(), atol=1e-6),
              torch.allclose(bn.running_mean.cpu(), eager.running_mean.cpu(), atol=1e-6),
              torch.allclose(bn.running_var.cpu(), eager.running_var.cpu(), atol=1e-6),
              bn.num_batches_tracked.item(), dict(torch_accel.fallback_counts))
    """)
    assert lines == ["True True True 1 {}"]
