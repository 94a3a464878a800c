"""``abi/accel_uapi.h``, the C header of the uAPI, generated from :mod:`abi.uapi` and
:mod:`abi.userq` (``python -m abi.gen_header --write``, ``make header``).

A client in C (or anything that reads C headers) gets every command struct under the same
name as the ctypes one, the command codes, the constants and enums, the doorbell page's
and the ring's layout, the packet opcodes and each opcode's packet with its argument words
named. Nothing is transcribed by hand: the Python definitions are the only source, and
tests/unit/test_c_header.py regenerates the header and diffs it with the committed one,
compiles it, and compares every size, offset and value a C compiler sees with Python's
(``check_program`` prints them; ``expected`` is what Python says).

Layouts follow the Linux uAPI habit: no ``packed`` attribute, every field naturally
aligned and the padding explicit, so a C compiler lays a struct out exactly as ctypes'
``_pack_ = 1`` does. The generator refuses a struct where that would not hold, and the
header asserts each size and offset at compile time (``_Static_assert``).
"""

from __future__ import annotations

import argparse
import ctypes
import enum
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from abi import kernel_lang, schedule, uapi, userq
from abi._struct import Struct

HEADER = Path(__file__).with_name("accel_uapi.h")

_SCALARS: dict[Any, str] = {
    ctypes.c_uint32: "uint32_t", ctypes.c_int32: "int32_t", ctypes.c_uint64: "uint64_t",
    ctypes.c_char: "char",
}

#: The structs of the header, in its order: the transaction header, then each command's.
STRUCTS: tuple[type[Struct], ...] = (
    uapi.accel_cmd_hdr, *dict.fromkeys(c.struct for c in uapi.COMMANDS.values()))

#: uapi constants (beyond the commands, enums and seals) a client needs, by name.
UAPI_CONSTANTS = (
    "ACCEL_ABI_MAJOR", "ACCEL_ABI_MINOR", "ACCEL_IOCTL_BASE", "ACCEL_TAG_LIMIT",
    "ACCEL_MAX_PENDING_REPLIES", "ACCEL_LAST_ERROR_OFFSET", "ACCEL_LAST_ERROR_MAX",
    "ACCEL_CTX_EXCLUSIVE", "ACCEL_CTX_DIAGNOSTIC", "ACCEL_CTX_FLAGS_MASK",
    "ACCEL_VA_DEVICE_SHIFT", "ACCEL_PAGE_SIZE", "ACCEL_KERNEL_NAME_MAX", "ACCEL_MODULE_MAX",
    "ACCEL_KERNEL_SOURCE_MAX", "ACCEL_QUEUE_PRIORITY_LOW", "ACCEL_QUEUE_PRIORITY_HIGH",
    "ACCEL_SEALS_PINNED", "ACCEL_SEALS_IMMUTABLE",  # fcntl.h's F_SEAL_* bits: not redefined
)
#: Enums of uapi, with the prefix their members take in C.
UAPI_ENUMS: tuple[tuple[type[enum.IntEnum] | type[enum.IntFlag], str], ...] = (
    (uapi.DeviceState, "ACCEL_STATE_"), (uapi.Cap, "ACCEL_CAP_"), (uapi.MemKind, "ACCEL_MEM_"))
