"""The sanitizer's corpus (tests/runtime/test_sanitizer.py) run for its results, with the
sanitizer off, under a schedule: what adversarial scheduling exposes (docs/schedule.md).

The programs are the corpus's own (imported, not copied); a harness run before them
notes every device array and pinned buffer a program allocates and, once the program
and a device synchronize are done, reads their bytes and those of the pinned buffer the
programs copy into, and reports a digest of them: the program's *result*. Each device
array is set to a known byte (0x3C: as float32 0.0115, small enough that adding 1 shows)
when it is allocated, by a memset on the stream it is allocated for that the harness waits
for (only that stream: the program's other streams' work stays unordered with it); pinned
buffers are zeroed. So a program's result depends on its own work alone, not on what an earlier one
left in a reused block, and a race whose two orders write or read the same values (a
memset of 0 over zeros) is not hidden by them.

A result is *wrong* when it differs from the program's result in program order, which
``serial=True`` gives: the second stream is the first (``s2 = s1``), so each program's
device-0 work runs in the order it was written.

``python tests/schedule_corpus.py [SEEDS]`` prints the figures table of docs/schedule.md:
for each racy program, how many of SEEDS adversarial seeds and of as many default runs
give a wrong result (one daemon of its own, stopped at the end).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
for _p in (HERE.parent, HERE, HERE / "runtime"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from scenario import STREAM_PRELUDE, run_json  # noqa: E402
from test_sanitizer import CORRECT, RACY, SETUP  # noqa: E402

from testkit.daemon import Daemon  # noqa: E402

#: the corpus's setup asserts the sanitizer is on: here it must be off (its checks would
#: raise at the synchronisation points; what is measured is what the programs compute)
_SANITIZER_ON = 'assert sanitizer.active is not None and sanitizer.active.mode == "raise"\n'
assert _SANITIZER_ON in SETUP

HARNESS = """
import hashlib
assert sanitizer.active is None
_made = set()     # (va, nbytes) of every array a program was given
_empty = runtime.empty
def _tracked(*a, **k):
    arr = _empty(*a, **k)
    if arr.nbytes:  # a known pattern, on the stream the array was allocated for, done
        # before the program sees the array (its first use may be on another stream)
        stream = k.get("stream") or runtime.current_stream(k.get("device") or 0)
        arr.memset(0x3C, stream=stream)  # float32 0.0115
        stream.synchronize()
        _made.add((arr.va, arr.nbytes))
    return arr
runtime.empty = _tracked
_probe = runtime.pinned_empty(4 * N, np.float32)
_host = []        # the pinned buffers a program made (a racing read may land there)
_pinned_empty = runtime.pinned_empty
def _tracked_pinned(*a, **k):
    arr = _pinned_empty(*a, **k)
    arr[...] = 0
    _host.append(arr)
    return arr
runtime.pinned_empty = _tracked_pinned
_outcomes = {}
def _result():
    h = hashlib.sha256()
    for va, n in sorted(_made):
        s1.submit([pkt(userq.Op.COPY, _probe.device_va, va, n)])
        s1.synchronize()
        h.update(_probe.view(np.uint8)[:n].tobytes())
    for arr in [host2, *_host]:
        h.update(arr.tobytes())
    return h.hexdigest()[:12]
_run = run
def run(name, program):
    def observed(x):
        host2[:] = 0
        _made.clear()
        _host.clear()
        program(x)
        sync()
        _outcomes[name] = _result()
    _run(name, observed)
"""

#: A program that forgets ``s2.wait_stream(s1)``: a copy into an array on ``s1``, then a
#: copy out of it on ``s2``; it exits 1 when the second read anything but what the first
#: wrote. The default scheduler runs both inline, in submission order, so it passes there.
MISSING_WAIT = """
import sys, numpy as np, runtime
N = 4096
s1, s2 = runtime.Stream(), runtime.Stream()
a = runtime.empty(N, np.float32)
src, dst = runtime.pinned_empty(N, np.float32), runtime.pinned_empty(N, np.float32)
src[:] = 2
a.memset(0)
runtime.synchronize()
a.copy_from_host(src, s1)
a.copy_to_host(dst, stream=s2)  # missing: s2.wait_stream(s1)
runtime.synchronize()
print("right" if (dst == 2).all() else "wrong")
sys.exit(0 if (dst == 2).all() else 1)
"""

SERIAL = "s2 = s1  # program order: every device-0 access on one stream\n"


def program_names(corpus: str) -> list[str]:
    """The names of a corpus's programs, in order (its ``run("name", ...)`` lines)."""
    return [line.split('"')[1] for line in corpus.splitlines() if line.startswith('run("')]


def outcomes(daemon: Daemon, corpus: str, *, serial: bool = False, timeout: float = 240,
             **env: str) -> dict[str, str]:
    """Each program's result (a digest) in one process running ``corpus`` (RACY or
    CORRECT) with the environment ``env`` (ACCEL_SCHEDULE, ACCEL_REPLAY, ...)."""
    code = SETUP.replace(_SANITIZER_ON, "") + HARNESS + (SERIAL if serial else "") + corpus
    r = run_json(daemon, STREAM_PRELUDE, code + "report(outcomes=_outcomes)\n",
                 timeout=timeout, ACCEL_SANITIZE="0", **env)
    return r["outcomes"]


def exposure(daemon: Daemon, seeds: int) -> list[dict[str, Any]]:
    """For each racy program: how many of ``seeds`` adversarial seeds (0, 1, ...) and of
    as many default-scheduler runs give a result other than program order's."""
    want = outcomes(daemon, RACY, serial=True)
    adversarial = [outcomes(daemon, RACY, ACCEL_SCHEDULE=f"adversarial:{s}")
                   for s in range(seeds)]
    default = [outcomes(daemon, RACY) for _ in range(seeds)]
    return [{"program": name,
             "adversarial": sum(o[name] != want[name] for o in adversarial),
             "default": sum(o[name] != want[name] for o in default),
             "first_seed": next((s for s, o in enumerate(adversarial)
                                 if o[name] != want[name]), None)}
            for name in program_names(RACY)]


def main() -> None:
    import tempfile

    from firmware.image import IMAGE_DIR
    seeds = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    with tempfile.TemporaryDirectory(prefix="schedule-corpus-") as tmp:
        d = Daemon(Path(tmp) / "root", Path(tmp) / "state", IMAGE_DIR, 2, [], None)
        d.start()
        try:
            rows = exposure(d, seeds)
        finally:
            d.stop()
    print(f"| racy program | adversarial: wrong in N of {seeds} seeds | first seed | "
          f"default scheduler: wrong in N of {seeds} runs |")
    print("| --- | --- | --- | --- |")
    for r in rows:
        first = "-" if r["first_seed"] is None else r["first_seed"]
        print(f"| `{r['program']}` | {r['adversarial']} | {first} | {r['default']} |")


if __name__ == "__main__":
    main()
