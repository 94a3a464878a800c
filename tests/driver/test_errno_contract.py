"""``abi.uapi.ERRNO_MEANING`` against what the driver answers: the table the runtime quotes
in its users' messages (runtime/_channel.py) must say what each errno means when the
driver gives it, as tests/driver/test_command_coverage.py holds docs/README.md's table of
commands to the code.

Two checks. Every errno the driver's source can answer a command or an open with has a
meaning (a new ``DriverError(errno.EX, ...)`` without one fails here). And on a real mount,
each command's bad inputs (the raw tests' ``Bad`` cases, tests/driver/test_cmd_*.py) get
exactly their errno, that errno has a meaning, and where the case says which refusal it is
(a handle nobody holds, another tenant's handle, a wrong token) the meaning says so too:
the table once said ENOENT meant "does not belong to this context", which is EPERM's case.
"""

from __future__ import annotations

import errno
import re
from pathlib import Path

import pytest
from rawdev import assert_unharmed
from refusals import refuse
from test_command_coverage import NAMES, driver_tests, raw_cases

from abi import uapi
from runtime import errors

KMOD = Path(__file__).resolve().parents[2] / "kmod_emul"

#: errnos in kmod_emul/ that never answer an open(2) or a command of a device node: the
#: other nodes' (the event node's blocking read, the directory tree) and record fields.
NOT_ANSWERS = {
    "EINTR": "a blocking read of the event node that waited its slice (faultlog.py)",
    "EISDIR": "the FUSE tree: a directory opened for writing (fs.py)",
    "ENOTDIR": "the FUSE tree: a lookup below a file (fs.py)",
    "ENOLINK": "a LINK_ERROR record's errno field, never a command's answer (link.py)",
}

#: A case whose name matches the pattern is that refusal: its errno, and words its meaning
#: must hold (the situation the user reads about).
SITUATIONS = (
    (r"unknown-|freed|unloaded|destroyed-twice|not-exported|peer-default|empty-name",
     "ENOENT", "nobody"),
    (r"bystander-", "EPERM", "held by another open file"),
    (r"no-context-on-the-peer$", "EPERM", "peer access needs a context of this process"),
    (r"not-exclusive$", "EPERM", "a context that holds the device exclusively"),
    (r"wrong-token$", "EACCES", "wrong token"),
)


def _situation(case_name: str) -> tuple[str, str] | None:
    for pattern, name, words in SITUATIONS:
        if re.match(pattern, case_name):
            return name, words
    return None


@pytest.mark.timeout(60)
def test_every_errno_the_driver_answers_has_a_meaning():
    raised = set()
    for path in sorted(KMOD.glob("*.py")):
        raised |= set(re.findall(r"errno\.(E[A-Z]+)", path.read_text()))
    unmeant = {n for n in raised if getattr(errno, n) not in uapi.ERRNO_MEANING}
    assert unmeant - set(NOT_ANSWERS) == set()
    assert set(NOT_ANSWERS) <= raised, "a NOT_ANSWERS entry the driver no longer raises"


def _cases() -> list:
    """Each command's bad inputs: every case a situation names, and the first of every
    other errno (the same errno again would test nothing new)."""
    out, seen = [], set()
    # not this file: loading it to read its marks would run this function again
    others = [p for p in driver_tests() if p.resolve() != Path(__file__).resolve()]
    for command, cases in sorted(raw_cases(others).items()):
        for bad in cases:
            key = (command, bad.errno, bad.name if _situation(bad.name) else None)
            if key not in seen:
                seen.add(key)
                out.append(pytest.param(NAMES[command], bad, id=f"{command[10:]}-{bad}"))
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("cmd", "bad"), _cases())
def test_each_refusal_on_a_mount_has_the_meaning_it_needs(env, cmd, bad):
    refuse(env, cmd, bad)  # exactly its errno, counted as an isolation refusal if it is one
    err = getattr(errno, bad.errno)
    assert err in uapi.ERRNO_MEANING, f"{cmd.name} {bad.name}: {bad.errno} has no meaning"
    meaning = uapi.ERRNO_MEANING[err]
    situation = _situation(bad.name)
    if situation is not None:
        assert bad.errno == situation[0], f"{cmd.name} {bad.name}: {bad.errno}"
        assert situation[1] in meaning, f"{bad.errno} means {meaning!r}"
    # what the user reads: the runtime's exception quotes the meaning and names the errno
    exc = errors.from_errno(err, f"{cmd.name}: {meaning}")
    assert meaning in str(exc) and bad.errno in str(exc)
    assert_unharmed(env.dev, env.bystander)
