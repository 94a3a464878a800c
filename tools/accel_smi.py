"""``accel-smi``: show and reset accel-emu devices, like ``nvidia-smi``.

Every query reads only the one-value attribute files under ``ROOT/sys`` (the driver's
sysfs). It never opens a device node: an open is a driver client (it shows in
``open_files``/``clients``, can be refused by an exclusive owner, and would make a
monitoring loop part of the workload it watches). The only write is ``-r``, which writes
``1`` to ``sys/class/accel/accelN/reset``, as root would on Linux.

Modes (one at a time; an option another mode would ignore is an error, exit 2): the
default table (devices, then their processes); ``-L`` one line per device; ``-q`` every
attribute, grouped (``-d`` picks sections); ``-x`` (or ``-q -x``) the same as XML;
``--json``; ``--query-device=FIELDS`` (or ``--query-gpu``) and
``--query-compute-apps[=FIELDS]``, with ``--format=csv[,noheader][,nounits]``;
``--query-retired-pages[=FIELDS]``, one csv row per bad page (retired, pending or failed),
as nvidia-smi's; ``--version``; ``-r`` reset. ``-l SEC`` repeats a query every SEC
seconds until SIGINT (exit 0; a csv header comes once). ``-i`` selects devices by physical
index, UUID (or a unique prefix, such as the short UUID in the table) or PCI bus id; a
comma-separated list selects several. Under ``--json`` every error is also a JSON object
on stdout, ``{"error": {"message": ..., "exit_code": N}}``.
``accel-smi dmon`` and ``accel-smi pmon`` (``-c COUNT``, ``-d SEC``, ``-i``) print live
rows, one per device, or per process, per sample, as ``nvidia-smi dmon``/``pmon`` do.
``accel-smi partition -i N [--mode K]`` shows a device's compute partition mode, the modes
it offers and its partitions, or (``--mode``, root, only while no process holds the
device or a partition of it) splits it into K partitions, 1 making it whole again
(docs/partitions.md).
``ACCEL_VISIBLE_DEVICES`` is ignored, as ``nvidia-smi`` ignores ``CUDA_VISIBLE_DEVICES``:
the tool reports the machine, not one process's view of it.

Units: memory is shown in MiB. In csv, as in ``nvidia-smi``, a field with a unit gets it
in the header (``memory.total [MiB]``) and after the value (``256 MiB``); ``nounits``
drops it from the values. Values are separated by ", " and, unlike in ``nvidia-smi``, a
value that contains a comma or a quote (a failure text may) is quoted as in RFC 4180.

Attributes a driver may lack (``utilization``, ``utilization_copy``, ``power``,
``power_limit``, ``fdinfo``) show as N/A (null in JSON, ``-`` in dmon/pmon) where it does.

Exit codes (``nvidia-smi``'s, which are NVML's, where it has one):
  0  success: every selected device is operational
  1  a reset ended with the device failed, or did not finish in time; other I/O errors
  2  invalid argument: unknown field, no device matches ``-i``, ``-r`` without ``-i``
  4  permission denied (writing ``reset``)
  6  no devices were found (no accel-emud serves the root, or it has no device)
  15 a selected device is not operational (failed, resetting, booting): the query's output
     is printed all the same, and stderr names the devices, so that ``accel-smi -L`` is a
     health gate a CI or a scheduler can rely on
  19 ``-r`` refused: another process has the device, or a partition of it, open (NVML's
     "in use"; a split device's reset resets its partitions); ``--force``
     resets it anyway, and those processes lose their contexts; ``partition --mode``
     refused: a process holds the device or one of its partitions
  141 stdout was closed early (``accel-smi -q | head -1``): the status of a tool killed by
     SIGPIPE, without a traceback
"""

from __future__ import annotations

import argparse
import errno
import importlib.metadata
import json
import os
import re
import signal
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tabulate import tabulate

from abi import faults, uapi
from tools.nvsmi_fields import NOT_SUPPORTED, NVSMI_GPU_FIELDS
from tools.sysfs_tree import (Tree, UsageError, fdinfo, number, page_rows, process_name,
                              processes, select, typed)

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_PERMISSION = 4
EXIT_NO_DEVICES = 6
EXIT_NOT_OPERATIONAL = 15
EXIT_IN_USE = 19
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE

NO_DEVICES = "No devices were found"
MIB = 1 << 20
RESET_TIMEOUT_S = 30.0

#: Attributes a driver may not have yet (busy time, power, DRM fdinfo): where the file is
#: missing they show as N/A (``-q``, csv, the table), null (``--json``), ``-`` (dmon), so
#: that a script's columns and keys do not depend on the driver's age.
OPTIONAL_ATTRS = ("utilization", "utilization_copy", "power", "power_limit", "fdinfo")

#: ``-q`` sections. An attribute not listed here still shows, under "Other", so a new
#: driver attribute is never hidden by an older accel-smi.
SECTIONS: dict[str, tuple[str, ...]] = {
    "Identity": ("name", "index", "uuid", "serial", "pci_bus_id", "numa_node", "package_id",
                 "partition_id", "fabric_endpoint"),
    "Versions": ("driver_version", "firmware_version", "isa_version", "isa_stepping"),
    "State": ("state", "failure", "failure_code", "reset_count", "reset_reason", "last_reset",
              "last_failure", "last_failure_time", "heartbeat"),
    "Memory": ("memory_total", "memory_used", "memory_free", "memory_reserved",
               "managed_resident",
               "managed_faults", "managed_bytes_to_device", "managed_bytes_to_host",
               "managed_evictions"),
    "Compute": ("compute_engines", "copy_engines", "max_threads_per_block",
                "max_shared_mem_per_block", "max_contexts", "capabilities"),
    "Clients": ("contexts", "open_files", "clients", "exclusive_owner", "processes",
                "fdinfo"),
    "Utilization": ("utilization", "utilization_copy"),
    "Engines": ("completions", "packets", "copies", "copy_bytes", "launches", "faults",
                "preemptions", "copy_engines_busy_peak", "jit_compiles", "jit_hits"),
    "Temperature": ("temperature", "throttle_reasons"),
    "Power": ("power", "power_limit"),
    "Clocks": ("clock",),
    "Link": ("link_state",),
    "ECC": tuple(f"ras/{block}_err_count" for block in faults.BLOCKS),
    "Retired Pages": ("retired_pages", "bad_pages", "ras/bad_page_details"),
    # the fault log, one row per record (show_errors); never raw under "Other"
    "Errors": ("fault_log",),
    # the dump itself is one JSON document: -q says whether one is held, --json has it
    "Coredump": ("devcoredump/time", "devcoredump/data"),
}