#: A context's schedule (abi/schedule.py): CTX_CREATE's ``schedule`` and the decision table.
SCHEDULE_CONSTANTS = (
    "SCHED_RECORD", "SCHED_MODE_MASK", "SCHED_FLAGS_MASK", "SCHED_COUNT", "SCHED_DROPPED",
    "SCHED_ENTRIES", "SCHED_ENTRY_SIZE", "SCHED_FILE_SIZE", "SCHED_CAPACITY",
)
SCHEDULE_ENUMS = ((schedule.Mode, "ACCEL_SCHED_"), (schedule.Decision, "ACCEL_SCHED_DECISION_"))
#: userq's layout constants: the doorbell page, the ring, packets and launch arguments.
USERQ_CONSTANTS = (
    "DB_SEQ", "DB_FW_SLEEPING", "DB_LOST", "DB_SLOTS", "ACCEL_DB_DEFAULT_SLOT",
    "ACCEL_DB_SLOT_COUNT", "ACCEL_DB_PAGE_SIZE",
    "RING_WPTR", "RING_RPTR", "RING_COMPLETED", "RING_ERROR_SEQNO", "RING_ERROR_CODE",
    "RING_ERROR_ADDR", "RING_ON_ENGINE", "RING_IRQ_SEQNO", "RING_ARGS_VA", "RING_ARGS_SLOTS",
    "RING_ARGS_SLOT_BYTES", "RING_HEADER_SIZE", "RING_SLOTS", "RING_PACKETS",
    "RING_TIMESTAMPS", "RING_COMPILE", "RING_FILE_SIZE", "PACKET_SIZE",
    "ARG_SCALAR", "ARG_BUFFER", "ARG_SHAPE", "ACCEL_ARGS_MAX",
    "WAIT_VALUE_GEQ", "WAIT_VALUE_EQ", "WAIT_VALUE_AND", "WAIT_VALUE_NOR",
    "WAIT_VALUE_TIMEOUT_MAX_NS",
)
#: The fields of a launch argument record (userq.ARG_RECORD, "<IIQQ"), as docs/kernels.md
#: names them.
ARG_RECORD_FIELDS = (("kind", "uint32_t"), ("dtype", "uint32_t"), ("value", "uint64_t"),
                     ("bytes", "uint64_t"))
assert userq.ARG_RECORD.format == "<IIQQ"
#: Bits of each of x, y, z in a LAUNCH's grid and block words (userq.pack_dims).
DIM_BITS = 21
assert userq.pack_dims((1, 0, 0)) == 1 and userq.pack_dims((0, 1, 0)) == 1 << DIM_BITS


def c_name(name: str) -> str:
    """The C name of a Python constant: ``ACCEL_``-prefixed."""
    return name if name.startswith("ACCEL_") else f"ACCEL_{name}"


def _literal(value: int) -> str:
    return f"{value:#x}ULL" if value > 0xFFFFFFFF else f"{value:#x}u" if value > 9 else f"{value}u"


def _field(name: str, ctype: Any) -> str:
    if issubclass(ctype, ctypes.Array):
        base = _SCALARS[ctype._type_]
        return f"{base} {name}[{ctype._length_}];"
    return f"{_SCALARS[ctype]} {name};"


def _alignment(ctype: Any) -> int:
    return ctypes.sizeof(ctype._type_ if issubclass(ctype, ctypes.Array) else ctype)


def fields(cls: type[Struct]) -> Iterator[tuple[str, Any, int, int]]:
    """(name, ctype, offset, size) of each field of ``cls``; ValueError if one is not
    naturally aligned (C would pad where ctypes' packing does not)."""
    for name, ctype in cls._fields_:
        f = getattr(cls, name)
        if f.offset % _alignment(ctype):
            raise ValueError(f"{cls.__name__}.{name} at {f.offset} is not aligned: add padding")
        yield name, ctype, f.offset, f.size
    if ctypes.sizeof(cls) % max(_alignment(t) for _n, t in cls._fields_):
        raise ValueError(f"{cls.__name__}: size {ctypes.sizeof(cls)} needs tail padding")


def _doc(obj: Any) -> str:
    """The first paragraph of ``obj``'s docstring as plain text for a C comment."""
    text = " ".join((obj.__doc__ or "").split("\n\n")[0].split())
    return re.sub(r":\w+:`([^`]*)`", r"\1", text).replace("``", "")


def _struct(cls: type[Struct]) -> list[str]:
    out = [f"/* {_doc(cls)} */", f"struct {cls.__name__} {{"]
    out += [f"\t{_field(n, t)}" for n, t, _o, _s in fields(cls)]
    out += ["};", f"_Static_assert(sizeof(struct {cls.__name__}) == {ctypes.sizeof(cls)}, "
                  f"\"{cls.__name__}\");"]
    out += [f"_Static_assert(offsetof(struct {cls.__name__}, {n}) == {o}, "
            f"\"{cls.__name__}.{n}\");" for n, _t, o, _s in fields(cls)]
    return out + [""]


