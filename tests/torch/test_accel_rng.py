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
