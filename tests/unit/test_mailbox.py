"""The driver-firmware mailbox (abi/mailbox.py) and the firmware's handler table, without
a daemon: every message is one typed struct, a receiver refuses what it does not know, and
a firmware missing a handler does not boot."""

from __future__ import annotations

import ctypes
import os
import socket

import pytest

from abi import mailbox
from firmware import image, memory
from firmware.main import Firmware


def _ring() -> mailbox.Ring:
    return mailbox.Ring(memoryview(bytearray(mailbox.Ring.size())), 0)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("table", [mailbox.COMMANDS, mailbox.COMPLETIONS],
                         ids=["commands", "completions"])
def test_every_message_round_trips_as_its_struct(table):
    ring = _ring()
    for op, cls in table.items():
        msg = cls()
        for i, (name, ctype, *_) in enumerate(cls._fields_):
            if not name.startswith(("pad", "reserved")):
                setattr(msg, name, i + 1)
        assert ring.push(op, 7, msg, status=3)
        got_op, status, ctx_id, payload = ring.pop()
        assert (got_op, status, ctx_id) == (op, 3, 7)
        assert bytes(mailbox.decode(table, got_op, payload)) == bytes(msg)
    assert ring.pop() is None


@pytest.mark.timeout(30)
def test_a_full_ring_refuses_a_message_and_keeps_the_rest():
    ring = _ring()
    for i in range(mailbox.RING_SLOTS):
        assert ring.push(mailbox.Op.UNMAP, i, mailbox.fw_unmap(va=i))
    assert not ring.push(mailbox.Op.UNMAP, 0, mailbox.fw_unmap(va=0))
    assert ring.pending() == mailbox.RING_SLOTS
    assert ring.pop()[2] == 0


@pytest.mark.timeout(30)
def test_one_counter_reads_as_the_whole_block_says():
    """The driver's DEVICE_QUERY reads one counter (``stat``), not the dict of all."""
    mbx = mailbox.Mailbox(memoryview(bytearray(mailbox.MAILBOX_SIZE)))
    mbx.set_stats({name: 1000 + i for i, name in enumerate(mailbox.STAT_NAMES)})
    assert {name: mbx.stat(name) for name in mailbox.STAT_NAMES} == mbx.stats()
    with pytest.raises(KeyError):
        mbx.stat("no_such_counter")


def _payload(msg: ctypes.Structure, extra: bytes = b"") -> bytes:
    body = bytes(msg) + extra
    return body + bytes(mailbox.PAYLOAD_SIZE - len(body))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("op, payload, message", [
    (99, _payload(mailbox.fw_unmap()), "unknown message 99"),
    (int(mailbox.Op.UNMAP), _payload(mailbox.fw_unmap(va=1, reserved=(0, 5))),
     "UNMAP: reserved bytes set"),
    (int(mailbox.Op.HOLD), _payload(mailbox.fw_hold(hold=1, pad=1)), "HOLD: reserved bytes set"),
    (int(mailbox.Op.UNMAP), _payload(mailbox.fw_unmap(va=1), b"\x01"),
     "UNMAP: reserved bytes set"),
])
def test_a_receiver_refuses_what_it_does_not_know(op, payload, message):
    with pytest.raises(mailbox.MessageError) as e:
        mailbox.decode(mailbox.COMMANDS, op, payload)
    assert str(e.value) == message


@pytest.mark.timeout(30)
def test_a_completion_is_not_a_command():
    with pytest.raises(mailbox.MessageError):
        mailbox.decode(mailbox.COMPLETIONS, mailbox.Op.HANG, bytes(mailbox.PAYLOAD_SIZE))


@pytest.fixture
def firmware(tmp_path):
    """A firmware object on a private mailbox (no process, no driver)."""
    buf = memoryview(bytearray(mailbox.MAILBOX_SIZE))
    mbx = mailbox.Mailbox(buf)
    mbx.host_init(image.default_image(), 0)
    doorbell_r, doorbell_w = os.pipe()
    irq_r, irq_w = os.pipe()
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    fw = Firmware(mbx, doorbell_r, irq_w, memory.Backings(), 1 << 20,
                  mailbox.FdChannel(theirs), str(tmp_path / "jit"))
    yield fw, mbx
    for fd in (doorbell_r, doorbell_w, irq_r, irq_w):
        os.close(fd)
    ours.close()
    theirs.close()


@pytest.mark.timeout(60)
def test_the_firmware_handles_every_command(firmware):
    fw, mbx = firmware
    handled = set(fw.device_handlers) | set(fw.context_handlers)
    assert handled == set(mailbox.COMMANDS)
    assert not set(fw.device_handlers) & set(fw.context_handlers)
    assert fw.boot()
    assert mbx.fw_state == mailbox.FwState.READY


@pytest.mark.timeout(60)
def test_a_firmware_missing_a_handler_fails_its_boot(firmware):
    fw, mbx = firmware
    del fw.context_handlers[mailbox.Op.QUEUE_IMPORT]
    assert not fw.boot()
    assert mbx.fw_state == mailbox.FwState.BOOT_FAILED
    assert mbx.boot_message == "boot ROM: no handler for mailbox message QUEUE_IMPORT"
    assert fw.sched is None  # nothing was started
