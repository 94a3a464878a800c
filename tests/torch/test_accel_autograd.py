"""Autograd and training on the device: an MLP's forward and backward on ``accel:0`` and
``accel:1`` match the CPU's, and SGD and Adam steps run on the device (their arithmetic
native: no fallback) and match the CPU's updates."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(400)


def test_mlp_forward_backward_and_optimiser_steps_match_cpu_on_both_devices(torch_run):
    lines = torch_run("""
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
                same_loss = torch.allclose(F.cross_entropy(acc(x.to(dev)), y.to(dev)).cpu(),
                                           F.cross_entropy(cpu(x), y), atol=1e-5)
                same_params = all(torch.allclose(p.cpu(), q, atol=1e-5)
                                  for p, q in zip(acc.parameters(), cpu.parameters()))
                on_device = all(p.device == torch.device(dev) and p.grad.device == torch.device(dev)
                                for p in acc.parameters())
                print(dev, opt_cls.__name__, same_loss, same_params, on_device,
                      dict(torch_accel.fallback_counts) == before)
    """, timeout=380)
    assert lines == [f"{d} {o} True True True True" for d in ("accel:0", "accel:1")
                     for o in ("SGD", "Adam")]
