"""The layers stay honest: who may import whom, who may start whom, and where layouts are
declared.

The driver, the firmware and the runtime meet only through the contracts in ``abi/``
(docs/README.md has the map). These checks read the source, so a layering slip fails here
instead of surfacing as a hidden coupling. They are an allowlist: every top-level package
has an entry naming the first-party packages it may import (``MAY_IMPORT``) and start as
a process (``MAY_START``), and a new package without one fails until it is given one. What
counts as an import: every ``import`` statement (also inside functions), and
``importlib.import_module`` / ``__import__`` of a literal name (an f-string's literal
prefix counts: ``f"stress.{name}"`` is stress). What counts as a start: ``-m MODULE`` in an
argument list (``[sys.executable, "-m", "tools.accel_emud"]``), and everything a literal
``-c`` snippet imports or starts -- there or as the code given to ``run_py`` /
``popen_py``, the test kit's snippet runners."""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from testkit import REPO

#: package -> the other first-party packages it may import (itself it always may)
MAY_IMPORT: dict[str, set[str]] = {
    # the contracts: the standard library and each other only (checked again below)
    "abi": set(),
    "firmware": {"abi"},
    "kmod_emul": {"abi"},
    "runtime": {"abi"},
    # the PyTorch backend is a user of the runtime, like any framework
    "torch_accel": {"abi", "runtime"},
    # what a user of the runtime writes
    "examples": {"runtime"},
    # accel-emud assembles the driver and the firmware images; the admin tools read sysfs
    # and use the runtime as any client would
    "tools": {"abi", "firmware", "kmod_emul", "runtime"},
    # drives a real daemon: finds its mount (kmod_emul.daemon), its firmware's kernel cache
    "testkit": {"abi", "firmware", "kmod_emul"},
    "stress": {"abi", "firmware", "kmod_emul", "runtime", "testkit"},
    "bench": {"abi", "firmware", "kmod_emul", "runtime", "torch_accel"},
}
#: package -> the other first-party packages it may start as a process (``-m``, ``-c``)
MAY_START: dict[str, set[str]] = {
    "abi": set(),
    # the firmware runs on its own: nothing below it
    "firmware": set(),
    # the driver runs each device's firmware as a process of its own
    "kmod_emul": {"firmware"},
    "runtime": set(),
    "torch_accel": set(),
    "examples": set(),
    "tools": set(),
    # accel-emud, the daemon under test; the bystander tenant, a runtime client
    "testkit": {"runtime", "tools"},
    # tenants: runtime clients and raw uAPI users, hostile or bystanding
    "stress": {"abi", "runtime"},
    # the daemon and the clients it measures
    "bench": {"runtime", "tools"},
}
#: Top-level directories of Python that are not layers: the tests drive every layer, also
#: through doors only a test may use (the raw uAPI), so what they import is not a layering
#: question. Their helper modules (tests/rawdev.py...) are first-party all the same: a
#: layer importing one is importing from "tests", which no entry allows.
NOT_LAYERS = {"tests"}
#: Layouts that are not ours: statfs(2)'s and sched_setattr(2)'s structs, futex(2)'s
#: timeout (a timespec), and the bare shared-memory ping-pong the benchmarks measure the
#: user-mode queue against (no contract of the device).
FOREIGN_LAYOUTS = {("kmod_emul/userfd.py", "_Statfs"), ("firmware/host_cpu.py", "_SchedAttr"),
                   ("torch_accel/intrahost.py", "_Timespec"), ("bench/floors.py", "_U64")}
#: Calls whose first argument is a snippet run in a fresh interpreter (the test kit's
#: ``Daemon.run_py`` / ``popen_py`` and the tests' ``run_py`` fixture)
SNIPPET_RUNNERS = {"run_py", "popen_py"}


def packages(root: Path) -> list[str]:
    """The top-level first-party packages under ``root``: every directory holding Python
    directly (kmod_emul is a namespace package: no ``__init__.py`` to look for)."""
    return sorted(p.name for p in root.iterdir()
                  if p.is_dir() and not p.name.startswith(".") and p.name not in NOT_LAYERS
                  and any(p.glob("*.py")))


def first_party(root: Path) -> dict[str, str]:
    """Top-level importable name -> the package it belongs to: each package, and each
    module that sits directly in a directory of ``NOT_LAYERS`` (sys.path has it)."""
    owner = {name: name for name in packages(root)}
    for outside in NOT_LAYERS:
        owner.update((p.stem, outside) for p in (root / outside).glob("*.py"))
    return owner


