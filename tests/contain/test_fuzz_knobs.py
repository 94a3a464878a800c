"""CI run of the attribute fuzzer (stress/knob_fuzz.py): 4,000 writes with a fixed seed to
every writable attribute of a private 2-device daemon other users can reach, in rounds of
1,000 by separate client processes -- two as root, two as uid 65534 -- with a bystander
tenant on each device and the containment checks after every round (about 20-30 s on the
2-core machine; ``python -m stress`` makes 20,000). Every root write of a malformed value
must answer EINVAL, every harmless valid one succeed, every other user's write EACCES; the
daemon's log must hold no driver bug."""

from __future__ import annotations

import pytest

from stress import knob_fuzz


@pytest.mark.timeout(120)
def test_attribute_write_fuzz_is_contained(make_daemon):
    d = make_daemon(devices=2, tenants=True)
    rep = knob_fuzz.run(d, count=4_000, seed=1)
    print(rep.line())
    print("errnos:", rep.errnos)
    assert rep.ok, "\n".join([rep.line(), *rep.notes])
    assert rep.done == {"writes_root": 2_000, "writes_uid65534": 2_000}, rep.done
    assert set(rep.errnos) == {"EINVAL", "EACCES"}, rep.errnos
    assert rep.errnos["EACCES"] == 2_000
    # some of root's writes were the harmless valid values, and succeeded
    assert 0 < 2_000 - rep.errnos["EINVAL"] < 400, rep.errnos
