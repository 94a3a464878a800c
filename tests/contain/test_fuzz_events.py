"""CI runs of the event-node and fault-log attackers (stress/events_flood.py,
stress/fault_flood.py): one short round each against a private 2-device daemon other users
can reach, bystanders on both devices. ``python -m stress`` runs them long (30 rounds; 20,000
faults)."""

from __future__ import annotations

import pytest

from stress import events_flood, fault_flood


def _check(rep) -> None:
    print(rep.line())
    print("errnos:", rep.errnos, "notes:", rep.notes)
    assert rep.ok, "\n".join([rep.line(), *rep.notes])


@pytest.mark.timeout(120)
def test_event_node_flood_is_contained(make_daemon):
    d = make_daemon(devices=2, tenants=True)
    rep = events_flood.run(d, count=1, seed=1, threads=100, seconds=6.0)
    _check(rep)
    # it reached each bound and each refusal, not only the first
    assert rep.done["rounds"] == 1 and rep.done["round trips"] > 200, rep.done
    for name in ("EDQUOT", "ESPIPE", "EINVAL", "EAGAIN"):
        assert rep.errnos.get(name), (name, rep.errnos)


@pytest.mark.timeout(120)
def test_fault_flood_is_contained(make_daemon):
    d = make_daemon(devices=2, tenants=True)
    rep = fault_flood.run(d, count=1_000, seed=1)
    _check(rep)
    assert rep.done == {"faults": 1_000, "victims": 2}, rep.done