#: ``-d`` names (nvidia-smi's, and ours for the rest) -> the ``-q`` sections they show.
DISPLAY: dict[str, tuple[str, ...]] = {
    "IDENTITY": ("Identity",), "VERSIONS": ("Versions",), "STATE": ("State",),
    "MEMORY": ("Memory",), "UTILIZATION": ("Utilization", "Engines"),
    "COMPUTE": ("Compute",), "POWER": ("Power",),
    "PIDS": ("Clients",), "TEMPERATURE": ("Temperature",), "CLOCK": ("Clocks",),
    "LINK": ("Link",), "ECC": ("ECC",), "PAGE_RETIREMENT": ("Retired Pages",),
    "ERRORS": ("Errors",), "COREDUMP": ("Coredump",),
}
#: Fault-record fields the ERRORS section shows, in order (the JSON has them all);
#: ``origin`` tells a diagnostic's records (``diag``) and requested resets from faults.
ERROR_COLUMNS = ("seq", "time", "code", "name", "severity", "scope", "action", "pid",
                 "context", "engine", "queue", "address", "bank", "link", "origin")


# --- the tree is read and parsed by tools/sysfs_tree.py; units ----------------------------


def mib(value: str) -> str:
    try:
        return f"{round(int(value) / MIB)}"
    except ValueError:
        return "N/A"


# --- the output modes ------------------------------------------------------------------------
def _na(value: str | None) -> str:
    return value if value else "N/A"


def _state(attrs: dict[str, str]) -> str:
    state = attrs.get("state", "unknown")
    if state == "failed" and attrs.get("failure_code"):
        return f"{state} ({attrs['failure_code']})"
    return state


#: What a non-operational state without a failure of its own means to the reader.
_STATE_HELP = {
    "in_reset": "resetting; usable again once its state is operational",
    "booting": "firmware is booting",
}


def _problem(attrs: dict[str, str], label: str) -> str:
    """Why a device is not operational, in one line (the driver's failure text verbatim).

    A reset clears the driver's ``failure``, so only a failed device carries one.
    """
    state = attrs.get("state", "unknown")
    code = f" [{attrs['failure_code']}]" if attrs.get("failure_code") else ""
    failure = attrs.get("failure", "")
    if state == "failed":
        return f"{label}: failed{code}: {failure}"
    return f"{label}: {state}: {_STATE_HELP.get(state, 'not operational')}"


def show_table(tree: Tree, devices: list[str]) -> str:
    """The default view: a header line, one row per device, then why any device is down."""
    drv = tree.driver()
    lines = [f"accel-smi   Driver Version: {_na(drv.get('version'))}   "
             f"ABI Version: {_na(drv.get('abi_version'))}   Root: {tree.root}"]
    rows, problems = [], []
    for name in devices:
        a = tree.device(name)
        rows.append([
            a.get("index", name[5:]), a.get("name", ""), a.get("uuid", "")[:14],
            a.get("pci_bus_id", ""), _na(a.get("firmware_version")),
            f"{mib(a.get('memory_used', ''))}MiB / {mib(a.get('memory_total', ''))}MiB",
            _with_unit(a.get("temperature"), "C"), _with_unit(a.get("power"), "W"),
            _with_unit(a.get("utilization"), "%"), a.get("contexts", ""), _state(a),
        ])
        if a.get("state") != "operational":
            problems.append(_problem(a, f"accel {a.get('index', name[5:])}"))
    headers = ["Idx", "Name", "UUID", "Bus-Id", "Firmware", "Memory-Usage", "Temp", "Pwr",
               "Util", "Ctx", "State"]
    lines.append(tabulate(rows, headers=headers, tablefmt="psql", disable_numparse=True))
    lines.extend(problems)
    lines += ["", "Processes:", show_process_table(compute_apps(tree, devices))]
    return "\n".join(lines)


def _with_unit(value: str | None, unit: str) -> str:
    """A table cell: the value and its unit, or N/A for an attribute the driver lacks."""
    return f"{value}{unit}" if value not in (None, "") else "N/A"


def compute_apps(tree: Tree, devices: list[str]) -> list[dict[str, str]]:
    """One row per process holding memory on each device (those its ``processes``
    attribute lets this user see), with the device's identity: the rows of the table's
    Processes section and of ``--query-compute-apps``."""
    apps = []
    for name in devices:
        ident = {k: tree.attr(name, k) for k in ("index", "name", "uuid", "pci_bus_id")}
        for proc in processes(tree.attr(name, "processes")):
            apps.append({**ident, "pid": str(proc["pid"]),
                         "process_name": process_name(proc["pid"]),
                         "used_memory": str(proc["used_memory"])})
    return apps


def _process_lines(value: str) -> str:
    """``-q``'s processes: ``PID NAME N MiB`` per process, as nvidia-smi's ``-q`` names
    each process; ``None`` without one."""
    rows = [f"{p['pid']} {process_name(p['pid'])} {mib(str(p['used_memory']))} MiB"
            for p in processes(value)]
    return "\n".join(rows) or "None"


def show_process_table(apps: list[dict[str, str]]) -> str:
    """The table's bottom part, as nvidia-smi's: device, pid, name, memory used."""
    if not apps:
        return "  No running processes found"
    rows = [[a["index"], a["pid"], a["process_name"], f"{mib(a['used_memory'])}MiB"]
            for a in apps]
    return tabulate(rows, headers=["Idx", "PID", "Process name", "Used Memory"],
                    tablefmt="psql", disable_numparse=True)


def show_list(tree: Tree, devices: list[str]) -> str:
    """``-L``: ``accel 0: Accel-Emu A1 (UUID: ACCEL-...)``, as ``nvidia-smi -L``."""
    out = []
    for name in devices:
        a = tree.device(name)
        out.append(f"accel {a.get('index', name[5:])}: {a.get('name', '')} "
                   f"(UUID: {a.get('uuid', '')})")
    return "\n".join(out)


