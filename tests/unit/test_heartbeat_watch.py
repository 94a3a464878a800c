"""The driver's heartbeat watchdog (kmod_emul/watch.py) counts only the time the host let
the firmware run: a firmware starved of CPU by other processes is not a hung firmware.
The host's per-thread run-queue delays come from a /proc tree of the test's own; the
device is a stand-in with a heartbeat word and a failure recorder (the watchdog's
neighbours), on trio's mock clock."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import trio
import trio.testing

from kmod_emul import watch
from kmod_emul.watch import MAX_STARVED_TIMEOUTS, Starvation

pytestmark = pytest.mark.timeout(60)

PID = 4242
TIMEOUT = 2.0


class Host:
    """A fake /proc with the firmware's threads and their run-queue delays (ns)."""

    def __init__(self, root: Path) -> None:
        self.tasks = root / str(PID) / "task"
        self.tasks.mkdir(parents=True)

    def set(self, tid: int, delay_s: float) -> None:
        (self.tasks / str(tid)).mkdir(exist_ok=True)
        (self.tasks / str(tid) / "schedstat").write_text(f"1000 {int(delay_s * 1e9)} 7\n")

    def delay(self, tid: int) -> float:
        return int((self.tasks / str(tid) / "schedstat").read_text().split()[1]) / 1e9

    def exit(self, tid: int) -> None:
        (self.tasks / str(tid) / "schedstat").unlink()
        (self.tasks / str(tid)).rmdir()


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Host:
    monkeypatch.setattr(watch, "PROC", tmp_path)
    return Host(tmp_path)


def test_starvation_counts_the_longest_wait_of_any_thread_at_most_the_interval(host: Host):
    host.set(1, 0.0)
    host.set(2, 0.0)
    s = Starvation(PID)
    assert s.sample(0.0) == 0.0
    host.set(1, 0.3)  # both waited, side by side: counted once, the longer
    host.set(2, 0.5)
    assert s.sample(1.0) == pytest.approx(0.5)
    host.set(1, 5.3)  # more than the interval: at most the interval
    assert s.sample(1.0) == pytest.approx(1.5)
    host.exit(1)      # an exited thread counts nothing more, a new one from its start
    host.set(3, 9.0)
    assert s.sample(1.0) == pytest.approx(1.5)
    host.set(3, 9.2)
    assert s.sample(1.0) == pytest.approx(1.7)


def test_no_proc_tree_counts_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(watch, "PROC", tmp_path / "absent")
    assert Starvation(PID).sample(1.0) == 0.0


def _device(beats: list[int]) -> SimpleNamespace:
    failed: list[tuple[float, str]] = []
    dev = SimpleNamespace(
        fw=SimpleNamespace(pid=PID, mbx=SimpleNamespace(heartbeat=beats)),
        heartbeat_timeout_s=TIMEOUT, recovery="auto", failed=failed)
    dev.resets = SimpleNamespace(
        fail_running=lambda _errno, text, _code: failed.append((trio.current_time(), text)))
    return dev


def _run(dev: SimpleNamespace, host: Host, starve_until: float, beat_until: float = 0.0,
         limit: float = 60.0) -> float | None:
    """Run the watchdog with the firmware beating until ``beat_until`` and its thread
    waiting for a CPU the whole time until ``starve_until``; when it failed the device
    (mock seconds), or None."""
    host.set(1, 0.0)

    async def main() -> float | None:
        with trio.move_on_after(limit):
            async with trio.open_nursery() as nursery:
                scope = trio.CancelScope()

                async def host_side() -> None:
                    while True:
                        await trio.sleep(0.05)
                        now = trio.current_time()
                        if now < beat_until:
                            dev.fw.mbx.heartbeat[0] += 1
                        if now < starve_until:
                            host.set(1, host.delay(1) + 0.05)

                nursery.start_soon(host_side)
                with scope:
                    await watch.watch_heartbeat(dev, scope)
                nursery.cancel_scope.cancel()
        return dev.failed[0][0] if dev.failed else None

    return trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_silent_firmware_that_had_the_cpu_is_failed_after_the_timeout(host: Host):
    dev = _device([0])
    at = _run(dev, host, starve_until=0.0, beat_until=1.0)
    assert at is not None and 1.0 + TIMEOUT < at < 1.0 + TIMEOUT + 0.3
    assert re.fullmatch(r"firmware stopped heart-beating \(none for 2\.\d s, 0\.0 s of it "
                        r"waiting for a CPU\)", dev.failed[0][1]), dev.failed


def test_a_firmware_starved_of_cpu_is_not_failed_while_it_waits(host: Host):
    """Silent for 6 s, all of it in the run queue: alive. Once it has the CPU again and
    still says nothing, the timeout runs from there."""
    dev = _device([0])
    at = _run(dev, host, starve_until=6.0, beat_until=1.0)
    assert at is not None and 6.0 + TIMEOUT - 0.2 < at < 6.0 + TIMEOUT + 0.3


def test_a_firmware_starved_for_ever_is_failed_after_the_wall_clock_bound(host: Host):
    dev = _device([0])
    at = _run(dev, host, starve_until=1e9, beat_until=1.0)
    assert at is not None
    assert 1.0 + MAX_STARVED_TIMEOUTS * TIMEOUT < at < 1.0 + MAX_STARVED_TIMEOUTS * TIMEOUT + 0.3


def test_a_beating_firmware_is_never_failed(host: Host):
    dev = _device([0])
    assert _run(dev, host, starve_until=0.0, beat_until=1e9, limit=30.0) is None
