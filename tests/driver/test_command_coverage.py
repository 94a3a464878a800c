"""Every command of ``abi.uapi.COMMANDS`` has its raw bad-input test here, in tests/driver/,
and docs/README.md's table (command -> struct -> handler -> raw test) says what the code
says.

A raw test declares the command it covers with ``@pytest.mark.command("ACCEL_CMD_<NAME>")``
(the marker is registered in pyproject.toml). The check imports every tests/driver/test_*.py
module -- the very module object pytest imported, when it did -- and reads the marks pytest
keeps on the test functions (their ``pytestmark``), so it holds whichever tests a run
selects: running this file alone still checks the whole directory.
"""

from __future__ import annotations

import importlib.util
import sys
from collections import defaultdict
from pathlib import Path
from types import ModuleType

import pytest

from abi import uapi
from kmod_emul import drv
from testkit import REPO

DRIVER_TESTS = Path(__file__).resolve().parent
#: the name a raw test's marker gives, for every command of the table
NAMES = {f"ACCEL_CMD_{c.name}": c for c in uapi.COMMANDS.values()}


def _module(path: Path) -> ModuleType:
    mod = sys.modules.get(path.stem)
    if mod is not None and Path(getattr(mod, "__file__", "")).resolve() == path:
        return mod
    spec = importlib.util.spec_from_file_location(f"_coverage_{path.stem}", path)
    assert spec is not None and spec.loader is not None, path
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # what a module's dataclasses look their annotations up in
    spec.loader.exec_module(mod)
    return mod


def marked_commands(paths: list[Path]) -> dict[str, list[str]]:
    """Marker argument -> the ``file::test`` functions marked ``command`` with it."""
    found: dict[str, list[str]] = defaultdict(list)
    for path in paths:
        mod = _module(path)
        module_marks = getattr(mod, "pytestmark", [])
        if not isinstance(module_marks, list):
            module_marks = [module_marks]
        for name, obj in vars(mod).items():
            if not name.startswith("test") or not callable(obj):
                continue
            for mark in [*module_marks, *getattr(obj, "pytestmark", [])]:
                if mark.name == "command":
                    for arg in mark.args:
                        found[arg].append(f"{path.name}::{name}")
    return dict(found)


def raw_cases(paths: list[Path]) -> dict[str, list]:
    """Marker argument -> the bad inputs (``refusals.Bad``) its raw test is parametrised
    with, for the tests that take them (tests/driver/test_errno_contract.py runs them)."""
    cases: dict[str, list] = defaultdict(list)
    for path in paths:
        for name, obj in vars(_module(path)).items():
            marks = getattr(obj, "pytestmark", []) if name.startswith("test") else []
            commands = [a for m in marks if m.name == "command" for a in m.args]
            for mark in marks:
                if mark.name == "parametrize" and mark.args[0] == "bad":
                    for command in commands:
                        cases[command] += list(mark.args[1])
    return dict(cases)


def problems(found: dict[str, list[str]]) -> list[str]:
    """What is wrong with ``found``: a command without a raw test, a marker naming no
    command, a command with more than one (which one would docs/README.md name?)."""
    out = [f"{name}: no raw test in tests/driver/ (mark it @pytest.mark.command({name!r}))"
           for name in NAMES if name not in found]
    out += [f"{name}: marks {tests}, but abi.uapi.COMMANDS has no such command"
            for name, tests in sorted(found.items()) if name not in NAMES]
    out += [f"{name}: marked on {tests}; one raw test (a parametrised group) per command"
            for name, tests in sorted(found.items()) if name in NAMES and len(tests) > 1]
    return out


def driver_tests() -> list[Path]:
    return sorted(p for p in DRIVER_TESTS.glob("test_*.py") if p.resolve() != Path(__file__).resolve())


@pytest.mark.timeout(60)
def test_every_command_has_one_raw_test():
    assert problems(marked_commands(driver_tests())) == []


@pytest.mark.timeout(60)
def test_the_check_sees_a_command_without_a_raw_test(tmp_path):
    """The reader above notices a command nobody marked, a marker with a typo and a
    command marked twice."""
    names = list(NAMES)
    probe = tmp_path / "test_probe.py"
    probe.write_text("import pytest\n\n" + "".join(
        f"@pytest.mark.command({name!r})\ndef test_{i}():\n    pass\n\n"
        for i, name in enumerate([*names[1:], "ACCEL_CMD_NO_SUCH", names[2]])))
    typo, twice = len(names) - 1, len(names)  # the probe's functions marking them
    assert problems(marked_commands([probe])) == [
        f"{names[0]}: no raw test in tests/driver/ (mark it @pytest.mark.command({names[0]!r}))",
        f"ACCEL_CMD_NO_SUCH: marks ['test_probe.py::test_{typo}'], but abi.uapi.COMMANDS has "
        "no such command",
        f"{names[2]}: marked on ['test_probe.py::test_1', 'test_probe.py::test_{twice}']; one "
        "raw test (a parametrised group) per command",
    ]


def docs_table() -> str:
    """docs/README.md's table of commands, as the code has it."""
    found = marked_commands(driver_tests())
    rows = ["| command (`abi/uapi.py`) | struct (`abi/uapi.py`) | handler (`kmod_emul/drv.py`) "
            "| raw test (`tests/driver/`) |", "| --- | --- | --- | --- |"]
    for name, cmd in NAMES.items():
        handler = drv.TABLE[cmd.code]
        assert handler.__module__ == "kmod_emul.drv", handler
        tests = " ".join(f"`{t}`" for t in found.get(name, ["(none)"]))
        rows.append(f"| `{name}` | `{cmd.struct.__name__}` | `{handler.__name__}()` | {tests} |")
    return "\n".join(rows) + "\n"


@pytest.mark.timeout(60)
def test_the_docs_table_of_commands_matches_the_code():
    """docs/README.md must let a newcomer go from a command to its struct, its handler and
    its raw test; regenerate the table with
    ``PYTHONPATH=.:tests:tests/driver python -c "import test_command_coverage as t; print(t.docs_table())"``."""
    text = (REPO / "docs" / "README.md").read_text()
    assert docs_table() in text, "docs/README.md's table of commands is stale:\n" + docs_table()
