"""abi/accel_uapi.h, the C header a raw client is written from (abi/gen_header.py): it is
what the generator makes from abi/ now (never stale), it compiles warning-free as C11,
every size, offset and constant a C compiler sees equals Python's, and
examples/raw_client.c -- version, query, a context, memory, a queue, a no-op rung through
the doorbell and waited for on the event pipe, a copy, a refusal's reason -- builds from it
and runs against a real mount."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from abi import gen_header
from testkit import REPO

CC = shutil.which("cc") or shutil.which("gcc")
CFLAGS = ["-std=c11", "-Wall", "-Wextra", "-Werror", "-pedantic", "-I", str(REPO / "abi")]
needs_cc = pytest.mark.skipif(CC is None, reason="no C compiler (make setup installs gcc)")


def _build(source: Path, out: Path) -> Path:
    assert CC is not None
    proc = subprocess.run([CC, *CFLAGS, "-o", str(out), str(source)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.mark.timeout(60)
def test_the_committed_header_is_what_the_generator_makes():
    """Regenerate and diff: a change to abi/uapi.py or abi/userq.py without `make header`
    fails here."""
    assert gen_header.HEADER.read_text() == gen_header.header(), (
        "abi/accel_uapi.h is stale: run `make header` (python -m abi.gen_header --write)")


@needs_cc
@pytest.mark.timeout(120)
def test_every_size_offset_and_constant_in_c_equals_python(tmp_path):
    program = tmp_path / "check.c"
    program.write_text(gen_header.check_program())
    out = subprocess.run([str(_build(program, tmp_path / "check"))], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    got = {name: int(value) for name, value in (line.split() for line in out.splitlines())}
    want = gen_header.expected()
    assert got == want, {k: (got.get(k), want[k]) for k in want if got.get(k) != want[k]}
    # what is checked: every command's struct, every field, every command code
    assert {k for k in want if k.startswith("ACCEL_CMD_")} == {
        f"ACCEL_CMD_{c.name}" for c in gen_header.uapi.COMMANDS.values()}
    assert {k for k in want if k.startswith("offsetof:")} >= {
        f"offsetof:{cls.__name__}.{name}" for cls in gen_header.STRUCTS
        for name, *_ in cls._fields_}


@needs_cc
@pytest.mark.timeout(120)
def test_the_c_example_client_runs_against_a_real_mount(daemon, tmp_path):
    client = _build(REPO / "examples" / "raw_client.c", tmp_path / "raw_client")
    before = daemon.attr(0, "contexts")
    proc = subprocess.run([str(client), str(daemon.node(0))], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(f"driver ABI {gen_header.uapi.ACCEL_ABI_MAJOR}.")
    assert lines[5].startswith("noop 1 completed at ")
    assert "copy of 1048576 bytes there and back ok" in lines
    assert ("refused: Invalid argument; reason: MEM_ALLOC EINVAL: unknown memory kind 9"
            in lines)
    assert lines[-1] == "done"
    daemon.wait_attrs(0, {"contexts": before})  # it destroyed its context
