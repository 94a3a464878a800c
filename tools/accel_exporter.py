"""``accel-exporter``: accel-emu device metrics for Prometheus, as dcgm-exporter serves GPUs'.

``accel-exporter --root DIR --port P [--interval S]`` serves ``http://127.0.0.1:P/metrics``
(prometheus-client's text format). Every value comes from the same sysfs reads as
``accel-smi`` (``tools.accel_smi.Tree`` and its parsers), so the two never disagree, and
like it the exporter never opens a device node: a scrape is not a driver client.

A scrape reads sysfs at most once per ``--interval`` seconds (default 1); scrapes in
between get the same sample, so many scrapers do not multiply the driver's work.

Every per-device series is labelled ``device`` (the index), ``uuid`` and ``name``. The
metric names follow dcgm-exporter's choices (gauges for levels, counters for events) with
an ``accel_`` prefix; docs/tools.md lists them. An attribute a driver lacks
(``utilization``, ``power``...) has no series: absent, not zero.

SIGTERM or SIGINT stops it: the listening socket is closed and it exits 0.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from abi import faults, uapi
from tools.accel_smi import Tree, number, processes, typed

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
    ("accel_faults", "faults", "Engine faults the firmware reported."),
    ("accel_isolation_refusals", "isolation/total",
     "Requests refused for naming another context's objects."),
)


def device_metrics(tree: Tree) -> list[Metric]:
    """One sample of every metric, for every device the root serves."""
    gauges = {attr: GaugeMetricFamily(metric, text, labels=LABELS)
              for metric, attr, text in GAUGES}
    counters = {attr: CounterMetricFamily(metric, text, labels=LABELS)
                for metric, attr, text in COUNTERS}
    info = GaugeMetricFamily("accel_device_info", "Always 1: the device's identity and state.",
                             labels=(*LABELS, "pci_bus_id", "firmware_version", "state"))
    operational = GaugeMetricFamily("accel_device_operational",
                                    "1 while the device is operational, else 0.", labels=LABELS)
    ras = CounterMetricFamily("accel_ras_errors", "ECC/RAS errors per hardware block, "
                              "uncorrectable (ue) and correctable (ce).",
                              labels=(*LABELS, "block", "type"))
    per_process = GaugeMetricFamily("accel_process_memory_bytes",
                                    "Device memory a process holds.", labels=(*LABELS, "pid"))
    for name in tree.device_names():
        a = tree.device(name)
        labels = [a.get("index", name[5:]), a.get("uuid", ""), a.get("name", "")]
        info.add_metric([*labels, a.get("pci_bus_id", ""), a.get("firmware_version", ""),
                         a.get("state", "unknown")], 1)
        operational.add_metric(labels, int(a.get("state") == "operational"))
        for attr, family in (*gauges.items(), *counters.items()):
            value = number(a.get(attr))
            if value is not None:
                family.add_metric(labels, value)
        for block in faults.BLOCKS:
            key = f"ras/{block}_err_count"
            for kind, count in typed(key, a.get(key, "")).items():
                ras.add_metric([*labels, block, kind], count)
        for proc in processes(a.get("processes", "")):
            per_process.add_metric([*labels, str(proc["pid"])], proc["used_memory"])
    return [info, operational, *gauges.values(), *counters.values(), ras, per_process]


class SysfsCollector:
    """A prometheus-client collector over one mount root, reading at most once per
    ``interval`` seconds (a scrape's thread and the next scrape's share the sample)."""

    def __init__(self, tree: Tree, interval: float) -> None:
        self.tree, self.interval = tree, interval
        self._lock = threading.Lock()
        self._taken = float("-inf")
        self._sample: list[Metric] = []

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            if time.monotonic() - self._taken >= self.interval:
                self._sample = device_metrics(self.tree)
                self._taken = time.monotonic()
            yield from self._sample


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="accel-exporter", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", type=Path, default=None,
                   help="mount root (default: $ACCEL_EMU_ROOT or the per-user default)")
    p.add_argument("--port", type=int, required=True, help="TCP port on 127.0.0.1")
    p.add_argument("--interval", type=float, default=1.0,
                   help="seconds a sysfs sample serves scrapes (default 1)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Serve until SIGTERM or SIGINT, then close the socket and exit 0."""
    args = parser().parse_args(argv)
    if args.interval < 0:
        parser().error("--interval is a number of seconds, 0 or more")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SysfsCollector(Tree(args.root or Path(uapi.default_root())),
                                     args.interval))
    try:
        server, thread = start_http_server(args.port, addr="127.0.0.1", registry=registry)
    except OSError as exc:
        print(f"accel-exporter: cannot listen on 127.0.0.1:{args.port}: {exc.strerror}",
              file=sys.stderr)
        return 1
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(f"accel-exporter: serving http://127.0.0.1:{args.port}/metrics", flush=True)
    while not stop.wait(1.0):
        pass
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