def _packet_struct(op: userq.Op) -> list[str]:
    """The packet of ``op``: opcode, flags (0), its argument words by name, the unused
    ones reserved; and each word's index among a0..a6 (``ACCEL_<OP>_<WORD>``)."""
    layout = userq.LAYOUTS[op]
    words = list(layout._fields)
    name = f"accel_packet_{op.name.lower()}"
    out = [f"/* {_doc(layout)} */", f"struct {name} {{",
           "\tuint32_t opcode; /* ACCEL_OP_" + op.name + " */", "\tuint32_t flags; /* 0 */"]
    out += [f"\tuint64_t {w}; /* a{i} */" for i, w in enumerate(words)]
    if len(words) < 7:
        unused = f"a{len(words)}" + ("..a6" if len(words) < 6 else "")
        out.append(f"\tuint64_t reserved[{7 - len(words)}]; /* {unused}: 0 */")
    out += ["};", f"_Static_assert(sizeof(struct {name}) == ACCEL_PACKET_SIZE, \"{name}\");"]
    out += [f"#define ACCEL_{op.name}_{w.upper()} {i}" for i, w in enumerate(words)]
    return out + [""]


def constants() -> dict[str, int]:
    """Every constant and enum member of the header, by its C name, from Python."""
    out = {c_name(n): int(getattr(uapi, n)) for n in UAPI_CONSTANTS}
    for cls, prefix in UAPI_ENUMS:
        out.update({prefix + m.name: int(m) for m in cls})  # type: ignore[union-attr]
    out.update(ACCEL_IOC_DIRSHIFT=uapi._IOC_DIRSHIFT, ACCEL_IOC_WRITE=uapi.IOC_WRITE,
               ACCEL_IOC_READ=uapi.IOC_READ)
    out.update({f"ACCEL_CMD_{c.name}": c.code for c in uapi.COMMANDS.values()})
    out.update({c_name(n): int(getattr(userq, n)) for n in USERQ_CONSTANTS})
    out.update({c_name(n): int(getattr(schedule, n)) for n in SCHEDULE_CONSTANTS})
    for cls, prefix in SCHEDULE_ENUMS:
        out.update({prefix + m.name: int(m) for m in cls})
    out.update({f"ACCEL_OP_{op.name}": int(op) for op in userq.Op})
    for op in userq.Op:
        out.update({f"ACCEL_{op.name}_{w.upper()}": i
                    for i, w in enumerate(userq.LAYOUTS[op]._fields)})
    out.update({f"ACCEL_DTYPE_{n.upper()}": code for n, (code, _size) in kernel_lang.DTYPES.items()})
    out["ACCEL_DIM_BITS"] = DIM_BITS
    return out


def expected() -> dict[str, int]:
    """What the check program must print: every constant, and each struct's size and each
    field's offset and size (``sizeof:S``, ``offsetof:S.F``, ``sizeof:S.F``), from Python."""
    out = constants()
    for cls in STRUCTS:
        out[f"sizeof:{cls.__name__}"] = ctypes.sizeof(cls)
        for n, _t, off, size in fields(cls):
            out[f"offsetof:{cls.__name__}.{n}"] = off
            out[f"sizeof:{cls.__name__}.{n}"] = size
    out["sizeof:accel_arg_record"] = userq.ARG_RECORD.size
    for op in userq.Op:
        name = f"accel_packet_{op.name.lower()}"
        out[f"sizeof:{name}"] = userq.PACKET_SIZE
        for i, w in enumerate(userq.LAYOUTS[op]._fields):
            out[f"offsetof:{name}.{w}"] = 8 + 8 * i
    return out