def parse_display(spec: str | None) -> tuple[str, ...] | None:
    """``-d MEMORY,ERRORS`` -> the sections to show (None: all of them)."""
    if spec is None:
        return None
    shown: list[str] = []
    for name in (n.strip().upper() for n in spec.split(",")):
        if name not in DISPLAY:
            raise UsageError(f"-d: no section {name!r}; the sections are "
                             f"{', '.join(DISPLAY)}")
        shown += DISPLAY[name]
    return tuple(shown)


def fault_records(attrs: dict[str, str]) -> list[dict[str, Any]]:
    """A device's ``fault_log`` as records (a line that does not parse is skipped)."""
    return faults.from_lines(attrs.get("fault_log", ""))


def show_errors(attrs: dict[str, str], indent: str) -> list[str]:
    """The Errors section: one row per fault record, oldest first."""
    records = fault_records(attrs)
    if not records:
        return [f"{indent}None"]
    rows = [[_cell(k, r.get(k)) for k in ERROR_COLUMNS] for r in records]
    table = tabulate(rows, headers=ERROR_COLUMNS, tablefmt="plain", disable_numparse=True)
    return [indent + line for line in table.splitlines()]


def _cell(key: str, value: Any) -> str:
    if value is None:
        return "-"
    if key == "time":
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(value)))
    if key == "address":
        return f"{int(value):#x}"
    return str(value)


def show_query(tree: Tree, devices: list[str], only: tuple[str, ...] | None = None) -> str:
    """``-q``: every attribute of each device as ``key : value``, grouped in sections
    (``only``: just those sections, from ``-d``)."""
    drv = tree.driver()
    width = 34  # "        " + the longest attribute name, max_shared_mem_per_block
    out = [f"{'Driver Version':<{width}}: {_na(drv.get('version'))}",
           f"{'ABI Version':<{width}}: {_na(drv.get('abi_version'))}",
           f"{'Attached Devices':<{width}}: {len(tree.device_names())}"]
    for name in devices:
        a = {**dict.fromkeys(OPTIONAL_ATTRS, ""), **tree.device(name)}  # missing: N/A
        out += ["", f"accel {a.get('index', name[5:])} ({_na(a.get('pci_bus_id'))})"]
        grouped = {attr for attrs in SECTIONS.values() for attr in attrs}
        sections = {**SECTIONS, "Other": tuple(k for k in a if k not in grouped)}
        for title, attrs in sections.items():
            present = [k for k in attrs if k in a]
            if not present or (only is not None and title not in only):
                continue
            out.append(f"    {title}")
            if title == "Errors":
                out += show_errors(a, " " * 8)
                continue
            for k in present:
                value = _na(a[k])
                if k == "devcoredump/data":
                    value = (f"held, {len(a[k])} bytes (read sys/class/accel/{name}/"
                             "devcoredump/data)") if a[k] else "N/A"
                if k.startswith("memory_") and a[k].isdigit():
                    value = f"{mib(a[k])} MiB ({a[k]} bytes)"
                if k == "processes":
                    value = _process_lines(a[k])
                first, *more = value.splitlines()  # a table: its rows under the first
                out.append(f"        {k:<{width - 8}}: {first}")
                out += [" " * (width + 2) + line for line in more]
    return "\n".join(out)


def show_json(tree: Tree, devices: list[str]) -> str:
    """``--json``: driver attributes and every device attribute, typed."""
    doc = {
        "root": str(tree.root),
        "driver": {k: typed(k, v) for k, v in tree.driver().items()},
        "devices": [_typed_device(tree.device(n)) for n in devices],
    }
    return json.dumps(doc, indent=2)


def _typed_device(attrs: dict[str, str]) -> dict[str, Any]:
    """A device's attributes for JSON; its fault log as a list of records."""
    doc = {k: typed(k, v) for k, v in attrs.items() if k != "fault_log"}
    doc.update({k: None for k in OPTIONAL_ATTRS if k not in attrs})
    doc["fault_log"] = fault_records(attrs)
    if "devcoredump/data" in attrs:  # root's: a held dump as the document it is
        doc["devcoredump/data"] = json.loads(attrs["devcoredump/data"] or "null")
    return doc


#: The element of each item of a list-valued attribute in ``-x`` (others: ``item``).
_XML_ITEMS = {"processes": "process_info", "fault_log": "fault", "fdinfo": "client",
              "bad_pages": "page", "bad_page_details": "page", "capabilities": "capability"}


def show_xml(tree: Tree, devices: list[str]) -> str:
    """``-x``: nvidia-smi's ``-q -x`` shape, built from ``--json``'s typed values, so the
    two never disagree: ``accel_smi_log``, the driver, then one ``device`` element per
    device holding one element per attribute (N/A where it has none)."""
    log = ET.Element("accel_smi_log")
    ET.SubElement(log, "timestamp").text = time.strftime("%a %b %d %H:%M:%S %Y")
    _xml_add(log, "driver", {k: typed(k, v) for k, v in tree.driver().items()})
    ET.SubElement(log, "attached_devices").text = str(len(tree.device_names()))
    for name in devices:
        doc = _typed_device(tree.device(name))
        if "devcoredump/data" in doc:  # a document of its own: kept as its JSON text
            doc["devcoredump/data"] = json.dumps(doc["devcoredump/data"])
        dev = ET.SubElement(log, "device", id=name, index=str(doc.get("index", name[5:])))
        for key, value in doc.items():
            _xml_add(dev, key, value)
    ET.indent(log)
    return ET.tostring(log, encoding="unicode", xml_declaration=True)


def _xml_add(parent: ET.Element, key: str, value: Any) -> None:
    """``value`` as the element ``key`` under ``parent``: a path (``ras/memory_err_count``)
    nests, a mapping's keys become children, a list's items repeat, None is N/A."""
    *dirs, leaf = key.split("/")
    for part in dirs:
        found = parent.find(_xml_tag(part))
        parent = found if found is not None else ET.SubElement(parent, _xml_tag(part))
    elem = ET.SubElement(parent, _xml_tag(leaf))
    if isinstance(value, dict):
        for k, v in value.items():
            _xml_add(elem, str(k), v)
    elif isinstance(value, list):
        for item in value:
            _xml_add(elem, _XML_ITEMS.get(leaf, "item"), item)
    else:
        elem.text = "N/A" if value is None else str(value)


