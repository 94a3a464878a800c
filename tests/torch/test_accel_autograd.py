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

