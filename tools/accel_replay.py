"""accel-replay: shrink a failing schedule recording to a minimal one (docs/schedule.md).

    accel-replay RECORDING [-o OUT] [--tries N] [--timeout S] -- COMMAND [ARG...]

``RECORDING`` is what ``ACCEL_RECORD`` wrote for a run of ``COMMAND`` that failed. The
tool reruns ``COMMAND`` with ``ACCEL_REPLAY`` naming a recording that keeps only some of
the decisions (the firmware makes no other: a packet whose delay was dropped runs when
the default scheduler would run it), and calls a run failed when it exits nonzero. Delta
debugging (Zeller's ddmin) over the decisions finds a subset that still fails and from
which no single decision can be dropped (1-minimal), usually the one or two delays that
let a packet overtake the one it should have waited for. An injected fault the recording
holds (a ``fault`` entry) is one decision more: a failure only the fault causes shrinks to
it alone. The result is written to ``OUT``
(default: ``RECORDING`` with ``.min.json``) and its decisions printed.

Exit status: 0 shrunk (or nothing to shrink), 1 the full recording does not fail when
replayed (nothing to shrink from), 2 bad arguments or an unreadable recording.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from runtime import schedule

T = TypeVar("T")
#: a decision: its device and its recorded form [queue, seqno, kind, value]
Item = tuple[str, tuple[Any, ...]]


def ddmin(items: list[T], fails: Callable[[list[T]], bool]) -> list[T]:
    """A 1-minimal failing subset of ``items`` (which must fail): Zeller's ddmin, trying
    ``n`` chunks and their complements, doubling ``n`` when neither fails."""
    n = 2
    while len(items) >= 2:
        size = -(-len(items) // n)
        chunks = [items[i:i + size] for i in range(0, len(items), size)]
        for i, chunk in enumerate(chunks):
            if fails(chunk):
                items, n = chunk, 2
                break
            rest = [x for j, c in enumerate(chunks) if j != i for x in c]
            if len(chunks) > 2 and fails(rest):
                items, n = rest, max(n - 1, 2)
                break
        else:
            if n >= len(items):
                break
            n = min(len(items), 2 * n)
    if len(items) == 1 and fails([]):
        return []
    return items


def shrink(items: list[Item], runner: Runner) -> list[Item]:
    """ddmin over ``items``. A result that holds a ``rank``, or that passes once when
    replayed ``tries`` times more, failed with the host's timing as well: a rank orders
    two packets only when the firmware sees both in one pass, which a replay cannot
    promise (a shrink to two ranks failed 15 runs in a row, then passed the fourth time it
    was replayed). Then the shrink is redone keeping every ``order`` entry of the
    recording, which makes a replay start the packets it lists as they started, and over
    the other decisions only."""
    small = ddmin(items, runner.fails)
    orders = [it for it in items if it[1][2] == "order"]
    if not orders or (all(it[1][2] != "rank" for it in small) and runner.fails(small)):
        return small
    choices = [it for it in items if it[1][2] != "order"]
    return orders + ddmin(choices, lambda subset: runner.fails(orders + subset))


class Runner:
    """Runs the command under a replay of some decisions; counts the runs."""

    def __init__(self, doc: dict[str, Any], command: Sequence[str], tries: int,
                 timeout: float, workdir: str) -> None:
        self.doc, self.command, self.tries, self.timeout = doc, list(command), tries, timeout
        self.workdir = workdir
        self.runs = 0
        env = dict(os.environ)
        for name in (schedule.SCHEDULE_ENV, schedule.RECORD_ENV, schedule.REPLAY_ENV):
            env.pop(name, None)
        self.env = env

    def recording(self, items: Sequence[Item]) -> dict[str, Any]:
        """The recording that keeps only ``items`` (every device stays, maybe empty)."""
        devices: dict[str, Any] = {d: {"decisions": [], "dropped": 0} for d in self.doc["devices"]}
        for dev, decision in items:
            devices[dev]["decisions"].append(list(decision))
        return {**self.doc, "devices": devices}

    def fails(self, items: Sequence[Item]) -> bool:
        """Does the command fail (exit nonzero, or outlive the timeout) in each of
        ``tries`` runs replaying ``items``?"""
        path = os.path.join(self.workdir, "candidate.json")
        write(path, self.recording(items))
        for _ in range(self.tries):
            self.runs += 1
            try:
                code = subprocess.run(self.command, env={**self.env, schedule.REPLAY_ENV: path},
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                      timeout=self.timeout).returncode
            except subprocess.TimeoutExpired:
                code = -1
            if code == 0:
                return False
        return True


def write(path: str, doc: dict[str, Any]) -> None:
    """A recording as ``ACCEL_RECORD`` writes it: one decision a line."""
    with open(path, "w") as f:
        f.write(schedule.dumps(doc))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    argv, command = argv[:split], argv[split + 1:]
    p = argparse.ArgumentParser(
        prog="accel-replay", usage="%(prog)s RECORDING [-o OUT] [--tries N] [--timeout S] "
                                   "-- COMMAND [ARG...]",
        description="Shrink a failing ACCEL_RECORD recording to a minimal schedule: rerun "
                    "COMMAND with ACCEL_REPLAY over subsets of its decisions (failure: a "
                    "nonzero exit).")
    p.add_argument("recording", help="the recording (ACCEL_RECORD's file)")
    p.add_argument("-o", "--output", help="where the shrunk recording goes "
                                          "(default: RECORDING with .min.json)")
    p.add_argument("--tries", type=int, default=3,
                   help="a subset fails only if every one of this many runs fails (default "
                        "3: a subset whose failure depends on the host's timing as well is "
                        "seldom kept)")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="seconds a run may take; one that takes longer failed (default 120)")
    args = p.parse_args(argv)
    if not command:
        p.error("no command: accel-replay RECORDING -- COMMAND [ARG...]")
    if args.tries < 1:
        p.error("--tries must be at least 1")
    try:
        with open(args.recording) as f:
            doc = json.load(f)
        schedule.parse_recording(doc)
    except OSError as exc:
        print(f"accel-replay: {args.recording}: cannot read it: {exc.strerror}", file=sys.stderr)
        return 2
    except (ValueError, TypeError, KeyError, IndexError) as exc:
        print(f"accel-replay: {args.recording}: not an {schedule.FORMAT} recording of "
              f"version {schedule.VERSION}: {exc}", file=sys.stderr)
        return 2
    items: list[Item] = [(dev, tuple(d)) for dev, v in doc["devices"].items()
                         for d in v["decisions"]]
    output = args.output or (args.recording.removesuffix(".json") + ".min.json")
    with tempfile.TemporaryDirectory(prefix="accel-replay-") as workdir:
        runner = Runner(doc, command, args.tries, args.timeout, workdir)
        if not runner.fails(items):
            print(f"accel-replay: {args.recording}: the command does not fail when its "
                  f"{len(items)} decisions are replayed: nothing to shrink", file=sys.stderr)
            return 1
        small = shrink(items, runner)
    write(output, runner.recording(small))
    print(f"{len(items)} decisions -> {len(small)} in {runner.runs} runs: {output}")
    for dev, (queue, seqno, kind, value) in small:
        print(f"  {dev} queue {queue} seqno {seqno}: {kind} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