def _xml_tag(name: str) -> str:
    """A key as a valid XML element name (fault records and dumps carry arbitrary keys)."""
    tag = re.sub(r"[^A-Za-z0-9_.-]", "_", name)
    return tag if re.match(r"[A-Za-z_]", tag) else f"_{tag}"


# --- --query-device ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Field:
    """One ``--query-device`` field: how to get it from a device's attributes, and its unit."""

    get: Callable[[dict[str, str], dict[str, str]], str]
    unit: str = ""


def _attr_field(attr: str, unit: str = "") -> Field:
    """The attribute as it is (N/A where the driver has none), memory in MiB."""
    if unit == "MiB":
        return Field(lambda a, d: mib(a.get(attr, "")), unit)
    if attr in OPTIONAL_ATTRS:
        return Field(lambda a, d: _na(a.get(attr)), unit)
    return Field(lambda a, d: a.get(attr, ""), unit)


FIELDS: dict[str, Field] = {
    "index": _attr_field("index"),
    "name": _attr_field("name"),
    "uuid": _attr_field("uuid"),
    "serial": _attr_field("serial"),
    "pci_bus_id": _attr_field("pci_bus_id"),
    "pci.bus_id": _attr_field("pci_bus_id"),
    "driver_version": Field(lambda a, d: a.get("driver_version") or d.get("version", "")),
    "firmware_version": _attr_field("firmware_version"),
    "memory.total": _attr_field("memory_total", "MiB"),
    "memory.used": _attr_field("memory_used", "MiB"),
    "memory.free": _attr_field("memory_free", "MiB"),  # retired pages are not free
    "utilization": _attr_field("utilization", "%"),
    "utilization.gpu": _attr_field("utilization", "%"),
    "utilization.copy": _attr_field("utilization_copy", "%"),
    "power.draw": _attr_field("power", "W"),
    "power.limit": _attr_field("power_limit", "W"),
    "state": _attr_field("state"),
    "failure_code": _attr_field("failure_code"),
    "failure": _attr_field("failure"),
    "temperature.gpu": _attr_field("temperature", "C"),
    "clocks.sm": _attr_field("clock", "MHz"),
    "clocks_event_reasons.active": _attr_field("throttle_reasons"),
    "clocks_throttle_reasons.active": _attr_field("throttle_reasons"),
    "clocks.current.sm": _attr_field("clock", "MHz"),
    "reset_count": _attr_field("reset_count"),
}


#: ``--query-compute-apps`` fields (nvidia-smi's names), from a ``compute_apps`` row.
APP_FIELDS: dict[str, Field] = {
    "pid": _attr_field("pid"),
    "process_name": _attr_field("process_name"),
    "name": _attr_field("process_name"),
    "used_memory": _attr_field("used_memory", "MiB"),
    "used_gpu_memory": _attr_field("used_memory", "MiB"),
    "gpu_uuid": _attr_field("uuid"),
    "gpu_bus_id": _attr_field("pci_bus_id"),
    "gpu_name": _attr_field("name"),
    "index": _attr_field("index"),
}
APPS_DEFAULT = "pid,process_name,used_memory"


#: a valid nvidia-smi field the driver does not model: answered, never refused
_UNSUPPORTED = Field(lambda a, d: NOT_SUPPORTED)


def resolve_fields(spec: str, sample: dict[str, str], known: dict[str, Field] = FIELDS,
                   option: str = "--query-device") -> list[tuple[str, Field]]:
    """Named fields; any other attribute of ``sample`` works too, with dots for
    underscores; in ``--query-device``, any other field nvidia-smi documents is
    ``[Not Supported]`` (as nvidia-smi answers for a field a device lacks), so a script
    ported from it keeps working; only names nvidia-smi does not know either are refused."""
    fields = []
    for name in (f.strip() for f in spec.split(",")):
        if name in known:
            fields.append((name, known[name]))
        elif name and name.replace(".", "_") in sample:
            fields.append((name, _attr_field(name.replace(".", "_"))))
        elif known is FIELDS and name in NVSMI_GPU_FIELDS:
            fields.append((name, _UNSUPPORTED))
        else:
            valid = sorted(set(known) | set(sample))
            raise UsageError(f"unknown field {name!r} in {option}; valid fields: "
                             + ", ".join(valid))
    return fields


def _csv_quote(value: str) -> str:
    """Quote a value that holds the separator (failure texts can), as RFC 4180 does."""
    if "," in value or '"' in value or "\n" in value:
        return '"' + value.replace('"', '""') + '"'
    return value


def csv_options(fmt: str) -> set[str]:
    """``--format``: csv, optionally with ``noheader`` and ``nounits``."""
    options = {o.strip() for o in fmt.split(",")}
    if "csv" not in options or not options <= {"csv", "noheader", "nounits"}:
        raise UsageError(f"--format {fmt!r}: use csv, optionally with ,noheader and ,nounits")
    return options


def show_csv(tree: Tree, devices: list[str], spec: str, fmt: str, header: bool = True) -> str:
    """``--query-device``: one csv row per device."""
    attrs = [tree.device(n) for n in devices]
    fields = resolve_fields(spec, attrs[0] if attrs else {})
    return csv_table(fields, attrs, tree.driver(), csv_options(fmt), header)


def show_compute_apps(tree: Tree, devices: list[str], spec: str, fmt: str,
                      header: bool = True) -> str:
    """``--query-compute-apps``: one csv row per process holding device memory."""
    fields = resolve_fields(spec, {}, APP_FIELDS, "--query-compute-apps")
    return csv_table(fields, compute_apps(tree, devices), tree.driver(), csv_options(fmt),
                     header)


def csv_table(fields: list[tuple[str, Field]], rows: list[dict[str, str]],
              drv: dict[str, str], options: set[str], header: bool) -> str:
    """The csv of both queries: a header naming each unit (``memory.used [MiB]``) unless
    ``noheader`` (or a later ``-l`` round: the header comes once), values with their
    unit unless ``nounits``; N/A never gets a unit, as in nvidia-smi."""
    lines = []
    if header and "noheader" not in options:
        lines.append(", ".join(f"{n} [{f.unit}]" if f.unit else n for n, f in fields))
    for row in rows:
        values = []
        for _name, f in fields:
            value = f.get(row, drv)
            if f.unit and value != "N/A" and "nounits" not in options:
                value = f"{value} {f.unit}"
            values.append(_csv_quote(value))
        lines.append(", ".join(values))
    return "\n".join(lines)


