"""Random-number generators (OpenReg's test_rng): accel generators, their seeds and
(seed, offset) state, the default generators behind torch.accel's seeding functions and
torch.manual_seed. Sampling reproducibility belongs to the random kernels' own tests."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(120)


def test_generator_seed_offset_and_state(torch_run):
    lines = torch_run("""
        g = torch.Generator(device="accel:1")
        print(g.device, torch.Generator(device="accel").device)
        print(g.manual_seed(42) is g, g.initial_seed())
        same = torch.Generator(device="accel").manual_seed(42)
        print(g.get_state().equal(same.get_state()))
        state = g.get_state()
        print(state.dtype, state.device, state.numel(), state[:8].tolist())
        g.set_offset(64)
        print(g.get_offset(), int.from_bytes(bytes(g.get_state()[8:].tolist()), "little"),
              g.get_state().equal(same.get_state()))
        fresh = torch.Generator(device="accel")
        fresh.set_state(g.get_state())
        print(fresh.initial_seed(), fresh.get_offset())
        g.manual_seed(42)
        print(g.get_offset())                      # a new seed starts at offset 0
        print(torch.Generator(device="accel").seed() != torch.Generator(device="accel").seed())
        try:
            g.set_state(torch.zeros(3, dtype=torch.uint8))
        except RuntimeError as e:
            print("RNG state must be a CPU torch.ByteTensor of 16 bytes" in str(e))
    """)
    assert lines == ["accel:1 accel:0", "True 42", "True",
                     "torch.uint8 cpu 16 [42, 0, 0, 0, 0, 0, 0, 0]", "64 64 False", "42 64", "0",
                     "True", "True"]


def test_seeding_functions_reach_every_default_generator(torch_run):
    lines = torch_run("""
        acc = torch.accel
        seeds = lambda: [acc.default_generator(i).initial_seed() for i in range(acc.device_count())]
        acc.manual_seed_all(42)
        print(seeds(), acc.initial_seed())
        acc.manual_seed(7)
        print(seeds())                             # the current device's only
        torch.manual_seed(123)                     # torch's seed reaches accel too
        print(seeds(), acc.initial_seed())
        with acc.device(1):
            acc.manual_seed(5)
            print(acc.initial_seed(), acc.get_rng_state()[0].item())
        saved = acc.get_rng_state(0)
        acc.manual_seed(9)
        acc.set_rng_state(saved, 0)
        print(acc.initial_seed())
        states = acc.get_rng_state_all()
        acc.manual_seed_all(1)
        acc.set_rng_state_all(states)
        print(seeds())
        with torch.random.fork_rng(device_type="accel"):
            acc.manual_seed(99)
        print(acc.initial_seed())
        acc.seed_all()
        first = seeds()
        acc.seed_all()
        print(first[0] == first[1], first != seeds())
        acc.seed()
        print(acc.initial_seed() != seeds()[1])
    """)
    assert lines == ["[42, 42] 42", "[7, 42]", "[123, 123] 123", "5 5", "123", "[123, 5]", "123",
                     "True True", "True"]


def test_device_sampling_is_reproducible_per_seed_and_state(torch_run):
    """``rand``/``randn``/``bernoulli_``/dropout draw on the device from the counter-based
    generator: the same seed (or a restored state) gives the same numbers, another seed
    others, a draw moves the generator's offset by the counters it used, and the values
    have the distribution asked for."""
    lines = torch_run("""
        import torch.nn.functional as F
        def draws():
            return [torch.rand(1000, device="accel").cpu(), torch.randn(777, dtype=torch.float64, device="accel").cpu(),
                    torch.empty(500, device="accel").bernoulli_(0.25).cpu(),
                    F.dropout(torch.ones(600, device="accel"), 0.5, training=True).cpu()]
        torch.accel.manual_seed(7); a = draws()
        torch.accel.manual_seed(7); b = draws()
        torch.accel.manual_seed(8); c = draws()
        print(all(torch.equal(x, y) for x, y in zip(a, b)), any(torch.equal(x, y) for x, y in zip(a, c)))
        g = torch.accel.default_generator()
        state = g.get_state(); first = torch.rand(64, device="accel").cpu()
        print(g.get_offset() - int.from_bytes(bytes(state[8:].tolist()), "little"))  # 64 floats: 16 counters
        g.set_state(state); print(torch.equal(torch.rand(64, device="accel").cpu(), first))
        own = torch.Generator(device="accel").manual_seed(7)
        print(torch.equal(torch.rand(1000, device="accel", generator=own).cpu(), a[0]))
        u, n, m, d = (x.double() for x in a)
        print(0 <= u.min().item() and u.max().item() < 1, abs(u.mean().item() - 0.5) < 0.05,
              abs(n.mean().item()) < 0.15, abs(n.std().item() - 1) < 0.1,
              abs(m.mean().item() - 0.25) < 0.06, set(d.unique().tolist()) == {0.0, 2.0})
        print(dict(torch_accel.fallback_counts))
    """)
    assert lines == ["True False", "16", "True", "True", "True True True True True True", "{}"]