def _sources(root: Path, package: str) -> list[Path]:
    return sorted((root / package).rglob("*.py"))


def _constants(tree: ast.Module) -> dict[str, str]:
    """Module-level ``NAME = "literal"`` strings: snippets are usually kept in one."""
    return {t.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
            for t in node.targets if isinstance(t, ast.Name)}


def _text(node: ast.AST, consts: dict[str, str]) -> str | None:
    """A literal string: a constant, a module-level constant by name, either dedented."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name):
        return consts.get(node.id)
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "dedent" and len(node.args) == 1):
        return _text(node.args[0], consts)
    return None


def _module_name(node: ast.AST, consts: dict[str, str]) -> str | None:
    """A module named by a literal, or by an f-string whose literal head names its package
    (``f"stress.{name}"``)."""
    if isinstance(node, ast.JoinedStr) and node.values and isinstance(
            node.values[0], ast.Constant) and "." in str(node.values[0].value):
        return str(node.values[0].value)
    return _text(node, consts)


def _callee(node: ast.Call) -> str:
    f = node.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


@dataclass(frozen=True)
class Use:
    """One first-party module a source file uses: imports, or starts as a process."""
    kind: str  # "import" or "start"
    module: str
    line: int


def _snippet_uses(code: str, line: int) -> Iterator[Use]:
    """Everything a ``-c`` snippet imports or starts, as what its spawner starts."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return  # a template filled in later: nothing to read
    for use in _uses(tree):
        yield Use("start", use.module, line)