# --- --query-retired-pages -------------------------------------------------------------------
#: NVML's two retirement causes, for the driver's ce (a second correctable error at the
#: page) and ue, so that a script written against nvidia-smi reads the same words.
_CAUSES = {"ce": "Multiple Single Bit ECC", "ue": "Double Bit ECC"}
_STATUSES = {"R": "retired", "P": "pending", "F": "failed"}
#: field -> its value, from the device's identity attributes and one page's row
RETIRED_FIELDS: dict[str, Callable[[dict[str, str], dict[str, Any]], str]] = {
    "index": lambda a, p: a["index"],
    "gpu_name": lambda a, p: a["name"],
    "gpu_uuid": lambda a, p: a["uuid"],
    "gpu_bus_id": lambda a, p: a["pci_bus_id"],
    "gpu_serial": lambda a, p: a["serial"],
    "retired_pages.address": lambda a, p: f"0x{p['pfn'] * uapi.ACCEL_PAGE_SIZE:016x}",
    "retired_pages.cause": lambda a, p: _CAUSES.get(p["cause"], p["cause"]),
    "retired_pages.status": lambda a, p: _STATUSES.get(p["status"], p["status"]),
    "retired_pages.timestamp": lambda a, p: time.strftime(
        "%Y/%m/%d %H:%M:%S", time.localtime(p["time"])),
}
RETIRED_DEFAULT = "gpu_uuid,retired_pages.address,retired_pages.cause,retired_pages.status"


def show_retired_pages(tree: Tree, devices: list[str], spec: str, fmt: str,
                       header: bool = True) -> str:
    """``--query-retired-pages``: one csv row per page of each device's bad-page table."""
    options = csv_options(fmt)
    fields = [f.strip() for f in spec.split(",")]
    unknown = [f for f in fields if f not in RETIRED_FIELDS]
    if unknown:
        raise UsageError(f"unknown field {unknown[0]!r} in --query-retired-pages; valid "
                         "fields: " + ", ".join(RETIRED_FIELDS))
    lines = [", ".join(fields)] if header and "noheader" not in options else []
    for name in devices:
        ident = {k: tree.attr(name, k) for k in ("index", "name", "uuid", "pci_bus_id",
                                                   "serial")}
        for page in page_rows("ras/bad_page_details", tree.attr(name, "ras/bad_page_details")):
            lines.append(", ".join(_csv_quote(RETIRED_FIELDS[f](ident, page)) for f in fields))
    return "\n".join(lines)


# --- reset --------------------------------------------------------------------------------------
def in_use(tree: Tree, devices: list[str]) -> tuple[int, str] | None:
    """The refusal of a reset of devices other processes hold, as ``nvidia-smi -r``
    refuses a GPU in use; None when none is. A split device's reset resets its partitions
    too (a package reset), so a process holding one of them holds it. (This tool never
    opens a device, so it is never one of them.)"""
    held = []
    for name in [n for d in devices for n in (d, *tree.attr(d, "partitions").split())]:
        clients = int(tree.attr(name, "clients", "0") or 0)
        if clients:
            pids = [str(p["pid"]) for p in processes(tree.attr(name, "processes"))]
            who = f" (pids {', '.join(pids)})" if pids else ""
            held.append(f"accel {name[5:]} is in use by {clients} process"
                        f"{'es' if clients > 1 else ''}{who}")
    if not held:
        return None
    return EXIT_IN_USE, ("; ".join(held) + ": stop them first, or pass --force (they lose "
                         "their contexts)")


def reset(tree: Tree, devices: list[str], timeout: float = RESET_TIMEOUT_S) -> tuple[int, str]:
    """Request a reset of each device, then wait until each is operational or failed.

    A reset is done when ``reset_count`` has moved past its old value (the driver bumps it
    once the reset's boot has settled the state and failure) and the state is final, so a
    device that was already failed is not mistaken for one that failed again.
    """
    before = {n: int(tree.device(n).get("reset_count", "0") or 0) for n in devices}
    for name in devices:
        try:
            (tree.class_dir / name / "reset").write_text("1")
        except PermissionError as exc:
            return EXIT_PERMISSION, (f"cannot reset {name}: {exc.strerror} "
                                     "(only the daemon's owner may)")
        except OSError as exc:
            return EXIT_FAILED, f"cannot reset {name}: {exc.strerror}"
    deadline = time.monotonic() + timeout
    pending, out, rc = list(devices), [], EXIT_OK
    while pending:
        for name in list(pending):
            a = tree.device(name)
            done = int(a.get("reset_count", "0") or 0) > before[name]
            if done and a.get("state") in ("operational", "failed"):
                pending.remove(name)
                a = tree.device(name)  # re-read: the pass above is not one snapshot
                if a["state"] == "operational":
                    out.append(f"accel {name[5:]}: reset complete, operational "
                               f"(reset_count {a['reset_count']})")
                else:
                    rc = EXIT_FAILED
                    out.append(f"accel {name[5:]}: reset ended failed "
                               f"[{a.get('failure_code', '')}]: {a.get('failure', '')}")
        if pending and time.monotonic() > deadline:
            for name in pending:
                a = tree.device(name)
                out.append(f"accel {name[5:]}: reset did not finish within {timeout:g} s "
                           f"(state {a.get('state')}; {_na(a.get('failure'))})")
            return EXIT_FAILED, "\n".join(out)
        if pending:
            time.sleep(0.05)
    return rc, "\n".join(out)


