"""``accel-exporter``: accel-emu device metrics for Prometheus, as dcgm-exporter serves GPUs'.

``accel-exporter --root DIR --port P [--interval S] [--per-process]`` serves
``http://127.0.0.1:P/metrics`` (prometheus-client's text format, or OpenMetrics when the
scraper asks). Every value comes from the same sysfs reads as ``accel-smi``
(``tools.sysfs_tree``: the tree and its parsers), so the two never disagree, and like it the
exporter never opens a device node: a scrape is not a driver client.

A scrape reads sysfs at most once per ``--interval`` seconds (default 1); scrapes in
between get the same sample, so many scrapers do not multiply the driver's work.

Every per-device series is labelled ``device`` (the index), ``uuid`` and ``name``. The
metric names follow dcgm-exporter's choices (gauges for levels, counters for events) with
an ``accel_`` prefix; docs/tools.md lists them. An attribute a driver lacks
(``utilization``, ``power``...) has no series: absent, not zero.

Who may see what. Every local user can connect to 127.0.0.1, and the exporter reads sysfs
as its own user -- root, typically, who sees every tenant's processes -- so a
per-process series would show every user's pids and device bytes to every other one,
which sysfs ``processes`` itself never does. ``accel_process_memory_bytes{pid}`` is
therefore served only with ``--per-process`` (off by default), as dcgm-exporter's
per-pod attribution is opt-in: the operator who turns it on publishes it.

Connections are bounded (``Server``): an idle or half-sent connection costs a socket, not
a thread; each has ``CONNECTION_TIMEOUT_S`` to send its request and take its answer; at
most ``MAX_CONNECTIONS`` are open, and a new one past that closes the one that has waited
longest for its request, so a crowd of idle connections cannot keep a scrape out. Sysfs is
read on one worker thread. The first version served each connection on a thread of its
own, without a timeout: 400 idle connections held 402 threads, and 6-8 of 200 parallel
scrapes failed.

SIGTERM or SIGINT stops it: the listening socket is closed and it exits 0.
"""

from __future__ import annotations

import argparse
import gzip
import re
import signal
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path

import trio
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder

from abi import faults, uapi
from tools.sysfs_tree import Tree, number, processes, typed

LABELS = ("device", "uuid", "name")

#: (metric, sysfs attribute, help) for the gauges read as the attribute says.
GAUGES = (
    ("accel_memory_used_bytes", "memory_used", "Device memory in use."),
    ("accel_memory_free_bytes", "memory_free", "Device memory free (retired pages are not)."),
    ("accel_memory_total_bytes", "memory_total", "Device memory in all."),
    ("accel_utilization_percent", "utilization",
     "Compute-engine busy time over the last second, percent."),
    ("accel_copy_utilization_percent", "utilization_copy",
     "Copy-engine busy time over the last second, percent."),
    ("accel_temperature_celsius", "temperature", "Device temperature."),
    ("accel_power_watts", "power", "Power draw."),
    ("accel_power_limit_watts", "power_limit", "Power limit."),
    ("accel_clock_mhz", "clock", "Compute clock (lowered while throttled)."),
    ("accel_retired_pages", "retired_pages", "Device memory pages retired after ECC errors."),
    ("accel_contexts", "contexts", "Open contexts."),
    ("accel_clients", "clients", "Processes holding the device open."),
)
#: (metric without its ``_total``, sysfs attribute, help) for the counters.
COUNTERS = (
    ("accel_resets", "reset_count", "Device resets since the driver loaded."),
    ("accel_packets", "packets", "Packets the firmware has completed."),
    ("accel_launches", "launches", "Kernel launches."),
    ("accel_copies", "copies", "Copy-engine transfers."),
    ("accel_copy_bytes", "copy_bytes", "Bytes the copy engines moved."),
    ("accel_faults", "faults", "Engine faults of tenants' work the firmware reported since "
     "the driver loaded (across resets; a diagnostic's own are left out)."),
    ("accel_isolation_refusals", "isolation/total",
     "Requests refused for naming another context's objects."),
)


#: ``accel_device_state``'s value for each ``state`` text (0: one this exporter does not know)
STATE_VALUES = {s.label: s.value for s in uapi.DeviceState}

#: Connections open at once; a new one past this closes the longest-idle one.
MAX_CONNECTIONS = 256
#: Seconds a connection has to send its request and take its answer.
CONNECTION_TIMEOUT_S = 10.0
#: The most a request's head (its request line and headers) may take.
MAX_HEAD_BYTES = 8192
_END_OF_HEAD = re.compile(rb"\r?\n\r?\n")


