"""Random-number generators (OpenReg's test_rng): accel generators, their seeds and
(seed, offset) state, the default generators behind torch.accel's seeding functions and
torch.manual_seed. Sampling reproducibility belongs to the random kernels' own tests."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(120)


def test_generator_seed_offset_and_state(torch_json):
    r = torch_json("""
        g = torch.Generator(device="accel:1")
        report(devices=[g.device, torch.Generator(device="accel").device])
        report(returns_itself=g.manual_seed(42) is g, seed=g.initial_seed())
        same = torch.Generator(device="accel").manual_seed(42)
        report(state_42=g.get_state(), other_state_42=same.get_state())
        state = g.get_state()
        report(state=[state.dtype, state.device, state.numel()])
        g.set_offset(64)
        report(offset=g.get_offset(), offset_in_state=int.from_bytes(bytes(g.get_state()[8:].tolist()), "little"),
               state_at_64=g.get_state())
        fresh = torch.Generator(device="accel")
        fresh.set_state(g.get_state())
        report(fresh=[fresh.initial_seed(), fresh.get_offset()])
        g.manual_seed(42)
        report(reseeded_offset=g.get_offset())     # a new seed starts at offset 0
        report(two_seeds=[torch.Generator(device="accel").seed(), torch.Generator(device="accel").seed()])
        try:
            g.set_state(torch.zeros(3, dtype=torch.uint8))
            report(bad_state="accepted")
        except RuntimeError as e:
            report(bad_state=str(e))
    """)
    assert r["devices"] == ["accel:1", "accel:0"], r
    assert r["returns_itself"] is True and r["seed"] == 42, r
    assert r["state_42"] == r["other_state_42"], r
    assert r["state"] == ["torch.uint8", "cpu", 16] and r["state_42"][:8] == [42] + [0] * 7, r
    assert r["offset"] == r["offset_in_state"] == 64, r
    assert r["state_at_64"] != r["other_state_42"], r
    assert r["fresh"] == [42, 64] and r["reseeded_offset"] == 0, r
    assert r["two_seeds"][0] != r["two_seeds"][1], r
    assert "RNG state must be a CPU torch.ByteTensor of 16 bytes" in r["bad_state"], r


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
        print("seed_all", *first, *seeds())
        acc.seed()
        print("seed", acc.initial_seed(), seeds()[1])
    """)
    assert lines[:7] == ["[42, 42] 42", "[7, 42]", "[123, 123] 123", "5 5", "123", "[123, 5]",
                         "123"], lines
    first, again = lines[7].split()[1:3], lines[7].split()[3:]
    # one random seed for every device, another at each call
    assert lines[7].startswith("seed_all ") and first[0] == first[1] and first != again, lines

    current, other = lines[8].split()[1:]
    assert lines[8].startswith("seed ") and current != other, lines  # the current device's only


def test_device_sampling_is_reproducible_per_seed_and_state(torch_json):

    """``rand``/``randn``/``bernoulli_``/dropout draw on the device from the counter-based
    generator: the same seed (or a restored state) gives the same numbers, another seed
    others, a draw moves the generator's offset by the counters it used, and the values
    have the distribution asked for."""
    r = torch_json("""
        import torch.nn.functional as F
        def draws():
            return [torch.rand(1000, device="accel").cpu(), torch.randn(777, dtype=torch.float64, device="accel").cpu(),
                    torch.empty(500, device="accel").bernoulli_(0.25).cpu(),
                    F.dropout(torch.ones(600, device="accel"), 0.5, training=True).cpu()]
        torch.accel.manual_seed(7); a = draws()
        torch.accel.manual_seed(7); b = draws()
        torch.accel.manual_seed(8); c = draws()
        differ = lambda xs, ys: [int((x != y).sum()) for x, y in zip(xs, ys)]
        report(same_seed_differ=differ(a, b), other_seed_differ=differ(a, c))
        g = torch.accel.default_generator()
        state = g.get_state(); first = torch.rand(64, device="accel").cpu()
        report(offset_moved=g.get_offset() - int.from_bytes(bytes(state[8:].tolist()), "little"))
        g.set_state(state)
        report(restored_differ=differ([torch.rand(64, device="accel").cpu()], [first]))
        own = torch.Generator(device="accel").manual_seed(7)
        report(own_differ=differ([torch.rand(1000, device="accel", generator=own).cpu()], a[:1]))
        u, n, m, d = (x.double() for x in a)
        report(uniform=[u.min().item(), u.max().item(), u.mean().item()],
               normal=[n.mean().item(), n.std().item()], bernoulli_mean=m.mean().item(),
               dropout_values=d.unique().tolist(), fallbacks=dict(torch_accel.fallback_counts))
    """)
    # the same seed draws the same numbers, another seed others
    assert r["same_seed_differ"] == [0, 0, 0, 0] and 0 not in r["other_seed_differ"], r
    assert r["offset_moved"] == 16, r  # 64 floats: 16 counters
    assert r["restored_differ"] == [0] and r["own_differ"] == [0], r
    low, high, mean = r["uniform"]
    assert 0 <= low and high < 1 and abs(mean - 0.5) < 0.05, r
    assert abs(r["normal"][0]) < 0.15 and abs(r["normal"][1] - 1) < 0.1, r
    assert abs(r["bernoulli_mean"] - 0.25) < 0.06 and set(r["dropout_values"]) == {0.0, 2.0}, r
    assert r["fallbacks"] == {}, r
