"""In-kernel hazards under ``ACCEL_SANITIZE`` (docs/sanitizer.md, "In-kernel hazards"):
kernels with shared arrays run in the firmware's checked mode, which reports two threads
of one block reaching one shared element within one barrier phase, at least one writing,
not both atomically, as ``runtime.RaceError`` at the next host wait.

A corpus of racy and clean kernels runs in one process on a real mount. Each racy kernel
marks the lines of its racing accesses with ``# A`` (the access found first: the threads
of a phase run in turn, lowest first) and ``# B``; the report must name those lines of
the kernel source, the array, the element and both threads' ids. Precision and recall
over the corpus are in docs/sanitizer.md.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runtime import kernel_lib
from scenario import STREAM_PRELUDE as PRELUDE
from scenario import run_json

pytestmark = pytest.mark.timeout(300)

#: Racy kernels: name -> (source, grid, block, dynamic shared bytes, expected report:
#: array, element, byte, block id, first thread, first mode, second thread, second mode).
RACY = {
    "reduce_missing_barrier": ('''
def reduce_missing_barrier(x, out):
    s = shared_array(64, "float32")
    t = local_id(0)
    s[t] = x[global_id(0)]
    barrier()
    k = 32
    while k > 0:
        if t < k:
            s[t] += s[t + k]  # A B
        k = k // 2
    if t == 0:
        out[group_id(0)] = s[0]
''', 1, 64, 0, ("s", 1, 4, [0, 0, 0], [0, 0, 0], "read", [1, 0, 0], "read+write")),
    "neighbour_without_barrier": ('''
def neighbour_without_barrier(x, out):
    s = shared_array(64, "float32")
    t = local_id(0)
    i = global_id(0)
    s[t] = x[i]  # B
    out[i] = s[(t + 1) % 64]  # A
''', 1, 64, 0, ("s", 1, 4, [0, 0, 0], [0, 0, 0], "read", [1, 0, 0], "write")),
    "tile_reload_without_second_barrier": ('''
def tile_reload_without_second_barrier(a, b, c, n):
    ta = shared_array((8, 8), "float32")
    tb = shared_array((8, 8), "float32")
    tx = local_id(0)
    ty = local_id(1)
    col = group_id(0) * 8 + tx
    row = group_id(1) * 8 + ty
    acc = 0.0
    for t in range(0, n, 8):
        ta[ty, tx] = a[row, t + tx]  # B
        tb[ty, tx] = b[t + ty, col]
        barrier()
        for k in range(8):
            acc += ta[ty, k] * tb[k, tx]  # A
    c[row, col] = acc
''', (1, 1), (8, 8), 0, ("ta", 0, 0, [0, 0, 0], [1, 0, 0], "read", [0, 0, 0], "write")),
    "transpose_without_barrier": ('''
def transpose_without_barrier(x, out):
    s = shared_array((8, 8), "int32")
    tx = local_id(0)
    ty = local_id(1)
    s[ty, tx] = x[ty * 8 + tx]  # B
    out[ty * 8 + tx] = s[tx, ty]  # A
''', 1, (8, 8), 0, ("s", 8, 32, [0, 0, 0], [1, 0, 0], "read", [0, 1, 0], "write")),
    "atomic_then_plain_read": ('''
def atomic_then_plain_read(x, out):
    s = shared_array(1, "float32")
    t = local_id(0)
    atomic_add(s, 0, x[t])  # B
    out[t] = s[0]  # A
''', 1, 32, 0, ("s", 0, 0, [0, 0, 0], [0, 0, 0], "read", [1, 0, 0], "atomic")),
    "dynamic_neighbour_in_second_block": ('''
def dynamic_neighbour_in_second_block(x, out, n):
    d = dynamic_shared("float64")
    t = local_id(0)
    if group_id(0) == 1:
        d[t] = x[t]  # B
        out[t] = d[(t + 1) % n]  # A
''', 2, 16, 128, ("d", 1, 8, [1, 0, 0], [0, 0, 0], "read", [1, 0, 0], "write")),
}

#: Clean kernels: name -> (source, grid, block, dynamic shared bytes).
CLEAN = {
    "reduce_with_barrier": ('''
def reduce_with_barrier(x, out):
    s = shared_array(64, "float32")
    t = local_id(0)
    s[t] = x[global_id(0)]
    barrier()
    k = 32
    while k > 0:
        if t < k:
            s[t] += s[t + k]
        barrier()
        k = k // 2
    if t == 0:
        out[group_id(0)] = s[0]
''', 2, 64, 0),
    "neighbour_with_barrier": ('''
def neighbour_with_barrier(x, out):
    s = shared_array(64, "float32")
    t = local_id(0)
    i = global_id(0)
    s[t] = x[i]
    barrier()
    out[i] = s[(t + 1) % 64]
''', 1, 64, 0),
    "tiled_matmul": ('''
def tiled_matmul(a, b, c, n):
    ta = shared_array((8, 8), "float32")
    tb = shared_array((8, 8), "float32")
    tx = local_id(0)
    ty = local_id(1)
    col = group_id(0) * 8 + tx
    row = group_id(1) * 8 + ty
    acc = 0.0
    for t in range(0, n, 8):
        ta[ty, tx] = a[row, t + tx]
        tb[ty, tx] = b[t + ty, col]
        barrier()
        for k in range(8):
            acc += ta[ty, k] * tb[k, tx]
        barrier()
    c[row, col] = acc
''', (2, 2), (8, 8), 0),
    "transpose_with_barrier": ('''
def transpose_with_barrier(x, out):
    s = shared_array((8, 8), "int32")
    tx = local_id(0)
    ty = local_id(1)
    s[ty, tx] = x[ty * 8 + tx]
    barrier()
    out[ty * 8 + tx] = s[tx, ty]
''', 1, (8, 8), 0),
    "shared_atomics": ('''
def shared_atomics(x, out):
    s = shared_array(4, "float32")
    t = local_id(0)
    atomic_add(s, t % 4, x[t])
    atomic_add(s, 0, 1.0)
    barrier()
    if t < 4:
        out[t] = s[t]
''', 1, 32, 0),
    "own_elements_only": ('''
def own_elements_only(x, out):
    s = shared_array(64, "float32")
    t = local_id(0)
    s[t] = x[t]
    s[t] = s[t] * 2.0
    out[t] = s[t]
''', 1, 64, 0),
    "same_value_read_by_all": ('''
def same_value_read_by_all(x, out):
    s = shared_array(1, "float32")
    t = local_id(0)
    if t == 0:
        s[0] = x[0]
    barrier()
    out[t] = s[0] + x[t]
''', 1, 64, 0),
    "dynamic_with_barrier": ('''
def dynamic_with_barrier(x, out, n):
    d = dynamic_shared("float64")
    t = local_id(0)
    d[t] = x[t]
    barrier()
    out[t] = d[(t + 1) % n]
''', 2, 16, 128),
}

#: The library's kernels with shared arrays (runtime/kernel_lib.py), clean too.
CLEAN.update({"reduce_sum": (kernel_lib.SOURCE, 2, 256, 0),
              "gemm": (kernel_lib.SOURCE, (2, 2), (16, 16), 0)})

#: The child: compile and launch every kernel on arguments of the right shapes (inputs
#: 0..n-1), synchronise, record whether it raised and what, and each output's bytes.
CORPUS = """
import dataclasses, hashlib
from runtime import sanitizer
RACY, CLEAN = json.loads(SPEC)
def args_for(name, src, grid, block, dyn):
    n = 32 if name == "gemm" else 16
    if name == "reduce_sum":
        return [runtime.to_device(np.arange(5000, dtype=np.float64)),
                runtime.to_device(np.zeros(1))]
    if "matmul" in name or "tile" in name or name == "gemm":
        a = runtime.to_device(np.arange(n * n, dtype=np.float32).reshape(n, n) / 7)
        b = runtime.to_device(np.arange(n * n, dtype=np.float32).reshape(n, n)[::-1].copy() / 5)
        return [a, b, runtime.to_device(np.zeros((n, n), np.float32)), np.int64(n)]
    dt = np.int32 if "transpose" in name else np.float64 if "dynamic" in name else np.float32
    x = runtime.to_device(np.arange(128, dtype=dt))
    out = runtime.to_device(np.zeros(128, dt))
    return [x, out] + ([np.int64(16)] if "dynamic" in name else [])
