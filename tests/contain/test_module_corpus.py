"""The hostile module corpus (stress/module_corpus.py) in CI size, and regressions for the
bugs it found.

The corpus talks to the device node itself (no runtime front end): every module is JSON it
built, in a sealed memfd of its own, loaded with MODULE_LOAD and launched with LAUNCH
packets in rings of its own. It runs on private daemons whose image has a short watchdog
(the corpus keeps a kernel that never ends), once with every capability and once on a
device without the matrix unit, atomics and block-shared memory (so that EOPNOTSUPP is
exercised).

The other tests are regressions of the bugs the corpus found.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from firmware import image
from stress import module_corpus as mc


@pytest.fixture
def short_watchdog(tmp_path: Path) -> Path:
    return image.build_into(tmp_path / "fw-watchdog", watchdog_ms=1500)


@pytest.fixture
def lacking_caps(tmp_path: Path) -> Path:
    """An image without the matrix unit, atomics and block-shared memory."""
    caps = [c for c in image.DEFAULT_PAYLOAD["capabilities"]
            if c not in ("matrix", "atomics", "shared_mem")]
    return image.build_into(tmp_path / "fw-caps", watchdog_ms=1500, capabilities=caps)


@pytest.fixture(scope="module")
def corpus_jit_cache(tmp_path_factory) -> Path:
    """The corpus runs' kernel cache: apart from the session's, since each run checks the
    files it leaves there (no new file that is not a complete entry), but the same for both
    runs, so the second finds the first one's kernels compiled (and still refuses what needs
    a capability its device lacks: the firmware reads that from the source either way)."""
    return tmp_path_factory.mktemp("corpus-jit-cache")


def _assert_clean(report) -> None:
    text = report.line() + "\n" + "\n".join(report.notes)
    assert report.ok, text


@pytest.mark.timeout(300)
def test_module_corpus(make_daemon, short_watchdog, corpus_jit_cache):
    """~250 fixed cases, 20 mutants, 100 loads of a 1 MiB module, the module quotas; as
    uid 65534, with a bystander on each device (about 40-70 s, most of it the fixed
    corpus's ~35 first compiles: the session's JIT cache is not used). The fixed corpus
    answers every errno asserted below; seed 20261201's first 20 mutants (``python -m
    stress`` makes 2,000) are answered each way a mutant may be (success, EINVAL at load
    and at launch, ENOEXEC, EFAULT), as its first 60 were."""
    d = make_daemon(devices=2, firmware_dir=short_watchdog, tenants=True,
                    jit_cache=corpus_jit_cache)
    report = mc.run(d, count=20, seed=20261201)
    print(report.line())
    for note in report.notes:
        print(note)
    _assert_clean(report)
    # every fixed case and every mutant was answered
    assert report.done["modules"] == report.done["fixed_cases"] + 20, report.done
    assert report.done["fixed_cases"] >= 250 and report.done["launches"] >= 200, report.done
    assert report.done["quota_loads"] > 300 and report.done["churn_loads"] == 105, report.done
    assert abs(report.done["churn_rss_daemon_kib"]) <= mc.RSS_BOUND >> 10
    assert abs(report.done["churn_rss_firmware_kib"]) <= mc.RSS_BOUND >> 10
    for name in ("EFAULT", "ETIMEDOUT", "ENOEXEC", "EMEDIUMTYPE", "EBADF"):
        assert report.errnos.get(name), (name, report.errnos)


@pytest.mark.timeout(300)
def test_module_corpus_on_a_device_lacking_capabilities(make_daemon, lacking_caps,
                                                        corpus_jit_cache):
    """What needs the matrix unit, atomics or barriers is refused with EOPNOTSUPP (the
    fixed corpus again, on this device, and 8 mutants: answered EINVAL, ENOEXEC and
    EFAULT, as 20 were)."""
    d = make_daemon(devices=1, firmware_dir=lacking_caps, tenants=True,
                    jit_cache=corpus_jit_cache)
    report = mc.run(d, count=8, seed=7, churn=0, quota=False)
    print(report.line())
    _assert_clean(report)
    assert report.errnos.get("EOPNOTSUPP", 0) >= 3, report.errnos


# --------------------------------------------------------------------------- regressions

def _answers(d, cases: mc.Corpus) -> list[tuple[str, list[str]]]:
    """(MODULE_LOAD's answer, each launch's fault) per case ("" = success)."""
    _vas, results = mc.attack(d, cases.cases)
    out = []
    for res in results:
        assert res is not None and "error" not in res, res
        out.append((res["load"], [L.get("fault", "skipped") for L in res.get("launches", [])]))
    return out


def _one(c: mc.Corpus, name: str, kernel: dict, args: list, **launch) -> None:
    c.add(name, mc.dump(mc.module_of({"k": kernel})), {""}, [mc.launch_of(args, **launch)],
          [mc.expect("EINVAL")])


def test_kernel_hiding_a_capability_the_device_lacks_is_refused(make_daemon, lacking_caps):
    """A kernel whose IR flags hide that it uses mma/atomic_add/barrier ran on a device
    without matrix/atomics/shared_mem (the driver trusted the flags, the firmware never
    looked at the device's capabilities). The firmware reads the source now."""
    d = make_daemon(devices=1, firmware_dir=lacking_caps)
    c = mc.Corpus(set(), 48 << 10, 1500)
    params = [{**mc.X, "name": n, "ndim": 2} for n in "abc"]
    args = [mc.buf("a"), mc.buf("b"), mc.buf("c")]
    for flag, body in (("uses_mma", "    mma(c, a, b, 0, 0, 0, 4, 5, 3, 0.0)\n"),
                       ("uses_atomics", "    atomic_add(c, (0, 0), 1.0)\n"),
                       ("uses_barrier", "    barrier()\n")):
        _one(c, flag, {"params": params, "shared_mem": 0, flag: False,
                       "source": "def k(a, b, c):\n" + body}, args, block=[32, 1, 1])
    # refused at MODULE_LOAD or at the launch, with EOPNOTSUPP (ENOTSUP: the same errno on
    # Linux, by the name Python gives it): never run
    refused = {"EOPNOTSUPP", "ENOTSUP"}
    for load, launches in _answers(d, c):
        assert load in refused or (len(launches) == 1 and launches[0] in refused), \
            (load, launches)


def test_cached_kernel_does_not_skip_validation_of_an_equal_ir(make_daemon):
    """The JIT's in-memory lookup matched params with ==, where True == 1.0 == 1: an IR
    with ndim true (or 1.0), which validate() refuses, ran the kernel compiled for ndim 1
    once that one was in memory."""
    d = make_daemon(devices=1)
    c = mc.Corpus(set(), 48 << 10, 10_000)
    _one(c, "ndim-true-first", {**mc.GOOD, "params": [{**mc.X, "ndim": True}]}, [mc.buf("x")])
    c.add("good", mc.dump(mc.module_of({"k": mc.GOOD})), {""},
          [mc.launch_of([mc.buf("x")])], [mc.expect("")])
    _one(c, "ndim-true", {**mc.GOOD, "params": [{**mc.X, "ndim": True}]}, [mc.buf("x")])
    _one(c, "ndim-float", {**mc.GOOD, "params": [{**mc.X, "ndim": 1.0}]}, [mc.buf("x")])
    answers = _answers(d, c)
    assert answers[0] == ("", ["EINVAL"])  # refused while nothing equal is cached
    assert answers[1] == ("", [""])
    assert answers[2:] == [("", ["EINVAL"])] * 2  # the same IR, refused the same way


def test_failed_compile_leaves_no_files_in_the_jit_cache(make_daemon):
    """A kernel that validated but did not compile left ROOT/<key>.lock and an empty
    shard directory in the JIT cache, one per distinct kernel a tenant launched."""
    d = make_daemon(devices=1, jit_cache="private")  # an empty cache, its files looked at
    c = mc.Corpus(set(), 48 << 10, 10_000)
    for i in range(3):  # numba refuses a float index: no entry, and no file either
        _one(c, f"float-index-{i}", {**mc.GOOD, "source": f"def k(x):\n    x[0.5] = {i}.0\n"},
             [mc.buf("x")])
    assert _answers(d, c) == [("", ["EINVAL"])] * 3
    assert mc.jit_cache_orphans(d) == []
