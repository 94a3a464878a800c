"""The PyTorch backend against torch's CPU device, same run (issue 15, item 10; issue 31,
Deliver 3: "PyTorch eager on accel is fast").

Each figure is the time on ``accel`` (including the synchronize that makes it complete)
against the same operation on torch's CPU device, in alternating blocks:

* a small operator (``x + y`` over 4 Ki float32) as a program issues them: ``OPS`` of them
  then one synchronize, against as many on the CPU (goal 10x);
* its host cost alone: the time to return from ``da + db``, without a synchronize, in
  bursts shorter than a queue's depth (goal: at most ``HOST_BUDGET_US``, a fixed budget,
  not a measured baseline; the CPU's same-run figure is in the row's details);
* ``mm`` 1024 x 1024 float32 (the matrix unit against torch's CPU BLAS; goal 1.3x);
* one training step of a small MLP (784-256-10, batch 64: forward, cross-entropy,
  backward, SGD step; goal 3x) and of a LeNet-size CNN (conv/relu/maxpool twice, three
  linear layers, batch 64 of 1x28x28; goal 5x), neither using the CPU fallback.

The device is emulated on these same CPUs, so "accel / CPU" is the price of the emulation
plus what the backend adds. docs/torch.md ("Where an eager op's time goes") breaks the
small operator's time down.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from bench.core import Env, Row, Samples, interleave, middle_half, timed_row

#: small operators per synchronize in the small-operator row
OPS = 100
#: the host cost of one small operator the issue allows, microseconds
HOST_BUDGET_US = 20.0


def torch_backend(env: Env) -> list[Row]:
    """Small operator, its host cost, 1024 mm, MLP and LeNet steps on accel against torch's
    CPU, same run."""
    with env.accel_root_env():
        import torch

        dev = torch.device("accel")
        sync = torch.accel.synchronize
        rounds = 3 if env.quick else 8
        a, b = torch.randn(4096), torch.randn(4096)
        da, db = a.to(dev), b.to(dev)

        def accel_ops() -> None:
            for _ in range(OPS):
                da + db
            sync()

        def cpu_ops() -> None:
            for _ in range(OPS):
                a + b

        rows = [_pair(f"add, 4 Ki float32, {OPS} ops then synchronize", accel_ops, cpu_ops,
                      f"torch CPU a + b, {OPS} ops", rounds, 5, goal=10.0),
                _host_cost(lambda: da + db, lambda: a + b, sync, rounds)]
        m1, m2 = torch.randn(1024, 1024), torch.randn(1024, 1024)
        d1, d2 = m1.to(dev), m2.to(dev)
        if not torch.allclose((d1 @ d2).cpu(), m1 @ m2, rtol=1e-4, atol=1e-3):
            raise RuntimeError("accel mm disagrees with the CPU's")
        rows.append(_pair("mm 1024 x 1024 float32", lambda: (d1 @ d2, sync()),
                          lambda: m1 @ m2, "torch CPU mm", rounds, 2, goal=1.3))
        rows.append(_training("MLP 784-256-10 training step, batch 64", _mlp, (64, 784),
                              rounds, goal=3.0))
        rows.append(_training("LeNet CNN training step, batch 64 of 1x28x28", _lenet,
                              (64, 1, 28, 28), rounds, goal=5.0))
    return rows


def _mlp() -> Any:
    import torch.nn as nn

    return nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 10))


def _lenet() -> Any:
    import torch.nn as nn

    return nn.Sequential(
        nn.Conv2d(1, 6, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
        nn.Linear(400, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, 10))


def _training(name: str, make: Callable[[], Any], shape: tuple[int, ...], rounds: int,
              goal: float) -> Row:
    """One SGD step (forward, cross-entropy, backward, step) of ``make()``'s model on accel
    against the same model and batch on the CPU; refused if accel used the CPU fallback."""
    import torch
    import torch.nn.functional as F

    import torch_accel

    dev = torch.device("accel")
    torch.manual_seed(0)
    cpu, acc = make(), make().to(dev)
    acc.load_state_dict(cpu.state_dict())
    oc = torch.optim.SGD(cpu.parameters(), lr=0.01)
    oa = torch.optim.SGD(acc.parameters(), lr=0.01)
    x, y = torch.randn(*shape), torch.randint(0, 10, (shape[0],))
    dx, dy = x.to(dev), y.to(dev)

    def step(model: Any, opt: Any, xs: Any, ys: Any) -> None:
        opt.zero_grad()
        F.cross_entropy(model(xs), ys).backward()
        opt.step()

    before = sum(torch_accel.fallback_counts.values())
    row = _pair(name, lambda: (step(acc, oa, dx, dy), torch.accel.synchronize()),
                lambda: step(cpu, oc, x, y), "torch CPU training step", rounds, 3, goal=goal)
    if sum(torch_accel.fallback_counts.values()) != before:
        raise RuntimeError(f"{name} used the CPU fallback: {torch_accel.fallback_counts}")
    return row


def _host_cost(device: Callable[[], object], host: Callable[[], object],
               sync: Callable[[], None], rounds: int, burst: int = 100) -> Row:
    """The host time of one small operator: mean per call over bursts of ``burst`` (each
    then synchronised, untimed), so that no call waits for the device to make room."""
    got = {name: Samples(name) for name in ("accel", "cpu")}
    for _ in range(3):
        device()
    sync()
    for r in range(rounds * 5):
        for name, fn in (("accel", device), ("cpu", host)) if r % 2 == 0 else \
                (("cpu", host), ("accel", device)):
            t0 = time.perf_counter_ns()
            for _ in range(burst):
                fn()
            mean = (time.perf_counter_ns() - t0) // burst
            sync()
            got[name].ns.append(mean)
            got[name].block_medians.append(mean)
    acc, cpu = got["accel"], got["cpu"]
    return Row("add, 4 Ki float32, host time to return (no synchronize)", acc.median_us,
               f"the issue's budget ({HOST_BUDGET_US:g} us, fixed)", HOST_BUDGET_US, "us", 1.0,
               middle_half([v / 1e3 / HOST_BUDGET_US for v in acc.ns]),
               note=f"mean per call in bursts of {burst}, median of {len(acc.ns)} bursts; "
                    f"torch CPU a + b {cpu.median_us:.2f} us in the same run "
                    f"({acc.median_us / cpu.median_us:.0f}x)",
               details={"measured": acc.summary(), "cpu": cpu.summary(),
                        "cpu_ratio": acc.median_us / cpu.median_us})


def _pair(name: str, device: Callable[[], object], host: Callable[[], object], baseline: str,
          rounds: int, block: int, goal: float) -> Row:
    for _ in range(2):  # warm: kernels compiled, allocator primed, plans made
        device()
        host()
    got = interleave({"accel": device, "cpu": host}, block=block, rounds=rounds, warmup=1)
    return timed_row(name, got["accel"], baseline, got["cpu"], goal=goal,
                     note="accel includes the synchronize")
