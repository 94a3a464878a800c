"""The PyTorch backend against torch's CPU device, same run (issue 15, item 10).

Each figure is the time on ``accel`` (including the synchronize that makes it complete)
against the same operation on torch's CPU device, in alternating blocks:

* a small operator (``x + y`` over 4 Ki float32): the per-operator cost a framework adds
  to a launch;
* ``mm`` 1024 x 1024 float32 (the matrix unit against torch's CPU BLAS);
* one training step of a small MLP (784-256-10, batch 64: forward, cross-entropy,
  backward, SGD step).

No goals: the issue asks for the figures. The device is emulated on these same CPUs, so
"accel / CPU" is the price of the emulation plus what the backend adds.
"""

from __future__ import annotations

from bench.core import Env, Row, interleave, timed_row


def torch_backend(env: Env) -> list[Row]:
    """Small operator, 1024 mm and an MLP step on accel against torch's CPU, same run."""
    with env.accel_root_env():
        import torch
        import torch.nn.functional as F

        import torch_accel

        def step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
                 y: torch.Tensor) -> None:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()

        dev = torch.device("accel")
        sync = torch.accel.synchronize
        rounds = 3 if env.quick else 8
        a, b = torch.randn(4096), torch.randn(4096)
        da, db = a.to(dev), b.to(dev)
        rows = [_pair("add, 4 Ki float32", lambda: (da + db, sync()), lambda: a + b,
                      "torch CPU a + b", rounds, 50)]
        m1, m2 = torch.randn(1024, 1024), torch.randn(1024, 1024)
        d1, d2 = m1.to(dev), m2.to(dev)
        if not torch.allclose((d1 @ d2).cpu(), m1 @ m2, rtol=1e-4, atol=1e-3):
            raise RuntimeError("accel mm disagrees with the CPU's")
        rows.append(_pair("mm 1024 x 1024 float32", lambda: (d1 @ d2, sync()),
                          lambda: m1 @ m2, "torch CPU mm", rounds, 2))
        torch.manual_seed(0)
        cpu = torch.nn.Sequential(torch.nn.Linear(784, 256), torch.nn.ReLU(),
                                  torch.nn.Linear(256, 10))
        acc = torch.nn.Sequential(torch.nn.Linear(784, 256), torch.nn.ReLU(),
                                  torch.nn.Linear(256, 10)).to(dev)
        acc.load_state_dict(cpu.state_dict())
        oc = torch.optim.SGD(cpu.parameters(), lr=0.01)
        oa = torch.optim.SGD(acc.parameters(), lr=0.01)
        x, y = torch.randn(64, 784), torch.randint(0, 10, (64,))
        dx, dy = x.to(dev), y.to(dev)
        before = sum(torch_accel.fallback_counts.values())
        rows.append(_pair("MLP 784-256-10 training step, batch 64",
                          lambda: (step(acc, oa, dx, dy), sync()),
                          lambda: step(cpu, oc, x, y), "torch CPU training step", rounds, 3))
        if sum(torch_accel.fallback_counts.values()) != before:
            raise RuntimeError(f"the MLP step used the CPU fallback: {torch_accel.fallback_counts}")
    return rows


def _pair(name: str, device: object, host: object, baseline: str, rounds: int,
          block: int) -> Row:
    for _ in range(2):  # warm: kernels compiled, allocator primed
        device()  # type: ignore[operator]
        host()  # type: ignore[operator]
    got = interleave({"accel": device, "cpu": host}, block=block, rounds=rounds, warmup=1)  # type: ignore[dict-item]
    return timed_row(name, got["accel"], baseline, got["cpu"], goal=None,
                     note="accel includes the synchronize")
