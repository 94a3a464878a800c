"""The adversarial suite: hostile clients against a real mount, in two sizes.

Each module here is one attacker (a uAPI fuzzer, a ring fuzzer, a hostile module corpus, a
SIGKILL storm, ...) exposing ``run(daemon, *, count, seed) -> Report``. The tests in
``tests/contain/`` run every attacker briefly with a fixed seed (CI); ``make stress``
(``python -m stress``) runs them long and prints their figures, which docs/containment.md
records. After every round an attacker makes the checks of testkit/contained.py: daemon and
firmware alive, devices operational, bystanders intact, nothing leaked.
"""
