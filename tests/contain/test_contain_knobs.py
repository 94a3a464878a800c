"""The operator's knobs against malformed input: every root-writable attribute answers a
malformed value with EINVAL -- never EIO, never a traceback in the daemon's log -- and
another user with EACCES, and neither disturbs a tenant (docs/containment.md, "Limits").

Found (issue 29): ``ras_ctrl`` ``inject thermal ce`` with 400 digits answered EIO (the
thermal model's float overflowed); ``partition_mode`` ``²`` answered EIO (``str.isdigit``
is true of it, ``int`` refuses it); past 4,300 digits ``int`` itself refuses. The values
are checked in one place now (kmod_emul/attr.py: printable ASCII of at most a page, and
one parser with a range for every number).

The attributes are found by walking the tree (``stress.knob_fuzz.writable_attrs``), and
the malformed values are the fuzzer's fixed ones (``NEVER``, for every attribute, and
``MALFORMED``, by attribute), so an attribute added later is walked here too -- and fails
this test until its malformed values are listed.
"""

from __future__ import annotations

import json

import pytest

from stress.knob_fuzz import MALFORMED, NEVER, write, writable_attrs

pytestmark = pytest.mark.timeout(240)

#: the root-writable attributes a 2-device daemon has (each device has each)
KNOWN = {"reset", "partition_mode", "data", "fail_step", "fw_boot_fail", "fw_hang",
         "map_fail", "partition_fail_step", "ras_ctrl", "recovery", "reset_hold", "sched_hold"}

#: another user's attempt at every attribute: the errno of each write, by path
OTHER_WRITES = """
import errno, json, os, sys
out = {}
for path in json.loads(sys.argv[1]):
    try:
        fd = os.open(path, os.O_WRONLY)
        try:
            os.write(fd, b"1")
        finally:
            os.close(fd)
        out[path] = "ok"
    except OSError as e:
        out[path] = errno.errorcode[e.errno]
print(json.dumps(out))
"""


@pytest.fixture
def tenants(contained):
    """conftest's ``contained`` (bystanders' data, books, processes and descriptors
    checked at the end), whose log must also hold no driver bug."""
    yield contained
    log = contained.log_text()
    assert "driver bug" not in log and "Traceback" not in log, log[-3000:]


def test_ras_ctrl_refuses_out_of_range_values_with_einval(tenants, other_user):
    """The finding as reported: ``inject thermal ce`` with 400 digits answered EIO with a
    traceback. Now EINVAL, the die as hot as it was, nothing counted or recorded; and
    another user gets EACCES for the same write."""
    d = tenants
    ras_ctrl = d.debug(0, "ras_ctrl")
    books = ("ras/thermal_err_count", "ras/compute_err_count", "ras/memory_err_count",
             "fault_log", "throttle_reasons", "clock")
    before = {k: d.attr(0, k) for k in books}
    for value in (b"inject thermal ce " + b"9" * 400, b"inject thermal ue " + b"9" * 400,
                  b"inject thermal ce 201", b"inject compute ce 0x1" + b"0" * 16,
                  b"inject thermal ce " + b"9" * 4097):
        assert write(ras_ctrl, value) == "EINVAL", value[:40]
    assert {k: d.attr(0, k) for k in books} == before
    out = other_user.run(d, OTHER_WRITES, json.dumps([str(ras_ctrl)]))
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {str(ras_ctrl): "EACCES"}


def test_every_root_writable_attribute_refuses_malformed_values(tenants, other_user):
    """Every writable file of ``sys/`` (sysfs and debugfs, both devices), each malformed
    value written as root: EINVAL every time. The same files written by another user:
    EACCES every time, counted as privileged refusals."""
    d = tenants
    paths = writable_attrs(d.root)
    names = {p.name for p in paths}
    assert KNOWN <= names, f"the walk missed {sorted(KNOWN - names)}"
    assert names <= set(MALFORMED), (
        f"list the malformed values of {sorted(names - set(MALFORMED))} in "
        "stress/knob_fuzz.py MALFORMED")
    wrong = {}
    for path in paths:
        for value in (*NEVER, *MALFORMED[path.name]):
            got = write(path, value)
            if got != "EINVAL":
                wrong[f"{path.relative_to(d.root)} <- {value[:40]!r}"] = got
    assert not wrong, wrong
    refused = [int(d.attr(i, "isolation/privileged")) for i in range(2)]
    out = other_user.run(d, OTHER_WRITES, json.dumps([str(p) for p in paths]))
    assert out.returncode == 0, out.stderr
    assert set(json.loads(out.stdout).values()) == {"EACCES"}, out.stdout
    # each refusal counted on the device the file describes (debugfs' too)
    assert sum(int(d.attr(i, "isolation/privileged")) for i in range(2)) - sum(refused) \
        == len(paths)
