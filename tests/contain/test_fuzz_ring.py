"""CI run of the ring fuzzer (stress/ring_fuzz.py): about 3,000 random and mutated packets
with a fixed seed (rounds of 1,000, containment checked after each), written straight into
a client's own rings, against a private 2-device daemon with a bystander tenant on each
device. ``python -m stress`` runs it long (100,000). With seed 1 each round writes into
about 100 rings (290 in all since the ring file grew by its compile-wait words, 330-480
before: the seed's path follows every size and address the fuzzer draws from, so a layout
change moves it) and gets both EINVAL and EFAULT fault records; the first round's warm-up
compiles the fuzzer's kernels (once per JIT cache) and is most of the time."""

from __future__ import annotations

import pytest

from stress import ring_fuzz


@pytest.mark.timeout(300)
def test_ring_fuzz_is_contained(make_daemon):
    d = make_daemon(devices=2)
    rep = ring_fuzz.run(d, count=3_000, seed=1)
    print(rep.line())
    print("fault records and errnos:", dict(sorted(rep.errnos.items(), key=lambda kv: -kv[1])))
    assert rep.ok, "\n".join([rep.line(), *rep.notes])
    assert rep.done["packets"] >= 3_000 and rep.done["rings"] >= 250, rep.done
    assert rep.errnos.get("EINVAL") and rep.errnos.get("EFAULT"), rep.errnos