def device_metrics(tree: Tree, per_process: bool = False) -> list[Metric]:
    """One sample of every metric, for every device the root serves; with
    ``per_process``, the processes' memory as this exporter's user sees it."""
    gauges = {attr: GaugeMetricFamily(metric, text, labels=LABELS)
              for metric, attr, text in GAUGES}
    counters = {attr: CounterMetricFamily(metric, text, labels=LABELS)
                for metric, attr, text in COUNTERS}
    # identity in labels, state in values (as dcgm-exporter): a state change or a reset
    # (the firmware version reads empty while none runs) must not start a new series
    info = GaugeMetricFamily("accel_device_info", "Always 1: the device's identity.",
                             labels=(*LABELS, "pci_bus_id"))
    firmware = GaugeMetricFamily("accel_firmware_info", "Always 1: the firmware that runs "
                                 "(no series while none does).",
                                 labels=(*LABELS, "firmware_version"))
    state = GaugeMetricFamily("accel_device_state", "The device's state: " + ", ".join(
        f"{s.value} {s.label}" for s in uapi.DeviceState) + ", 0 unknown.", labels=LABELS)
    operational = GaugeMetricFamily("accel_device_operational",
                                    "1 while the device is operational, else 0.", labels=LABELS)
    ras = CounterMetricFamily("accel_ras_errors", "ECC/RAS errors per hardware block, "
                              "uncorrectable (ue) and correctable (ce).",
                              labels=(*LABELS, "block", "type"))
    processes_family = GaugeMetricFamily("accel_process_memory_bytes",
                                         "Device memory a process holds.",
                                         labels=(*LABELS, "pid"))
    for name in tree.device_names():
        a = tree.device(name)
        labels = [a.get("index", name[5:]), a.get("uuid", ""), a.get("name", "")]
        info.add_metric([*labels, a.get("pci_bus_id", "")], 1)
        if a.get("firmware_version"):
            firmware.add_metric([*labels, a["firmware_version"]], 1)
        state.add_metric(labels, STATE_VALUES.get(a.get("state", ""), 0))
        operational.add_metric(labels, int(a.get("state") == "operational"))
        for attr, family in (*gauges.items(), *counters.items()):
            value = number(a.get(attr))
            if value is not None:
                family.add_metric(labels, value)
        for block in faults.BLOCKS:
            key = f"ras/{block}_err_count"
            for kind, count in typed(key, a.get(key, "")).items():
                ras.add_metric([*labels, block, kind], count)
        for proc in processes(a.get("processes", "")) if per_process else ():
            processes_family.add_metric([*labels, str(proc["pid"])], proc["used_memory"])
    return [info, firmware, state, operational, *gauges.values(), *counters.values(), ras,
            *([processes_family] if per_process else [])]


class SysfsCollector:
    """A prometheus-client collector over one mount root, reading at most once per
    ``interval`` seconds (a scrape and the next one share the sample)."""

    def __init__(self, tree: Tree, interval: float, per_process: bool = False) -> None:
        self.tree, self.interval, self.per_process = tree, interval, per_process
        self._lock = threading.Lock()
        self._taken = float("-inf")
        self._sample: list[Metric] = []

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            if time.monotonic() - self._taken >= self.interval:
                self._sample = device_metrics(self.tree, self.per_process)
                self._taken = time.monotonic()
            yield from self._sample


