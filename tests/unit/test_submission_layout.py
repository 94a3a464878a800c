"""docs/submission.md's layout tables against ``abi/userq.py``: the ring header and the
doorbell page, word by word, and every ``abi`` name the page cites.

The page is what a reader of the ring goes by (a tool, another runtime); it once left out
the argument-arena words and named ``uapi.full_barrier``, which lives in ``userq``. So each
table row's offset must be its constant's value, every offset constant of the two areas
must have a row, and every ``uapi.X``/``userq.X``/``mailbox.X`` the page names must exist.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from abi import mailbox, uapi, userq

DOC = Path(__file__).resolve().parents[2] / "docs" / "submission.md"
#: ``userq`` names of the two areas that are counts or sizes, not word offsets
NOT_OFFSETS = {"RING_SLOTS", "RING_ARGS_SLOT_BYTES", "RING_HEADER_SIZE"}


def layout_rows(text: str) -> dict[str, int]:
    """Constant -> offset, from the rows ``| offset | `CONSTANT` | ...`` of the page."""
    return {name: int(offset) for offset, name in
            re.findall(r"^\| (\d+) \| `((?:RING|DB)_[A-Z_]+)` \|", text, re.M)}


def offset_constants() -> set[str]:
    return {n for n in vars(userq) if re.fullmatch(r"(RING|DB)_[A-Z_]+", n)} - NOT_OFFSETS


@pytest.mark.timeout(30)
def test_every_row_is_its_constant():
    rows = layout_rows(DOC.read_text())
    assert rows, "no layout table found"
    assert {n: getattr(userq, n, None) for n in rows} == rows


@pytest.mark.timeout(30)
def test_every_word_of_the_ring_and_the_doorbell_page_has_a_row():
    assert offset_constants() - set(layout_rows(DOC.read_text())) == set()


@pytest.mark.timeout(30)
def test_every_abi_name_the_page_cites_exists():
    modules = {"uapi": uapi, "userq": userq, "mailbox": mailbox}
    cited = re.findall(r"`(uapi|userq|mailbox)\.([A-Za-z_][A-Za-z0-9_]*)", DOC.read_text())
    assert [f"{m}.{n}" for m, n in cited if not hasattr(modules[m], n)] == []


@pytest.mark.timeout(30)
def test_the_check_sees_a_missing_word_and_a_wrong_offset():
    text = DOC.read_text().replace("| 384 | `RING_ARGS_VA` |", "| 385 | `RING_ARGS_VA` |")
    rows = layout_rows(text)
    assert rows["RING_ARGS_VA"] != userq.RING_ARGS_VA
    without = {n: o for n, o in rows.items() if n != "RING_ARGS_SLOTS"}
    assert offset_constants() - set(without) == {"RING_ARGS_SLOTS"}


def packet_rows(text: str) -> dict[int, tuple[str, list[str]]]:
    """Opcode -> (name, the word each of a0..a6 names or '-'), from the rows
    ``| N | `NAME` | a0 | ... | a6 | faults |`` of the page's packet table."""
    rows = {}
    for opcode, name, cells in re.findall(r"^\| (\d) \| `([A-Z_]+)` \| (.*) \|$", text, re.M):
        words = [c.strip() for c in re.split(r"(?<!\\)\|", cells)][:7]
        rows[int(opcode)] = (name, [w.split("`")[1] if w.startswith("`") else w for w in words])
    return rows


@pytest.mark.timeout(30)
def test_the_packet_table_is_the_layouts():
    """Each opcode's row names its layout's words in order as a0.., the rest '-'."""
    want = {int(op): (op.name, [*userq.LAYOUTS[op]._fields, *"-" * (7 - len(
        userq.LAYOUTS[op]._fields))]) for op in userq.Op}
    assert packet_rows(DOC.read_text()) == want