# --- command line -------------------------------------------------------------------------------
class Parser(argparse.ArgumentParser):
    """argparse that raises UsageError instead of exiting, so that a bad command line is
    reported as every other usage error is (exit 2; a JSON object under ``--json``)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{message}\n{self.format_usage().strip()}")


def parser() -> Parser:
    p = Parser(prog="accel-smi", description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", type=Path, default=None,
                   help="mount root (default: $ACCEL_EMU_ROOT or the per-user default)")
    p.add_argument("-i", "--id", metavar="ID", default=None,
                   help="device(s): index, UUID (or unique prefix) or PCI bus id; comma list")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("-L", "--list-devices", action="store_true", help="one line per device")
    mode.add_argument("-q", "--query", action="store_true", help="every attribute, grouped")
    mode.add_argument("--json", action="store_true", help="machine-readable, all attributes")
    p.add_argument("-x", "--xml-format", dest="xml", action="store_true",
                   help="every attribute as XML (alone or with -q, as nvidia-smi -q -x)")
    p.add_argument("-d", "--display", metavar="SECTION[,SECTION]", default=None,
                   help=f"with -q: only these sections ({', '.join(DISPLAY)})")
    mode.add_argument("--query-device", "--query-gpu", dest="query_device", metavar="FIELDS",
                      help="comma-separated fields: " + ", ".join(FIELDS))
    mode.add_argument("--query-compute-apps", metavar="FIELDS", nargs="?", const=APPS_DEFAULT,
                      help=f"one row per process (default {APPS_DEFAULT}): "
                           + ", ".join(APP_FIELDS))
    mode.add_argument("--query-retired-pages", metavar="FIELDS", nargs="?",
                      const=RETIRED_DEFAULT,
                      help=f"one row per bad page (default {RETIRED_DEFAULT}): "
                           + ", ".join(RETIRED_FIELDS))
    mode.add_argument("-r", "--reset", action="store_true", help="reset the -i device(s)")
    mode.add_argument("--version", action="store_true",
                      help="the versions of accel-smi, the driver and each firmware")
    p.add_argument("--force", action="store_true",
                   help="with -r: reset even while other processes use the device")
    p.add_argument("--format", default=None,
                   help="for the --query-* modes: csv[,noheader][,nounits] (default csv)")
    p.add_argument("-l", "--loop", type=float, metavar="SEC", default=None,
                   help="repeat the query every SEC seconds until interrupted")
    p.add_argument("--reset-timeout", type=float, default=RESET_TIMEOUT_S, help=argparse.SUPPRESS)
    return p


def check_combination(args: argparse.Namespace) -> None:
    """The options argparse's one group of modes cannot rule out: each one that would be
    ignored is an error instead (nvidia-smi's habit of ignoring them hides typos)."""
    csv_modes = (args.query_device, args.query_compute_apps, args.query_retired_pages)
    others = [flag for flag, on in (("-L", args.list_devices), ("--json", args.json),
                                    ("-r", args.reset), ("--version", args.version),
                                    ("--query-*", any(m is not None for m in csv_modes)))
              if on]
    if args.xml and others:
        raise UsageError(f"-x goes alone or with -q, not with {others[0]}")
    if args.format is not None and all(m is None for m in csv_modes):
        raise UsageError("--format goes with --query-device/--query-gpu, "
                         "--query-compute-apps or --query-retired-pages")
    if args.force and not args.reset:
        raise UsageError("--force goes with -r")
    if args.display is not None and (not args.query or args.xml):
        raise UsageError("-d goes with -q (without -x: the XML has every section)")
    if args.loop is not None and (args.reset or args.version):
        raise UsageError(f"-l repeats a query; it does not go with "
                         f"{'-r' if args.reset else '--version'}")
    if args.loop is not None and args.loop <= 0:
        raise UsageError(f"-l {args.loop:g}: the period is a number of seconds above 0")


def tool_version() -> str:
    """This package's version (the installed distribution's metadata)."""
    try:
        return importlib.metadata.version("accel-emu")
    except importlib.metadata.PackageNotFoundError:
        return "N/A"


def show_version(tree: Tree, devices: list[str]) -> str:
    """``--version``: accel-smi's, the driver's (and its uAPI's), each selected device's
    firmware."""
    drv = tree.driver()
    width = 24
    lines = [f"{'accel-smi version':<{width}}: {tool_version()}",
             f"{'Driver version':<{width}}: {_na(drv.get('version'))}",
             f"{'ABI version':<{width}}: {_na(drv.get('abi_version'))}"]
    for name in devices:
        lines.append(f"{f'accel {name[5:]} firmware':<{width}}: "
                     f"{_na(tree.attr(name, 'firmware_version'))}")
    return "\n".join(lines)


# --- compute partitions ----------------------------------------------------------------------
def partition_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="accel-smi partition",
                                description="show or set a device's compute partition mode")
    p.add_argument("--root", type=Path, default=None,
                   help="mount root (default: $ACCEL_EMU_ROOT or the per-user default)")
    p.add_argument("-i", "--id", metavar="ID", required=True,
                   help="the physical device: index, UUID (or unique prefix) or PCI bus id")
    p.add_argument("--mode", type=int, default=None,
                   help="split it into this many partitions (1: whole again)")
    return p


def show_partitions(tree: Tree, name: str) -> str:
    """The mode, the modes offered and one line per partition."""
    lines = [f"accel {name[5:]}: partition mode {tree.attr(name, 'partition_mode')} "
             f"(available: {tree.attr(name, 'available_partition_modes')})"]
    for part in tree.attr(name, "partitions").split():
        a = tree.device(part)
        lines.append(f"  partition {a.get('partition_id')}: accel {part[5:]}  {a.get('uuid')}  "
                     f"{mib(a.get('memory_total', '0'))} MiB  {a.get('compute_engines')} "
                     f"compute / {a.get('copy_engines')} copy engines  {_state(a)}")
    return "\n".join(lines)


def set_partition_mode(tree: Tree, name: str, mode: int) -> tuple[int, str] | None:
    """Write ``mode`` to the device's ``partition_mode`` (the driver boots the partitions
    before the write returns); the refusal as (exit code, message), None once done."""
    available = tree.attr(name, "available_partition_modes").split()
    if str(mode) not in available:
        raise UsageError(f"--mode {mode}: accel {name[5:]} offers modes {' '.join(available)}")
    try:
        (tree.class_dir / name / "partition_mode").write_text(str(mode))
    except PermissionError as exc:
        return EXIT_PERMISSION, f"cannot partition {name}: {exc.strerror} (only root may)"
    except OSError as exc:
        if exc.errno == errno.EBUSY:
            return EXIT_IN_USE, (f"accel {name[5:]} or one of its partitions is in use: "
                                 "stop its processes first")
        return EXIT_FAILED, f"cannot partition {name}: {exc.strerror}"
    return None


