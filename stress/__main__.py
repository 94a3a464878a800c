"""``python -m stress [--only NAME] [--seed N] [--scale X]``: every attacker, long.

Starts its own 2-device daemon (in a temporary directory, with the shipped firmware image)
for each attacker module of this package -- every module with a ``run(d, *, count, seed)``
function, found at run time -- and runs it with ``count = STRESS_COUNT * scale`` (the
module's long-run count; ``DEFAULT_COUNT`` if it names none). Prints each Report line and
a summary; exits 1 if any Report is not ok (or an attacker raised). The daemon is always
stopped. ``make stress`` runs it at scale 1.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import ModuleType

import stress
from firmware.image import IMAGE_DIR
from testkit.daemon import Daemon

#: Count for an attacker module that defines no STRESS_COUNT.
DEFAULT_COUNT = 1000
#: Modules of the package that are not attackers even if they grew a ``run``.
NOT_ATTACKERS = {"report"}


def attackers() -> dict[str, ModuleType]:
    """name -> module, for every module of the package with a callable ``run``."""
    found = {}
    for info in sorted(pkgutil.iter_modules(stress.__path__), key=lambda i: i.name):
        if info.name.startswith("_") or info.name in NOT_ATTACKERS:
            continue
        mod = importlib.import_module(f"stress.{info.name}")
        if callable(getattr(mod, "run", None)):
            found[info.name] = mod
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stress", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", action="append", default=[], metavar="NAME",
                        help="run only this attacker (repeatable, or comma-separated)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--scale", type=float, default=1.0,
                        help="multiply every attacker's STRESS_COUNT by this")
    parser.add_argument("--list", action="store_true", help="list the attackers and exit")
    parser.add_argument("--keep", action="store_true",
                        help="keep the work directory (the daemons' logs and state)")
    args = parser.parse_args(argv)
    found = attackers()
    if args.list:
        for name, mod in found.items():
            print(f"{name}: STRESS_COUNT {getattr(mod, 'STRESS_COUNT', DEFAULT_COUNT):,}")
        return 0
    only = [n for item in args.only for n in item.split(",") if n]
    unknown = sorted(set(only) - set(found))
    if unknown:
        print(f"stress: no attacker {', '.join(unknown)}; there are {', '.join(found)}",
              file=sys.stderr)
        return 2
    chosen = {n: m for n, m in found.items() if not only or n in only}
    lines: list[str] = []
    failed: list[str] = []
    t0 = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="accel-stress-"))
    tmp.chmod(0o755)  # other users reach the roots: the attackers' uid 65534 tenants
    try:
        for i, (name, mod) in enumerate(chosen.items()):
            count = max(1, round(getattr(mod, "STRESS_COUNT", DEFAULT_COUNT) * args.scale))
            # a daemon of its own per attacker (one that broke a device must not fail the
            # next), sharing the state directory (its JIT cache)
            d = Daemon(tmp / f"root{i}", tmp / "state", IMAGE_DIR, 2)
            print(f"stress: {name}, {count:,} at seed {args.seed} ...", flush=True)
            try:
                d.start()
                rep = mod.run(d, count=count, seed=args.seed)
            except Exception:  # noqa: BLE001 - an attacker that raised is a failed attacker
                line = f"{name}: raised\n{traceback.format_exc()}"
                failed.append(name)
            else:
                line = rep.line()
                if not rep.ok:
                    failed.append(name)
                    line += "".join(f"\n    {n}" for n in rep.notes[:20])
            finally:
                d.stop()
            print(line, flush=True)
            lines.append(line.splitlines()[0])
    finally:
        if args.keep:
            print(f"stress: work directory kept: {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"\nstress: {len(chosen)} attacker(s) at seed {args.seed}, scale {args.scale:g}, "
          f"{time.monotonic() - t0:.0f} s")
    for line in lines:
        print(f"  {line}")
    if failed:
        print(f"stress: NOT OK: {', '.join(failed)}")
        return 1
    print("stress: all ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