def header() -> str:
    """The text of abi/accel_uapi.h."""
    consts = constants()

    def define(name: str, comment: str = "") -> str:
        return f"#define {name} {_literal(consts[name])}" + (f" /* {comment} */" if comment else "")

    out = [
        "/* SPDX-License-Identifier: MIT */",
        "/* accel-emu uAPI for C clients. GENERATED by `python -m abi.gen_header --write`",
        " * (make header) from abi/uapi.py, abi/userq.py and abi/schedule.py: do not edit. docs/uapi.md and",
        " * docs/submission.md explain it; examples/raw_client.c uses it. */",
        "#ifndef ACCEL_UAPI_H", "#define ACCEL_UAPI_H", "",
        "#include <stddef.h>", "#include <stdint.h>", "",
        "/* --- constants (abi/uapi.py) --- */",
        *(define(c_name(n)) for n in UAPI_CONSTANTS), "",
    ]
    for cls, prefix in UAPI_ENUMS:
        out += [f"/* {cls.__name__}: {_doc(cls)} */"]
        out += [define(prefix + m.name) for m in cls]  # type: ignore[union-attr]
        out.append("")
    out += ["/* --- schedules (abi/schedule.py): accel_ctx_create.schedule, the decision "
            "table --- */"]
    out += [define(c_name(n)) for n in SCHEDULE_CONSTANTS]
    for cls, prefix in SCHEDULE_ENUMS:
        out += [define(prefix + m.name) for m in cls]
    out += ["", "/* --- structs: the transaction header, then each command's --- */"]
    for cls in STRUCTS:
        out += _struct(cls)
    out += ["/* --- commands: _IOC-encoded (direction, struct size, 'a', number) --- */",
            define("ACCEL_IOC_DIRSHIFT"), define("ACCEL_IOC_WRITE"), define("ACCEL_IOC_READ"),
            "/* A command with the READ direction leaves a reply: pread it at the tag. */",
            "#define ACCEL_CMD_HAS_REPLY(cmd) "
            "((((cmd) >> ACCEL_IOC_DIRSHIFT) & ACCEL_IOC_READ) != 0)"]
    out += [define(f"ACCEL_CMD_{c.name}", f"struct {c.struct.__name__}, "
                   f"{'reply' if c.has_reply else 'no reply'}") for c in uapi.COMMANDS.values()]
    out += ["", "/* --- the user-mode queue (abi/userq.py): doorbell page, ring, packets --- */"]
    out += [define(c_name(n)) for n in USERQ_CONSTANTS]
    out += [define(f"ACCEL_DTYPE_{n.upper()}") for n in kernel_lang.DTYPES]
    out += [define("ACCEL_DIM_BITS", "x | y << 21 | z << 42 in a grid or block word"), ""]
    out += [define(f"ACCEL_OP_{op.name}") for op in userq.Op] + [""]
    out += ["/* Any packet: opcode, flags (0: anything else faults it, EINVAL), a0..a6. */",
            "struct accel_packet {", "\tuint32_t opcode;", "\tuint32_t flags;",
            "\tuint64_t a[7];", "};",
            "_Static_assert(sizeof(struct accel_packet) == ACCEL_PACKET_SIZE, \"accel_packet\");",
            ""]
    for op in userq.Op:
        out += _packet_struct(op)
    out += ["/* A record of a LAUNCH's argument block (docs/kernels.md \"Launch ABI\"): kind",
            " * ACCEL_ARG_SCALAR (value: its bits, low bytes first), ACCEL_ARG_BUFFER (value: its",
            " * device address, bytes: its size) or ACCEL_ARG_SHAPE; dtype: ACCEL_DTYPE_*. */",
            "struct accel_arg_record {", *(f"\t{t} {n};" for n, t in ARG_RECORD_FIELDS), "};",
            f"_Static_assert(sizeof(struct accel_arg_record) == {userq.ARG_RECORD.size}, "
            "\"accel_arg_record\");", ""]
    out += ["#endif /* ACCEL_UAPI_H */", ""]
    return "\n".join(out)


def check_program() -> str:
    """A C program that prints ``name value`` for every key of ``expected``, as the C
    compiler sees the header."""
    lines = ['#include <stdio.h>', '#include "accel_uapi.h"', "", "int main(void)", "{"]
    for key in expected():
        if key.startswith("offsetof:"):
            s, f = key[9:].split(".")
            expr = f"offsetof(struct {s}, {f})"
        elif key.startswith("sizeof:") and "." in key:
            s, f = key[7:].split(".")
            expr = f"sizeof(((struct {s} *)0)->{f})"
        elif key.startswith("sizeof:"):
            expr = f"sizeof(struct {key[7:]})"
        else:
            expr = key
        lines.append(f'\tprintf("%s %llu\\n", "{key}", (unsigned long long)({expr}));')
    return "\n".join([*lines, "\treturn 0;", "}", ""])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--write", action="store_true", help=f"write {HEADER.name} next to this module")
    p.add_argument("--check-program", action="store_true",
                   help="print the C program that prints every size, offset and constant")
    args = p.parse_args(argv)
    if args.check_program:
        sys.stdout.write(check_program())
    elif args.write:
        HEADER.write_text(header())
    else:
        sys.stdout.write(header())
    return 0


if __name__ == "__main__":
    sys.exit(main())