def run_partition(argv: Sequence[str]) -> tuple[int, str, str]:
    """``accel-smi partition``: (exit code, stdout text, stderr text)."""
    args = partition_parser().parse_args(argv)
    tree = Tree(args.root or Path(uapi.default_root()))
    try:
        devices = select(tree, args.id)
        if len(devices) != 1:
            raise UsageError("-i names one device")
        name = devices[0]
        if not tree.attr(name, "available_partition_modes"):
            raise UsageError(f"accel {name[5:]} is a partition; partition its device "
                             f"(accel {tree.attr(name, 'package_id')})")
        if args.mode is not None:
            refused = set_partition_mode(tree, name, args.mode)
            if refused is not None:
                return refused[0], "", f"accel-smi: {refused[1]}"
        return EXIT_OK, show_partitions(tree, name), ""
    except UsageError as exc:
        return EXIT_USAGE, "", f"accel-smi: {exc}"


def _with_health(tree: Tree, devices: list[str], out: str) -> tuple[int, str, str]:
    """A query's result: its output, and exit 15 naming each selected device that is not
    operational (nvidia-smi's "GPU is lost" code; a health gate reads only the status)."""
    down = [(n, tree.attr(n, "state", "unknown")) for n in devices]
    down = [(n, state) for n, state in down if state != "operational"]
    if not down:
        return EXIT_OK, out, ""
    return EXIT_NOT_OPERATIONAL, out, "accel-smi: not operational: " + ", ".join(
        f"accel {n[5:]} ({state})" for n, state in down)


