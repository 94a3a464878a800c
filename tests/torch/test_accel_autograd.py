"""Autograd and training on the device: an MLP's forward and backward on ``accel:0`` and
``accel:1`` match the CPU's, and SGD and Adam steps run on the device (their arithmetic
native: no fallback) and match the CPU's updates."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(400)


def test_mlp_forward_backward_and_optimiser_steps_match_cpu_on_both_devices(torch_json):
    r = torch_json("""
        import copy
        import torch.nn.functional as F
        torch.manual_seed(0)
        x, y = torch.randn(16, 12), torch.randint(0, 4, (16,))
        ref = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.GELU(), torch.nn.Linear(32, 32),
                                  torch.nn.ReLU(), torch.nn.Linear(32, 4))
        for dev in ("accel:0", "accel:1"):
            for opt_cls in (torch.optim.SGD, torch.optim.Adam):
                cpu, acc = copy.deepcopy(ref), copy.deepcopy(ref).to(dev)
                oc, oa = opt_cls(cpu.parameters(), lr=0.01), opt_cls(acc.parameters(), lr=0.01)
                before = dict(torch_accel.fallback_counts)
                for step in range(3):
                    for model, opt, xs, ys in ((cpu, oc, x, y), (acc, oa, x.to(dev), y.to(dev))):
                        opt.zero_grad()
                        loss = F.cross_entropy(model(xs), ys)
                        loss.backward()
                        opt.step()
                apart = lambda a, b: (~torch.isclose(a, b, atol=1e-5)).sum().item()
                gap = lambda a, b: (a - b).abs().max().item()
                loss = (F.cross_entropy(acc(x.to(dev)), y.to(dev)).detach().cpu(),
                        F.cross_entropy(cpu(x), y).detach())
                params = [(p.detach().cpu(), q.detach()) for p, q in zip(acc.parameters(), cpu.parameters())]
                now = dict(torch_accel.fallback_counts)
                report(**{f"{dev} {opt_cls.__name__}": {
                    "loss_apart": apart(*loss), "loss_gap": gap(*loss),
                    "params_apart": sum(apart(p, q) for p, q in params),
                    "params_gap": max(gap(p, q) for p, q in params),
                    "devices": sorted({str(t.device) for p in acc.parameters() for t in (p, p.grad)}),
                    "fallbacks": {k: [before.get(k), now.get(k)] for k in {*before, *now}
                                  if before.get(k) != now.get(k)}}})
    """, timeout=380)
    # elements torch.allclose finds apart (with the widest gap), the devices of the
    # parameters and their gradients, and the fallback counts that moved
    assert sorted(r) == sorted(f"{d} {o}" for d in ("accel:0", "accel:1") for o in ("SGD", "Adam"))
    for run, got in r.items():
        assert got["loss_apart"] == 0 and got["params_apart"] == 0, (run, got)
        assert got["devices"] == [run.split()[0]] and got["fallbacks"] == {}, (run, got)



@pytest.mark.timeout(200)
def test_nll_loss_forward_total_weight_matches_cpu(torch_json):
    """``aten::nll_loss_forward`` returns (loss, total_weight); the total (the count of
    targets not ignored; 0 for a batch with reduction none, but not for one sample) comes
    from the loss's own launch: as the CPU's, ignored targets included, for 1-D and 2-D
    inputs. (Before, it was 0 for one sample with reduction none.)"""
    r = torch_json("""
        torch.manual_seed(0)
        out = {}
        for shape, target in (((6, 5), [1, -100, 4, 0, -100, 2]), ((5,), [3]), ((5,), [-100]), ((3, 4), [-100] * 3)):
            logp = torch.randn(*shape).log_softmax(-1)
            tg = torch.tensor(target if len(shape) == 2 else target[0])
            for red in (0, 1, 2):
                cpu = torch.ops.aten.nll_loss_forward(logp, tg, None, red, -100)
                acc = torch.ops.aten.nll_loss_forward(logp.to("accel"), tg.to("accel"), None, red, -100)
                out[f"{shape} {red}"] = [[c.tolist(), a.cpu().tolist(), a.dtype == c.dtype, a.shape == c.shape]
                                         for c, a in zip(cpu, acc)]
        report(**out)
    """)
    for case, pairs in r.items():
        for cpu, acc, same_dtype, same_shape in pairs:
            assert same_dtype and same_shape, case
            assert torch_close(cpu, acc), (case, cpu, acc)


def torch_close(a, b) -> bool:
    """Lists of floats equal within float32 rounding (NaN equal to NaN)."""
    import math

    if isinstance(a, list):
        return len(a) == len(b) and all(torch_close(x, y) for x, y in zip(a, b))
    return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6)


@pytest.mark.timeout(200)
def test_an_mlp_training_step_makes_one_launch_per_operator(torch_json):
    """An SGD step of an MLP (784-256-10, batch 64) queues 18 kernels: two products and
    relu forward, log_softmax and nll_loss; the gradient's seed (``ones_like``), the loss's
    backward in one launch (its rows zeroed by the kernel that writes them, not by a fill
    before it), log_softmax's and relu's backwards, three products and two bias sums; one
    add per parameter. A launch more (a fill, a copy) is a regression of the step's device
    and host time (docs/torch.md, "An MLP step, third pass")."""
    r = torch_json("""
        import collections
        import torch.nn.functional as F
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(784, 256), torch.nn.ReLU(),
                                    torch.nn.Linear(256, 10)).to("accel")
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x, y = torch.randn(64, 784, device="accel"), torch.randint(0, 10, (64,)).to("accel")
        def step():
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        step()
        torch.accel.synchronize()
        with runtime.profile() as p:
            step()
            torch.accel.synchronize()
        report(kernels=collections.Counter(e.name for e in p.device_events),
               fallbacks=dict(torch_accel.fallback_counts))
    """)
    assert r["kernels"] == {"mm": 5, "axpy_f": 4, "finish": 2, "unary_hot_f": 1,
                            "softmax_short": 1, "nll_loss": 1, "arange": 1,
                            "nll_loss_backward": 1, "softmax_backward_short": 1,
                            "activation_backward_hot": 1}, r
    assert r["fallbacks"] == {}, r
