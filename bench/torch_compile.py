"""torch.compile on accel (issue 32, item 4): Inductor's generated kernels against eager.

Same-run rows, alternating blocks:

* a chain of 8 arithmetic pointwise ops on 1 Mi float32, compiled (one fused kernel: one
  read, one write) against the same chain eager on accel (8 launches, 8 intermediate
  buffers); goal 0.3x;
* the compiled chain on accel against the same chain compiled by torch's CPU Inductor
  (C++, on the CPUs that also emulate the device): reported, no goal;
* a chain of 8 ops of which three are transcendental (exp, sqrt, tanh), compiled against
  eager: reported, no goal. The emulated device computes those with numba's scalar libm
  calls (a 1 Mi ``tanh`` alone costs ten times a 1 Mi multiply), so such a chain is bound
  by those calls, which fusion keeps, not by the memory passes and launches it removes;
* one MLP training step (784-256-10, batch 64, forward, cross entropy, backward, SGD)
  compiled whole, as a training loop uses torch.compile: the step function (``zero_grad``,
  forward, loss, ``backward()``, ``opt.step()``) under ``torch.compile``. Dynamo breaks
  the graph at ``zero_grad`` and ``backward()``, so the forward with the loss is one
  compiled graph, its backward (the loss's included) AOTAutograd's compiled backward, and
  the optimizer's update a third graph. Against eager on accel; goal 1x. The first
  compiled step's time (Dynamo, AOTAutograd, Inductor, the firmware's JIT of each new
  kernel) is in the row's note;
* the same step with only the model compiled (``torch.compile(model)``: the loss, its
  backward and SGD eager), against the same eager step: reported, no goal (the row's
  goal until the whole step was measured; kept so that runs stay comparable).

Each accel case includes the synchronize that makes it complete.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from bench.core import Env, Row, interleave, timed_row

#: elements of the pointwise chain
N = 1 << 20


def chain(a: Any) -> Any:
    """Eight arithmetic pointwise ops (mul, add, relu, sub, mul, clamp_max, add, abs)."""
    return ((((a * 1.5 + 0.25).relu() - 0.5) * 0.75).clamp(max=2.0) + a).abs()


def transcendental_chain(a: Any) -> Any:
    """Eight pointwise ops, three of them transcendental (mul, add, relu, sub, exp, mul,
    sqrt, tanh of a sum)."""
    return ((((a * 1.5 + 0.25).relu() - 0.5).exp() * 0.75).sqrt() + a).tanh()


def torch_compile(env: Env) -> list[Row]:
    """The 8-op chains compiled vs eager on accel and vs CPU Inductor; the MLP step."""
    with env.accel_root_env():
        import torch

        rounds = 3 if env.quick else 8
        sync = torch.accel.synchronize
        host = torch.randn(N)
        dev = host.to("accel")
        compiled = torch.compile(chain)
        compiled_cpu = torch.compile(chain)
        if not torch.allclose(compiled(dev).cpu(), chain(host), rtol=1e-5, atol=1e-6):
            raise RuntimeError("compiled accel chain disagrees with the CPU's")
        compiled_cpu(host)
        got = _interleaved({"compiled": lambda: (compiled(dev), sync()),
                            "eager": lambda: (chain(dev), sync()),
                            "cpu_inductor": lambda: compiled_cpu(host)}, rounds)
        rows = [timed_row("8 pointwise ops, 1 Mi float32, torch.compile on accel",
                          got["compiled"], "eager accel, same chain", got["eager"], goal=0.3,
                          note="accel includes the synchronize; one fused generated kernel "
                               "against 8 eager launches"),
                timed_row("8 pointwise ops, 1 Mi float32, torch.compile on accel vs CPU",
                          got["compiled"], "torch CPU Inductor, same chain",
                          got["cpu_inductor"], goal=None,
                          note="reported, no goal: the device is emulated on these CPUs")]
        heavy = torch.compile(transcendental_chain)
        heavy(dev)
        got = _interleaved({"compiled": lambda: (heavy(dev), sync()),
                            "eager": lambda: (transcendental_chain(dev), sync())}, rounds)
        rows.append(timed_row("8 pointwise ops with exp/sqrt/tanh, 1 Mi float32, "
                              "torch.compile on accel", got["compiled"],
                              "eager accel, same chain", got["eager"], goal=None,
                              note="reported, no goal: bound by the libm calls"))
        rows += _mlp_step(rounds)
    return rows


def _interleaved(cases: dict[str, Callable[[], object]], rounds: int) -> dict[str, Any]:
    for fn in cases.values():  # warm: kernels compiled, allocator primed, plans made
        fn()
        fn()
    return interleave(cases, block=5, rounds=rounds, warmup=1)


def _mlp_step(rounds: int) -> list[Row]:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    def make() -> Any:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 10)).to("accel")

    x = torch.randn(64, 784, device="accel")
    y = torch.randint(0, 10, (64,), device="accel")

    def step(model: Any, compile_model: bool = False) -> Callable[[], None]:
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        run = torch.compile(model) if compile_model else model

        def one() -> None:
            opt.zero_grad()
            F.cross_entropy(run(x), y).backward()
            opt.step()
        return one

    cases: dict[str, Callable[[], None]] = {}
    firsts: dict[str, float] = {}
    for name, fn in (("eager", step(make())),
                     ("compiled", torch.compile(step(make()))),
                     ("compiled_model", step(make(), compile_model=True))):
        def synced(fn: Callable[[], None] = fn) -> None:
            fn()
            torch.accel.synchronize()
        t0 = time.perf_counter()
        synced()
        firsts[name] = time.perf_counter() - t0
        cases[name] = synced
    got = _interleaved(cases, rounds)
    return [timed_row("MLP 784-256-10 training step, batch 64, whole step torch.compile "
                      "on accel", got["compiled"], "eager accel training step", got["eager"],
                      goal=1.0,
                      note=f"forward, loss, backward and SGD compiled; first compiled step "
                           f"(compile + JIT) {firsts['compiled']:.1f} s in this run; accel "
                           "includes the synchronize",
                      first_step_s=round(firsts["compiled"], 2)),
            timed_row("MLP 784-256-10 training step, batch 64, torch.compile on accel",
                      got["compiled_model"], "eager accel training step", got["eager"],
                      goal=None,
                      note="reported, no goal: only the model compiled (loss, backward's "
                           "seed and SGD eager); first compiled step "
                           f"{firsts['compiled_model']:.1f} s in this run",
                      first_step_s=round(firsts["compiled_model"], 2))]