def run(argv: Sequence[str] | None = None, first: bool = True) -> tuple[int, str, str]:
    """(exit code, stdout text, stderr text): the whole tool, without touching sys.std*.
    ``first`` is False on the later rounds of ``-l``, which print no csv header. Under
    ``--json`` an error is a JSON object on stdout too, so a consumer parses every
    outcome."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["partition"]:
        return run_partition(argv[1:])
    rc, out, err = _run(argv, first)
    if "--json" in argv and rc not in (EXIT_OK, EXIT_NOT_OPERATIONAL):
        message = err.removeprefix("accel-smi: ").splitlines()[0]  # without the usage
        out = json.dumps({"error": {"message": message, "exit_code": rc}}, indent=2)
    return rc, out, err


def _run(argv: list[str], first: bool) -> tuple[int, str, str]:
    try:
        args = parser().parse_args(argv)
        check_combination(args)
        tree = Tree(args.root or Path(uapi.default_root()))
        if args.reset and args.id is None:
            raise UsageError("-r needs -i: say which device to reset")
        if args.query_device is not None:
            # Fields are checked before devices so a typo is reported even with none present.
            names = tree.device_names()
            resolve_fields(args.query_device, tree.device(names[0]) if names else {})
        devices = select(tree, args.id)
        if not devices:
            shown = show_version(tree, devices) if args.version else NO_DEVICES
            return EXIT_NO_DEVICES, shown, (f"accel-smi: {NO_DEVICES}: no accel-emud "
                                            f"serves {tree.root}")
        if args.version:
            return EXIT_OK, show_version(tree, devices), ""
        if args.reset:
            refused = None if args.force else in_use(tree, devices)
            rc, text = refused or reset(tree, devices, args.reset_timeout)
            return (rc, text, "") if rc == EXIT_OK else (rc, "", f"accel-smi: {text}")
        return _with_health(tree, devices, show(tree, devices, args, first))
    except UsageError as exc:
        return EXIT_USAGE, "", f"accel-smi: {exc}"


def show(tree: Tree, devices: list[str], args: argparse.Namespace, first: bool) -> str:
    """The output of the query mode ``args`` chose."""
    fmt = args.format or "csv"
    if args.list_devices:
        return show_list(tree, devices)
    if args.xml:
        return show_xml(tree, devices)
    if args.query:
        return show_query(tree, devices, parse_display(args.display))
    if args.json:
        return show_json(tree, devices)
    if args.query_device is not None:
        return show_csv(tree, devices, args.query_device, fmt, first)
    if args.query_compute_apps is not None:
        return show_compute_apps(tree, devices, args.query_compute_apps, fmt, first)
    if args.query_retired_pages is not None:
        return show_retired_pages(tree, devices, args.query_retired_pages, fmt, first)
    return show_table(tree, devices)


# --- dmon and pmon --------------------------------------------------------------------------
def monitor_parser(kind: str) -> Parser:
    p = Parser(prog=f"accel-smi {kind}",
               description=f"live rows, as nvidia-smi {kind} prints them (docs/tools.md)")
    p.add_argument("--root", type=Path, default=None,
                   help="mount root (default: $ACCEL_EMU_ROOT or the per-user default)")
    p.add_argument("-i", "--id", metavar="ID", default=None,
                   help="device(s): index, UUID (or unique prefix) or PCI bus id; comma list")
    p.add_argument("-c", "--count", type=int, default=None,
                   help="stop after this many samples (default: until interrupted)")
    p.add_argument("-d", "--delay", type=float, default=1.0,
                   help="seconds between samples (default 1)")
    return p


def ticks(count: int | None, delay: float) -> Iterator[float]:
    """The monotonic time of each sample: ``count`` of them (None: forever), ``delay``
    seconds apart."""
    taken = 0
    while count is None or taken < count:
        if taken:
            time.sleep(delay)
        taken += 1
        yield time.monotonic()


def _row(cells: Sequence[object], widths: Sequence[int]) -> str:
    """One fixed-width row, each cell right-aligned (the last, a command name, left)."""
    *head, last = [str(c) for c in cells]
    return (" ".join(f"{c:>{w}}" for c, w in zip(head, widths)) + f"  {last}").rstrip()


def _dash(value: int | float | None) -> str:
    """A dmon/pmon cell: a whole number, or ``-`` for N/A as nvidia-smi prints it."""
    return "-" if value is None else f"{round(value)}"


DMON_HEADER = (("# idx", "pwr", "temp", "sm", "copy", "mem", "fb", "pclk", "state"),
               ("# Idx", "W", "C", "%", "%", "%", "MiB", "MHz", ""))
DMON_WIDTHS = (5, 6, 5, 4, 4, 4, 6, 5)


def dmon(tree: Tree, devices: list[str], samples: Iterator[float]) -> Iterator[str]:
    """``dmon``: per sample, one row per device: power, temperature, compute (sm) and copy
    utilization, memory in use (percent and MiB), clock, state."""
    yield from (_row(h, DMON_WIDTHS) for h in DMON_HEADER)
    for _ in samples:
        for name in devices:
            a = tree.device(name)
            used, total = number(a.get("memory_used")), number(a.get("memory_total"))
            yield _row((a.get("index", name[5:]), _dash(number(a.get("power"))),
                        _dash(number(a.get("temperature"))),
                        _dash(number(a.get("utilization"))),
                        _dash(number(a.get("utilization_copy"))),
                        _dash(100 * used / total if used is not None and total else None),
                        _dash(used / MIB if used is not None else None),
                        _dash(number(a.get("clock"))), a.get("state", "unknown")),
                       DMON_WIDTHS)


PMON_HEADER = (("# idx", "pid", "type", "sm", "mem", "command"),
               ("# Idx", "#", "C/G", "%", "MiB", "name"))
PMON_WIDTHS = (5, 8, 4, 4, 6)


def compute_ns(tree: Tree, name: str) -> dict[int, int] | None:
    """Compute-engine nanoseconds per pid, summed over its contexts (``fdinfo``'s
    ``drm-engine-compute``); None where the driver has no fdinfo."""
    try:
        text = (tree.class_dir / name / "fdinfo").read_text()
    except OSError:
        return None
    busy: dict[int, int] = {}
    for block in fdinfo(text):
        pid, ns = block.get("pid"), block.get("drm-engine-compute")
        if isinstance(pid, int) and isinstance(ns, int):
            busy[pid] = busy.get(pid, 0) + ns
    return busy


def pmon(tree: Tree, devices: list[str], samples: Iterator[float]) -> Iterator[str]:
    """``pmon``: per sample, one row per process per device (a row of ``-`` for a device
    without one, as nvidia-smi's). ``sm`` is the share of the device's compute engines
    the process kept busy since the previous sample (fdinfo's busy time, which DRM top
    tools read the same way): ``-`` on the first sample and without fdinfo."""
    yield from (_row(h, PMON_WIDTHS) for h in PMON_HEADER)
    before: dict[str, tuple[float, dict[int, int] | None]] = {}
    for now in samples:
        for name in devices:
            idx = tree.attr(name, "index", name[5:])
            busy = compute_ns(tree, name)
            then, old = before.get(name, (now, None))
            engines = number(tree.attr(name, "compute_engines")) or 1
            apps = processes(tree.attr(name, "processes"))
            if not apps:
                yield _row((idx, "-", "-", "-", "-", "-"), PMON_WIDTHS)
            for proc in apps:
                pid = proc["pid"]
                share = None
                if busy is not None and old is not None and now > then and pid in old:
                    share = 100 * (busy.get(pid, 0) - old[pid]) / ((now - then) * 1e9 * engines)
                yield _row((idx, pid, "C", _dash(share), _dash(proc["used_memory"] / MIB),
                            process_name(pid)), PMON_WIDTHS)
            before[name] = (now, busy)


def run_monitor(argv: Sequence[str], emit: Callable[[str], None]) -> tuple[int, str]:
    """``accel-smi dmon|pmon``: stream its lines to ``emit``; (exit code, stderr text)."""
    kind, *rest = argv
    try:
        args = monitor_parser(kind).parse_args(rest)
        if args.count is not None and args.count < 1:
            raise UsageError(f"-c {args.count}: at least one sample")
        if args.delay <= 0:
            raise UsageError(f"-d {args.delay:g}: the interval is a number of seconds above 0")
        tree = Tree(args.root or Path(uapi.default_root()))
        devices = select(tree, args.id)
    except UsageError as exc:
        return EXIT_USAGE, f"accel-smi: {exc}"
    if not devices:
        return EXIT_NO_DEVICES, f"accel-smi: {NO_DEVICES}: no accel-emud serves {tree.root}"
    monitor = dmon if kind == "dmon" else pmon
    for line in monitor(tree, devices, ticks(args.count, args.delay)):
        emit(line)
    return EXIT_OK, ""


# --- the process: output, -l, signals -----------------------------------------------------
def _write(out: str, err: str) -> None:
    """Print a result, flushed at once (a ``-l`` or dmon reader sees each round live)."""
    if out:
        print(out, flush=True)
    if err:
        print(err, file=sys.stderr, flush=True)


def loop_period(argv: Sequence[str]) -> float | None:
    """``-l``'s period; None without one, and for a command line ``run`` will refuse."""
    if argv[:1] == ["partition"]:
        return None
    try:
        return parser().parse_args(argv).loop
    except UsageError:
        return None


def repeat(argv: list[str]) -> int:
    """Run the query once, then every ``-l`` seconds until interrupted (SIGINT ends the
    loop with exit 0, quietly, as it ends nvidia-smi's) or until a round fails other than
    by a device being down (15: that is what a watcher watches for). Without ``-l`` an
    interrupt stays one: a reset cut short must not look like a success."""
    period = loop_period(argv)
    try:
        rc, out, err = run(argv)
        _write(out, err)
        while period is not None and rc in (EXIT_OK, EXIT_NOT_OPERATIONAL):
            time.sleep(period)
            rc, out, err = run(argv, first=False)
            _write(out, err)
    except KeyboardInterrupt:
        if period is None:
            raise
        return EXIT_OK
    return rc


def main(argv: Sequence[str] | None = None) -> int:
    """The console script. A reader that goes away (``accel-smi -q | head -1``) ends it
    quietly with 141, the status of a tool killed by SIGPIPE, as a shell pipeline
    expects: no traceback, and stdout is pointed at /dev/null so that the interpreter's
    own last flush does not raise again."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] in (["dmon"], ["pmon"]):
            try:
                rc, err = run_monitor(argv, lambda line: print(line, flush=True))
            except KeyboardInterrupt:
                return EXIT_OK
            _write("", err)
            return rc
        return repeat(argv)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main())
