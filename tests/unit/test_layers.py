"""The layers stay honest: who may import whom, and where layouts are declared.

The driver, the firmware and the runtime meet only through the contracts in ``abi/``
(docs/README.md has the map). These checks read the source (every ``import``, also inside
functions), so a layering slip fails here instead of surfacing as a hidden coupling."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from testkit import REPO

#: package -> the first-party packages it must never import
FORBIDDEN = {
    "kmod_emul": {"firmware", "runtime"},
    "firmware": {"kmod_emul", "runtime"},
    "runtime": {"kmod_emul", "firmware"},
    "abi": {"kmod_emul", "firmware", "runtime", "tools"},
    # the PyTorch backend is a user of the runtime, like any framework
    "torch_accel": {"kmod_emul", "firmware", "tools"},
}
#: Layouts that are not ours: statfs(2)'s and sched_setattr(2)'s structs, and the bare
#: shared-memory ping-pong the benchmarks measure the user-mode queue against (no contract
#: of the device).
FOREIGN_LAYOUTS = {("kmod_emul/userfd.py", "_Statfs"), ("firmware/host_cpu.py", "_SchedAttr"),
                   ("bench/floors.py", "_U64")}


def _sources(package: str) -> list[Path]:
    return sorted((REPO / package).rglob("*.py"))


def _imports(path: Path) -> set[str]:
    """Top-level names of every module ``path`` imports (relative imports excluded)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name.partition(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.partition(".")[0])
    return names


@pytest.mark.timeout(60)
@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_a_layer_imports_no_other_layer(package):
    bad = {str(p.relative_to(REPO)): sorted(_imports(p) & FORBIDDEN[package])
           for p in _sources(package)}
    assert {k: v for k, v in bad.items() if v} == {}


@pytest.mark.timeout(60)
def test_the_contracts_import_only_the_standard_library_and_each_other():
    for path in _sources("abi"):
        outside = {m for m in _imports(path) - {"abi", "__future__"}
                   if m not in sys.stdlib_module_names}
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
                for pkg in ("kmod_emul", "firmware", "runtime", "tools", "bench", "stress")
                for p in _sources(pkg) for name in _layouts(p)}
    assert declared == FOREIGN_LAYOUTS


@pytest.mark.timeout(60)
def test_the_checks_see_a_violation(tmp_path):
    """The readers above notice an import inside a function and a declared struct."""
    probe = tmp_path / "probe.py"
    probe.write_text("import ctypes\nimport struct\n\ndef f():\n    from firmware import jit\n\n"
                     "class x(ctypes.LittleEndianStructure):\n    pass\n\n"
                     "HDR = struct.Struct('<I')\n")
    assert _imports(probe) & FORBIDDEN["kmod_emul"] == {"firmware"}
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
