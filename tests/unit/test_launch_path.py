"""One path for a launch's argument block: the stream's ``ArgArena`` (runtime/stream.py).

There were four (a graph's pinned block per captured launch, the stream's arena, the
device's shared arena with its own reuse rule, and the generated launcher writing the
stream's slot itself); each had its own rule for when a block may be overwritten. These
tests fail when a second one appears: by reading the runtime's and the torch backend's
source (who builds a LAUNCH packet, who names an argument address, who writes the arena,
who tells the firmware where it is). Its behaviour, the packets a real daemon was given
by every kind of launch, is read back in tests/runtime/test_kernel.py
(``test_every_kind_of_launch_names_its_streams_arena``).
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
#: the code that launches: the runtime and the torch backend
SOURCES = sorted([*(REPO / "runtime").glob("*.py"), *(REPO / "torch_accel").rglob("*.py")])


def _trees() -> dict[str, ast.Module]:
    return {str(p.relative_to(REPO)): ast.parse(p.read_text(), str(p)) for p in SOURCES}


def _scopes(trees: dict[str, ast.Module], match) -> set[tuple[str, str]]:  # noqa: ANN001
    """(file, innermost function or class around it) of every node ``match`` accepts."""
    out = set()
    for name, tree in trees.items():
        def visit(node: ast.AST, scope: str) -> None:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                scope = node.name
            if match(node):
                out.add((name, scope))
            for child in ast.iter_child_nodes(node):
                visit(child, scope)
        visit(tree, "<module>")
    return out


def _calls(tree: ast.Module) -> list[tuple[str, ast.Call]]:
    """(innermost function around it, call) of every call in ``tree``."""
    out = []

    def visit(node: ast.AST, scope: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            scope = node.name
        if isinstance(node, ast.Call):
            out.append((scope, node))
        for child in ast.iter_child_nodes(node):
            visit(child, scope)
    visit(tree, "<module>")
    return out


def _attr(node: ast.AST, attr: str) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == attr


def test_one_arena_class_and_it_alone_writes_argument_blocks() -> None:
    """One class allocates argument blocks (``ArgArena``), its ``write`` is the only
    code that stores into an arena's memory, and ``Stream.arena`` is the only code that
    names an arena to the firmware (``RING_ARGS_VA``)."""
    trees = _trees()
    arenas = _scopes(trees, lambda n: isinstance(n, ast.ClassDef)
                        and "arena" in n.name.lower())
    assert arenas == {("runtime/stream.py", "ArgArena")}
    stores = _scopes(trees, lambda n: isinstance(n, ast.Assign) and any(
        isinstance(t, ast.Subscript) and (_attr(t.value, "mem") or _attr(t.value, "long"))
        for t in n.targets))
    assert stores == {("runtime/stream.py", "write")}
    named = _scopes(trees, lambda n: _attr(n, "RING_ARGS_VA")
                       or _attr(n, "RING_ARGS_SLOTS"))
    assert named == {("runtime/stream.py", "arena")}


def test_every_launch_packet_is_built_naming_no_address_and_written_by_the_stream() -> None:
    """A LAUNCH packet is built in one place (``Kernel._packet``), with args_va 0;
    only the arena's answer fills the address in (``_name_args``, for a long block);
    and a launch reaches the ring only through ``Stream._write_launch`` (from
    ``Kernel.launch``, a ``LaunchPlan`` and the generated launchers) or a graph's
    ``ArgLaunch``."""
    trees = _trees()
    built = [(name, scope, n) for name, tree in trees.items() for scope, n in _calls(tree)
             if _attr(n.func, "Launch")]
    assert [(name, scope) for name, scope, _ in built] == [("runtime/launch.py", "_packet")]
    call = built[0][2]
    assert len(call.args) == 6 and isinstance(call.args[4], ast.Constant) \
        and call.args[4].value == 0, "a launch names its argument address: only the arena may"
    addressed = _scopes(trees, lambda n: (isinstance(n, ast.keyword) and n.arg == "args_va")
                        or (isinstance(n, ast.Name) and n.id == "_ARGS_VA_AT"
                            and isinstance(n.ctx, ast.Load)))
    assert addressed == {("runtime/stream.py", "_name_args")}
    writers = _scopes(trees, lambda n: _attr(n, "_write_launch"))
    assert writers == {("runtime/launch.py", "launch"), ("runtime/launch.py", "__call__")}
    generated = (REPO / "runtime" / "arg_packer.py").read_text()
    assert "s._write_launch(pkt, raw)" in generated and ".mem[" not in generated
    wrapped = _scopes(trees, lambda n: isinstance(n, ast.Call) and (
        isinstance(n.func, ast.Name) and n.func.id == "ArgLaunch"))
    assert wrapped == {("runtime/launch.py", "launch")}
