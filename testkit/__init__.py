"""The test kit: a real daemon and the checks made after every attack, shared by the tests
(tests/), the adversarial suite (stress/) and anything else that drives a real mount.

One module a concept, each imported by name (``from testkit.daemon import Daemon``):

- ``daemon``: ``Daemon``, one ``accel-emud`` on a root of its own, started and stopped by
  the caller (tests use the fixtures in tests/conftest.py), with snippets run against it;
- ``contained``: the containment checks (docs/containment.md): ``snapshot`` a baseline,
  then ``assert_contained`` -- the same daemon and firmware processes live, every device
  operational, the driver's books, the descriptors and /dev/shm back where they were;
- ``bystander``: ``Bystander``, another tenant whose data and work must stay intact;
- ``tenants``: the other tenant's two shapes, ``as_user`` (a snippet that drops to
  another uid) and ``OtherUser`` (a fresh interpreter that never was root);
- ``procs``: child processes -- SIGINT-able children, tenants ended through stdin,
  liveness, the daemon's firmware children;
- ``waiting``: ``wait_until``, the one poll-until-true, whose failure says what was
  awaited and what was last seen.

It lives at the top level, not inside stress/ or tests/, because both use it and
neither is the other's library.
"""

from __future__ import annotations

from pathlib import Path

#: The checkout: the working directory and PYTHONPATH of every interpreter the kit starts
REPO = Path(__file__).resolve().parent.parent

__all__ = ["REPO"]
