"""The reset masks of sysfs (``compute_reset_mask``, ``copy_reset_mask``, as amdgpu's
``gfx_reset_mask``) and docs/faults.md's table of reset scopes both say what
``abi.faults.RESET_SCOPES`` says."""

from __future__ import annotations

import pytest

from abi import faults
from testkit import REPO


def docs_table() -> str:
    """docs/faults.md's table of reset scopes, as the code has it."""
    rows = ["| scope | engines (`<engine>_reset_mask`) | what resets at it |",
            "| --- | --- | --- |"]
    rows += [f"| {r.scope} | {' '.join(r.engines)} | {r.trigger} |" for r in faults.RESET_SCOPES]
    return "\n".join(rows) + "\n"


def test_each_engine_lists_the_reset_scopes_implemented_for_it(daemon):
    for dev in range(daemon.devices):
        for engine in faults.ENGINES:
            assert daemon.attr(dev, f"{engine}_reset_mask") == " ".join(
                faults.reset_mask(engine))
    # what is implemented today; a scope joins once something resets at it
    assert daemon.attr(0, "compute_reset_mask") == "queue context device package"
    assert daemon.attr(0, "copy_reset_mask") == "queue context device package"


@pytest.mark.timeout(60)
def test_the_docs_table_of_reset_scopes_matches_the_code():
    """Regenerate it with ``PYTHONPATH=.:tests:tests/driver python -c "import
    test_reset_masks as t; print(t.docs_table())"``."""
    text = (REPO / "docs" / "faults.md").read_text()
    assert docs_table() in text, "docs/faults.md's table of reset scopes is stale:\n" + docs_table()
