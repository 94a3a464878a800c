"""The firmware image format (abi/fwimage.py): what the driver and the boot ROM refuse, and
that the shipped image is what firmware/image.py builds."""

from __future__ import annotations

import json

import pytest

from abi import fwimage, mailbox
from firmware import image


def _image(**payload_changes: object) -> bytes:
    payload = {**image.DEFAULT_PAYLOAD, **payload_changes}
    payload = {k: v for k, v in payload.items() if v is not None}
    return fwimage.build(image.DEFAULT_MANIFEST, json.dumps(payload).encode())


@pytest.mark.timeout(30)
def test_the_shipped_image_is_the_one_the_firmware_builds():
    """A change to the defaults, the ISA or the mailbox ABI needs ``make firmware``."""
    shipped = (image.IMAGE_DIR / fwimage.IMAGE_NAME).read_bytes()
    assert shipped == image.default_image()
    parsed = fwimage.parse(shipped)
    assert parsed.manifest["abi_min"] <= mailbox.MAILBOX_ABI <= parsed.manifest["abi_max"]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("change, message", [
    ({"compute_engines": None}, "payload field compute_engines is None, not a non-negative integer"),
    ({"copy_engines": "2"}, "payload field copy_engines is '2', not a non-negative integer"),
    ({"max_contexts": -1}, "payload field max_contexts is -1, not a non-negative integer"),
    # every live context holds an entry of the mailbox's live table
    ({"max_contexts": 2049},
     "payload max_contexts 2049 exceeds the mailbox's live-context table (2048)"),
    ({"capabilities": "copy"}, "payload field capabilities is 'copy', not a list"),
    ({"capabilities": ["copy", ["x"]]}, "payload capabilities are not all names"),
    ({"capabilities": ["copy", "warp_drive"]}, "payload names unknown capabilities ['warp_drive']"),
])
def test_a_payload_the_driver_cannot_use_is_refused(change, message):
    with pytest.raises(fwimage.ImageError) as e:
        fwimage.parse(_image(**change))
    assert str(e.value) == message


@pytest.mark.timeout(30)
def test_a_manifest_abi_range_must_be_integers():
    manifest = {**image.DEFAULT_MANIFEST, "abi_max": "2"}
    with pytest.raises(fwimage.ImageError) as e:
        fwimage.parse(fwimage.build(manifest, json.dumps(image.DEFAULT_PAYLOAD).encode()))
    assert str(e.value) == "manifest abi_min/abi_max are not integers"


@pytest.mark.timeout(30)
def test_an_unbooted_device_reports_nothing_it_does_not_know():
    assert set(fwimage.UNBOOTED_CONFIG) == set(fwimage.CONFIG_FIELDS)
    assert fwimage.UNBOOTED_CONFIG["capabilities"] == []
    assert all(v == 0 for k, v in fwimage.UNBOOTED_CONFIG.items() if k != "capabilities")
