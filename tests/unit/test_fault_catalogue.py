"""The catalogue users read (docs/faults.md) is the one the code uses (abi/faults.py), and
every record a layer builds has every field."""

from __future__ import annotations

from pathlib import Path

import pytest

from abi import faults

DOC = Path(__file__).resolve().parents[2] / "docs" / "faults.md"


def _doc_rows() -> list[list[str]]:
    text = DOC.read_text().split("## The catalogue", 1)[1].split("\n## ", 1)[0]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()
            if line.startswith("| ") and not line.startswith("| code")]
    return [r for r in rows if r and r[0].isdigit()]


def test_the_documented_catalogue_is_the_code_s():
    documented = {int(r[0]): r[1:] for r in _doc_rows()}
    assert documented == {
        k.code: [k.name, k.block, str(k.severity), str(k.scope), str(k.action), k.meaning]
        for k in faults.CATALOGUE.values()}


def test_every_scope_severity_and_action_is_documented():
    text = DOC.read_text()
    for value in (*faults.Scope, *faults.Severity, *faults.Action):
        assert f"`{value}`" in text or f" {value} " in text, value


def test_a_record_has_every_field_and_refuses_unknown_ones():
    rec = faults.record(faults.BY_NAME["PAGE_FAULT"], device=1, address=0x1000)
    assert list(rec) == list(faults.FIELDS)
    assert (rec["code"], rec["scope"], rec["corrected"], rec["device"]) == (31, "queue", False, 1)
    assert faults.from_line(faults.to_line(rec)) == rec
    with pytest.raises(TypeError, match="not fields"):
        faults.record(faults.BY_NAME["PAGE_FAULT"], colour="red")
    with pytest.raises(ValueError):
        faults.from_line("[1, 2]")


@pytest.mark.parametrize("code, name", [
    (14, "EFAULT"), (110, "ETIMEDOUT"), (62, "ETIME"), (67, "ENOLINK"), (22, "EINVAL"),
    (7, "E2BIG")])
def test_queue_faults_map_to_their_entry(code, name):
    expected = {"EFAULT": 31, "ETIMEDOUT": 43, "ETIME": 43, "ENOLINK": 76}.get(name, 13)
    assert faults.queue_fault_kind(code).code == expected


def test_a_wait_value_timeout_is_its_own_entry():
    assert faults.queue_fault_kind(110, "WAIT_VALUE").name == "QUEUE_WAIT_TIMEOUT"
    assert faults.queue_fault_kind(110, "LAUNCH").name == "KERNEL_TIMEOUT"


def test_banks_cover_the_memory_in_order():
    total = 1 << 30
    banks = [faults.bank_of(off, total) for off in range(0, total, total // 64)]
    assert banks == sorted(banks) and set(banks) == set(range(faults.MEMORY_BANKS))
    assert faults.bank_of(total - 1, total) == faults.MEMORY_BANKS - 1