def _uses(tree: ast.Module) -> Iterator[Use]:
    consts = _constants(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (Use("import", a.name, node.lineno) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield Use("import", node.module, node.lineno)
        elif isinstance(node, ast.Call):
            callee = _callee(node)
            if callee in ("import_module", "__import__") and node.args and (
                    name := _module_name(node.args[0], consts)):
                yield Use("import", name, node.lineno)
            elif callee in SNIPPET_RUNNERS and node.args and (
                    code := _text(node.args[0], consts)):
                yield from _snippet_uses(code, node.lineno)
        elif isinstance(node, (ast.List, ast.Tuple)):
            for flag, arg in zip(node.elts, node.elts[1:]):
                flag_text = _text(flag, consts)
                if flag_text == "-m" and (name := _module_name(arg, consts)):
                    yield Use("start", name, node.lineno)
                elif flag_text == "-c" and (code := _text(arg, consts)):
                    yield from _snippet_uses(code, node.lineno)


def uses(path: Path) -> list[Use]:
    """What ``path`` imports and starts (relative imports excluded: they stay inside)."""
    return list(_uses(ast.parse(path.read_text(), str(path))))


def violations(root: Path, package: str) -> list[str]:
    """Each use by ``package`` of a first-party package its entry does not allow, as
    ``file:line kind package (module)``."""
    owner = first_party(root)
    allowed = {"import": MAY_IMPORT.get(package, set()) | {package},
               "start": MAY_START.get(package, set()) | {package}}
    found = []
    for path in _sources(root, package):
        for use in uses(path):
            target = owner.get(use.module.partition(".")[0])
            if target is not None and target not in allowed[use.kind]:
                found.append(f"{path.relative_to(root)}:{use.line} {use.kind}s {target} "
                             f"({use.module})")
    return found


@pytest.mark.timeout(60)
def test_every_package_has_an_entry():
    """A new top-level package is not free to import anything: it must say what it uses."""
    assert packages(REPO) == sorted(MAY_IMPORT) == sorted(MAY_START)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("package", sorted(MAY_IMPORT))
def test_a_package_uses_only_what_its_entry_allows(package):
    assert violations(REPO, package) == []


@pytest.mark.timeout(60)
def test_the_contracts_import_only_the_standard_library_and_each_other():
    for path in _sources(REPO, "abi"):
        outside = {m for m in (u.module.partition(".")[0] for u in uses(path))
                   if m not in {"abi", "__future__"} and m not in sys.stdlib_module_names}
        assert not outside, (path, outside)


def _layouts(path: Path) -> list[str]:
    """Names of ctypes structures and ``struct.Struct`` formats ``path`` declares."""
    found = []
    tree = ast.parse(path.read_text(), str(path))
    named = {id(n.value): n.targets[0].id for n in ast.walk(tree)
             if isinstance(n, ast.Assign) and len(n.targets) == 1
             and isinstance(n.targets[0], ast.Name)}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and any(
                isinstance(b, ast.Attribute) and b.attr.endswith("Structure") for b in node.bases):
            found.append(node.name)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "Struct" and isinstance(node.func.value, ast.Name)
              and node.func.value.id == "struct"):
            found.append(named.get(id(node), f"struct.Struct at line {node.lineno}"))
    return found


@pytest.mark.timeout(60)
def test_no_layout_is_declared_outside_the_contracts():
    declared = {(str(p.relative_to(REPO)), name)
                for pkg in packages(REPO) if pkg != "abi"
                for p in _sources(REPO, pkg) for name in _layouts(p)}
    assert declared == FOREIGN_LAYOUTS


def _tree(root: Path, files: dict[str, str]) -> Path:
    """A source tree under ``root``: every package of the allowlist (empty), then
    ``files`` (path -> source)."""
    for package in MAY_IMPORT:
        (root / package).mkdir()
        (root / package / "__init__.py").write_text("")
    (root / "tests").mkdir()
    (root / "tests" / "rawdev.py").write_text("")
    for name, text in files.items():
        (root / name).write_text(text)
    return root


@pytest.mark.timeout(60)
def test_the_allowlist_catches_what_a_denylist_let_through(tmp_path):
    """The slips the old denylist passed: the runtime importing the torch backend (inside
    a function), the firmware importing the tools, the contracts importing the driver by
    importlib; and the dynamic and spawned forms of the same."""
    root = _tree(tmp_path, {
        "runtime/lazy.py": "def f():\n    import torch_accel.ops\n",
        "firmware/helper.py": "from tools.sysfs_tree import Tree\n",
        "abi/plugin.py": "import importlib\nDRV = importlib.import_module('kmod_emul.drv')\n",
        "runtime/by_name.py": "def f(n):\n    return __import__(f'firmware.{n}')\n",
        "kmod_emul/spawn.py": ("import subprocess, sys\nCODE = 'import runtime'\n"
                               "subprocess.run([sys.executable, '-m', 'tools.accel_smi'])\n"
                               "subprocess.run([sys.executable, '-c', CODE])\n"),
        "stress/raw.py": "from rawdev import RawDev\n",
        "tools/storm.py": "def f(d):\n    d.run_py('import firmware.main')\n",
    })
    assert violations(root, "runtime") == [
        "runtime/by_name.py:2 imports firmware (firmware.)",
        "runtime/lazy.py:2 imports torch_accel (torch_accel.ops)"]
    assert violations(root, "firmware") == ["firmware/helper.py:1 imports tools (tools.sysfs_tree)"]
    assert violations(root, "abi") == ["abi/plugin.py:2 imports kmod_emul (kmod_emul.drv)"]
    assert violations(root, "kmod_emul") == [
        "kmod_emul/spawn.py:3 starts tools (tools.accel_smi)",
        "kmod_emul/spawn.py:4 starts runtime (runtime)"]
    assert violations(root, "stress") == ["stress/raw.py:1 imports tests (rawdev)"]
    assert violations(root, "tools") == ["tools/storm.py:2 starts firmware (firmware.main)"]


@pytest.mark.timeout(60)
def test_a_package_without_an_entry_is_noticed(tmp_path):
    root = _tree(tmp_path, {})
    (root / "newpkg").mkdir()
    (root / "newpkg" / "mod.py").write_text("import runtime\n")
    assert set(packages(root)) - set(MAY_IMPORT) == {"newpkg"}
    assert violations(root, "newpkg") == ["newpkg/mod.py:1 imports runtime (runtime)"]


@pytest.mark.timeout(60)
def test_the_layout_reader_sees_a_declared_struct(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import ctypes\nimport struct\n\n"
                     "class x(ctypes.LittleEndianStructure):\n    pass\n\n"
                     "HDR = struct.Struct('<I')\n")
    assert _layouts(probe) == ["x", "HDR"]


@pytest.mark.timeout(60)
def test_every_directory_of_tests_is_run():
    """pyproject.toml lists the test directories layer by layer (the order they run in): a
    new directory of tests that it does not list would silently never run."""
    import tomllib

    testpaths = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"][
        "ini_options"]["testpaths"]
    dirs = {p.parent.relative_to(REPO) for p in (REPO / "tests").rglob("test_*.py")}
    unlisted = sorted(str(d) for d in dirs
                      if not any(d == Path(t) or Path(t) in d.parents for t in testpaths))
    assert unlisted == [], "add them to testpaths in pyproject.toml"
