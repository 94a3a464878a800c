"""``Bystander``: the tenant an attack must not touch. Its data must stay intact and its
work must keep running through whatever an attacker does; every containment check asks
it (``check``) after the attack."""

from __future__ import annotations

from testkit.daemon import Daemon
from testkit.procs import close_child

_BYSTANDER = """
import sys, numpy as np, runtime
dev = int(sys.argv[1])
rng = np.random.default_rng(dev + 7)
pattern = rng.integers(0, 255, 4 << 20, dtype=np.uint8)
s = runtime.Stream(dev)
keep = runtime.to_device(pattern, device=dev, stream=s)
pin = runtime.pinned_empty(pattern.shape, np.uint8, device=dev)
s.synchronize()
print("ready", flush=True)
for line in sys.stdin:
    try:
        keep.copy_to_host(pin, stream=s)
        scratch = runtime.empty(pattern.shape, np.uint8, device=dev, stream=s)
        scratch.copy_(keep, stream=s)
        back = scratch.copy_to_host(stream=s)
        s.synchronize(timeout=30)
        ok = np.array_equal(pin, pattern) and np.array_equal(back, pattern)
        print("ok" if ok else "corrupt", flush=True)
    except Exception as exc:
        print(f"error {exc!r}", flush=True)
"""


class Bystander:
    """Another tenant on device ``dev``: its data must stay intact and its work must run
    through whatever an attacker does. It holds nothing on the other devices (the runtime
    opens only the devices a process uses), so another process may hold those
    exclusively; ``alone``: it does not even see them (``ACCEL_VISIBLE_DEVICES``)."""

    def __init__(self, d: Daemon, dev: int = 0, alone: bool = False) -> None:
        self.proc = (d.popen_py(_BYSTANDER, "0", ACCEL_VISIBLE_DEVICES=str(dev)) if alone
                     else d.popen_py(_BYSTANDER, str(dev)))
        line = self.proc.stdout.readline().strip()
        if line != "ready":
            self.close()
            raise AssertionError(f"bystander did not start: {line!r} {self.proc.stderr.read()}")
        # one round before anyone takes a snapshot: what its checks create lazily (staging
        # buffers, the firmware's copies of their descriptors) is then part of the baseline
        # (without it, a snapshot under load could miss one descriptor that came later)
        self.check()

    def check(self) -> None:
        assert self.proc.poll() is None, "the bystander died"
        self.proc.stdin.write("check\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline().strip()
        assert answer == "ok", f"bystander: {answer!r}"

    def close(self) -> None:
        close_child(self.proc)

    def __enter__(self) -> Bystander:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["Bystander"]