class Server:
    """The HTTP endpoint: one trio task per connection, one request per connection
    (answered with ``Connection: close``), bounded as the module's doc says."""

    def __init__(self, registry: CollectorRegistry, max_connections: int = MAX_CONNECTIONS,
                 timeout: float = CONNECTION_TIMEOUT_S) -> None:
        self.registry = registry
        self.max_connections, self.timeout = max_connections, timeout
        self._open = 0
        #: connections still waiting for their request, oldest first
        self._waiting: OrderedDict[trio.CancelScope, None] = OrderedDict()
        self._sysfs = trio.CapacityLimiter(1)  # the one thread that reads sysfs

    async def handle(self, stream: trio.SocketStream) -> None:
        """Serve one connection: read its request head, answer it, close it."""
        async with stream:
            with trio.move_on_after(self.timeout) as scope:
                if not self._admit(scope):
                    return
                self._open += 1
                try:
                    await self._serve(stream, scope)
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    pass  # the client went away
                finally:
                    self._open -= 1
                    self._waiting.pop(scope, None)

    def _admit(self, scope: trio.CancelScope) -> bool:
        """Make room for one more connection by closing the one that has waited longest
        for its request; False if every open connection is being answered."""
        if self._open < self.max_connections:
            return True
        if not self._waiting:
            return False
        oldest, _ = self._waiting.popitem(last=False)
        oldest.cancel()
        return True

    async def _serve(self, stream: trio.SocketStream, scope: trio.CancelScope) -> None:
        self._waiting[scope] = None
        head = await _read_head(stream)
        self._waiting.pop(scope, None)  # (closed for a newer one meanwhile: cancelled)
        if head is None:
            return
        await stream.send_all(await self._answer(head))

    async def _answer(self, head: bytes) -> bytes:
        """The whole response to one request head."""
        lines = head.decode("latin-1").split("\n")
        request = lines[0].strip().split(" ")
        headers = dict(_header(line) for line in lines[1:] if ":" in line)
        if len(request) != 3 or not request[2].startswith("HTTP/1."):
            return _response(400, b"bad request\n")
        method, target, _ = request
        if method not in ("GET", "HEAD"):
            return _response(405, b"only GET and HEAD\n", extra=[("Allow", "GET, HEAD")])
        if target.partition("?")[0] != "/metrics":
            return _response(404, b"metrics are at /metrics\n")
        encoder, content_type = choose_encoder(headers.get("accept", ""))
        try:
            # abandoned on cancel (the deadline, SIGTERM): a read of a hung mount must not
            # hold the connection or the exit; the thread keeps the limiter until it ends
            body = await trio.to_thread.run_sync(encoder, self.registry, limiter=self._sysfs,
                                                 abandon_on_cancel=True)
        except Exception as exc:  # noqa: BLE001 - a failed scrape, not a dead exporter
            return _response(500, f"cannot collect: {exc!r}\n".encode())
        extra = []
        if "gzip" in headers.get("accept-encoding", ""):
            body = gzip.compress(body)
            extra.append(("Content-Encoding", "gzip"))
        return _response(200, body, content_type, extra, head_only=method == "HEAD")


async def _read_head(stream: trio.SocketStream) -> bytes | None:
    """A request's head, up to its blank line; None if the client closed first or sent
    more than ``MAX_HEAD_BYTES`` without one."""
    buf = bytearray()
    while (end := _END_OF_HEAD.search(buf)) is None:
        if len(buf) > MAX_HEAD_BYTES:
            return None
        chunk = await stream.receive_some(4096)
        if not chunk:
            return None
        buf += chunk
    return bytes(buf[:end.start()])


def _header(line: str) -> tuple[str, str]:
    name, _, value = line.partition(":")
    return name.strip().lower(), value.strip()


_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            500: "Internal Server Error"}


def _response(status: int, body: bytes, content_type: str = "text/plain; charset=utf-8",
              extra: Sequence[tuple[str, str]] = (), head_only: bool = False) -> bytes:
    fields = [("Content-Type", content_type), ("Content-Length", str(len(body))),
              ("Connection", "close"), *extra]
    lines = [f"HTTP/1.1 {status} {_REASONS[status]}", *(f"{k}: {v}" for k, v in fields)]
    return "\r\n".join([*lines, "", ""]).encode("latin-1") + (b"" if head_only else body)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="accel-exporter", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", type=Path, default=None,
                   help="mount root (default: $ACCEL_EMU_ROOT or the per-user default)")
    p.add_argument("--port", type=int, required=True, help="TCP port on 127.0.0.1")
    p.add_argument("--interval", type=float, default=1.0,
                   help="seconds a sysfs sample serves scrapes (default 1)")
    p.add_argument("--per-process", action="store_true",
                   help="serve accel_process_memory_bytes{pid}: every process this user "
                        "sees (root: every user's), to every local user (default: off)")
    return p


async def serve(server: Server, port: int) -> int:
    """Listen on 127.0.0.1:``port`` and serve until SIGTERM or SIGINT; then close the
    socket and return 0 (1 if the port cannot be had)."""
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        try:
            listeners = await trio.open_tcp_listeners(port, host="127.0.0.1")
        except OSError as exc:
            print(f"accel-exporter: cannot listen on 127.0.0.1:{port}: {exc.strerror}",
                  file=sys.stderr)
            return 1
        async with trio.open_nursery() as nursery:
            await nursery.start(trio.serve_listeners, server.handle, listeners)
            print(f"accel-exporter: serving http://127.0.0.1:{port}/metrics", flush=True)
            async for _ in signals:
                nursery.cancel_scope.cancel()
                break
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Serve until SIGTERM or SIGINT, then close the socket and exit 0."""
    args = parser().parse_args(argv)
    if args.interval < 0:
        parser().error("--interval is a number of seconds, 0 or more")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SysfsCollector(Tree(args.root or Path(uapi.default_root())),
                                     args.interval, args.per_process))
    return trio.run(serve, Server(registry), args.port)


if __name__ == "__main__":
    sys.exit(main())