def launch(name, spec):
    src, grid, block, dyn = spec[:4]
    mod = runtime.compile(src)
    args = args_for(name, src, grid, block, dyn)
    getattr(mod, name)[tuple(grid) if isinstance(grid, list) else grid,
                       tuple(block) if isinstance(block, list) else block](*args, shared_mem=dyn)
    return args
results = {}
for table in (RACY, CLEAN):
    for name, spec in table.items():
        try:
            args = launch(name, spec)
            runtime.synchronize()
            out = args[2] if len(args) == 4 and args[3].dtype == np.int64 else args[1]
            results[name] = {"raised": False,
                             "out": hashlib.sha256(out.copy_to_host().tobytes()).hexdigest()}
        except runtime.RaceError as e:
            runtime.synchronize()
            results[name] = {"raised": True, "report": dataclasses.asdict(e.report),
                             "kind": e.report.kind, "n": len(e.reports), "text": str(e)}
report(results=results, active=sanitizer.active is not None)
"""


def _spec() -> str:
    return json.dumps([RACY, CLEAN])


def _run(daemon, **env) -> dict:
    body = f"SPEC = {_spec()!r}\nimport json\n" + CORPUS
    return run_json(daemon, PRELUDE, body, timeout=240, **env)


@pytest.fixture(scope="module")
def checked(daemon):
    """The corpus in a process with ``ACCEL_SANITIZE=1``."""
    return _run(daemon, ACCEL_SANITIZE="1")


@pytest.fixture(scope="module")
def unchecked(daemon, checked):
    """The same corpus in a bystander process without it (after the checked run, so the
    firmware holds both builds)."""
    return _run(daemon, ACCEL_SANITIZE="")


def _line(src: str, mark: str) -> int:
    """The line of ``src`` whose comment holds ``mark`` (``# A``, ``# B`` or ``# A B``)."""
    return next(i for i, text in enumerate(src.split("\n"), 1)
                if "#" in text and mark in text.split("#", 1)[1].split())


@pytest.mark.parametrize("name", sorted(RACY))
def test_a_racy_kernel_is_reported_with_line_array_and_threads(checked, name):
    r = checked["results"][name]
    assert r["raised"], r
    assert r["kind"] == "shared-memory race"
    src, *_, want = RACY[name]
    array, element, byte, block, t1, m1, t2, m2 = want
    rep = r["report"]
    assert (rep["kernel"], rep["array"], rep["element"], rep["byte"]) == \
        (name, array, element, byte), r["text"]
    assert (rep["first"]["block"], rep["first"]["thread"], rep["first"]["mode"]) == \
        (block, t1, m1), r["text"]
    assert (rep["second"]["block"], rep["second"]["thread"], rep["second"]["mode"]) == \
        (block, t2, m2), r["text"]
    assert rep["first"]["site"] == f"<source>:{_line(src, 'A')}", r["text"]
    assert rep["second"]["site"] == f"<source>:{_line(src, 'B')}", r["text"]
    assert r["n"] == 1, r["text"]  # one report per launch: its first hazard


@pytest.mark.parametrize("name", sorted(CLEAN))
def test_a_clean_kernel_is_not_reported(checked, name):
    r = checked["results"][name]
    assert not r["raised"], r.get("text")


@pytest.mark.parametrize("name", sorted(CLEAN))
def test_a_clean_kernel_computes_the_same_bytes_checked(checked, unchecked, name):
    assert checked["results"][name]["out"] == unchecked["results"][name]["out"]


def test_a_bystander_without_the_variable_is_unaffected(unchecked):
    """The racy kernels run in the same daemon right after the checked process: nothing
    is reported, nothing raises."""
    assert not unchecked["active"]
    assert not any(r["raised"] for r in unchecked["results"].values())


def test_checked_and_unchecked_builds_are_cached_apart(unchecked, jit_cache_dir: Path):
    """Each kernel has two JIT cache entries, told apart by their key's options: the
    checked one's module calls the hazard helper, the other's is the plain lowering."""
    builds: dict[str, dict[bool, str]] = {}
    for manifest in jit_cache_dir.glob("*/*/manifest.json"):
        m = json.loads(manifest.read_text())
        source = m["inputs"]["kernel"]["source"]
        name = source.split("(", 1)[0].removeprefix("def ")
        if name in RACY or name in CLEAN:
            module = (manifest.parent / m["module"]).read_text()
            builds.setdefault(name, {})[m["inputs"]["options"].get("sanitize", False)] = module
    assert sorted(builds) == sorted([*RACY, *CLEAN])
    for name, pair in builds.items():
        assert set(pair) == {False, True}, name
        assert "_hz_acc" in pair[True] and "_hz_acc" not in pair[False], name


@pytest.mark.parametrize("body, line", [
    ("    t = local_id(0)\n    if t == 0:\n        return\n    barrier()\n", 5),
    ("    m = n\n    if local_id(0) == 0:\n        m = n + 1\n    for i in range(m):\n"
     "        barrier()\n", 6),
    ("    for i in range(n):\n        if local_id(0) > i:\n            break\n"
     "        barrier()\n", 5),
])
def test_a_divergent_barrier_is_refused_when_compiled(body, line):
    """synccheck's job is done statically: the barrier rule (docs/kernels.md) refuses a
    barrier some threads may not reach -- after a return, under a trip count or a break
    that depends on the thread -- naming its line, so no launch can diverge there."""
    from runtime import kernels

    with pytest.raises(kernels.KernelCompileError) as e:
        kernels.validate(f"def k(x, n):\n{body}")
    assert e.value.lineno == line and "barrier()" in str(e.value)


def test_warn_mode_prints_and_goes_on(daemon):
    src = RACY["neighbour_without_barrier"][0]
    out = daemon.run_py(PRELUDE + f"""
from runtime import sanitizer
K = runtime.compile({src!r})
x = runtime.to_device(np.arange(64, dtype=np.float32))
y = runtime.empty(64, np.float32)
K.neighbour_without_barrier[1, 64](x, y)
runtime.synchronize()
print("went on", len(sanitizer.active.found), float(y.copy_to_host()[0]))
""", timeout=120, ACCEL_SANITIZE="warn")
    assert out.returncode == 0, out.stderr
    assert "went on 1" in out.stdout
    assert "accel sanitizer: shared-memory race in kernel neighbour_without_barrier " \
        "on shared array s[1]" in out.stderr


def test_the_corpus_is_the_documented_one():
    """docs/sanitizer.md states precision and recall over exactly this corpus."""
    text = open("docs/sanitizer.md").read()
    assert f"{len(RACY)} racy and {len(CLEAN)} clean kernels" in text
