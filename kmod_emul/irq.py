"""A device's interrupt loop and what the driver does with each firmware completion
(ivpu's ipc: ``ivpu_ipc_irq_handler`` and its consumers).

The firmware raises its interrupt after it posts completions in the mailbox; the loop
takes every one posted and dispatches it through ``COMPLETION_HANDLERS``, one handler per
op of ``mailbox.COMPLETIONS`` (checked when the driver loads). A handler that raises is a
driver bug: it is logged and the loop goes on, since one bad completion must not take the
device down.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import trio

from abi import faults, mailbox, schedule, userq

if TYPE_CHECKING:
    from kmod_emul.device import AccelDevice

log = logging.getLogger(__name__)


async def irq_loop(dev: AccelDevice, scope: trio.CancelScope) -> None:
    """Take the firmware's completions as its interrupts come, while the device serves."""
    fw = dev.fw
    assert fw is not None
    while True:
        await fw.wait_irq()
        fw.flush()
        while (item := fw.mbx.cpl.pop()) is not None:
            try:
                completion(dev, *item)
            except Exception:  # a driver bug must not take the device down
                log.exception("%s: driver bug handling completion %s", dev.name, item[:3])


def completion(dev: AccelDevice, op: int, status: int, ctx_id: int, payload: bytes) -> None:
    """Dispatch one firmware completion through ``COMPLETION_HANDLERS``."""
    try:
        msg = mailbox.decode(mailbox.COMPLETIONS, op, payload)
    except mailbox.MessageError as exc:  # a firmware that speaks another mailbox
        log.error("%s: firmware sent %s", dev.name, exc)
        return
    COMPLETION_HANDLERS[mailbox.Op(op)](dev, ctx_id, status, msg)


def _errno_name(status: int) -> str:
    return errno.errorcode.get(status, str(status))


def on_map_done(dev: AccelDevice, ctx_id: int, status: int, msg: mailbox.fw_map_done) -> None:
    """The firmware could not map an allocation MEM_ALLOC already answered: packets that
    touch it will fault with EFAULT, so its process needs the record that says why."""
    ctx = dev.contexts.get(ctx_id)
    dev.report(faults.BY_NAME["MAP_FAILED"].code, ctx, engine="firmware", address=msg.va,
               errno=_errno_name(status), **({} if ctx is not None else {"context": ctx_id}))


def on_queue_done(dev: AccelDevice, ctx_id: int, status: int,
                  msg: mailbox.fw_queue_done) -> None:
    log.warning("%s: firmware could not map the ring of queue %d of context %d (%s)",
                dev.name, msg.queue_id, ctx_id, _errno_name(status))
    fault_queue(dev, ctx_id, msg.queue_id, status)
    ctx = dev.contexts.get(ctx_id)
    if ctx is not None:
        dev.report(faults.BY_NAME["QUEUE_UNMAPPABLE"].code, ctx, queue=msg.queue_id,
                   engine="firmware", errno=_errno_name(status))


def on_link_done(dev: AccelDevice, ctx_id: int, status: int, msg: mailbox.fw_link) -> None:
    dev.link.on_answer(msg)


def on_fault(dev: AccelDevice, ctx_id: int, status: int, msg: mailbox.fw_fault) -> None:
    """A packet faulted (``status`` its errno): record it for its process. The process
    learns it from its own ring; this is the record everyone else reads."""
    ctx = dev.contexts.get(ctx_id)
    if ctx is None or not ctx.diagnostic:  # one whose context is gone counts: it may be anyone's
        dev.tenant_faults += 1
    op = userq.op_name(msg.opcode)
    dev.report(faults.queue_fault_kind(status, op).code, ctx, engine=faults.engine_of(op),
               queue=msg.queue_id, seqno=msg.seqno, address=msg.address, opcode=op,
               errno=_errno_name(status), **({} if ctx is not None else {"context": ctx_id}))


def on_unmap_done(dev: AccelDevice, ctx_id: int, status: int,
                  msg: mailbox.fw_unmap_done) -> None:
    dev.memory.unmapped(ctx_id, msg.va)


def on_ctx_destroy_done(dev: AccelDevice, ctx_id: int, status: int,
                        msg: mailbox.fw_ctx_destroy_done) -> None:
    dev.memory.context_destroyed(ctx_id)


def fault_queue(dev: AccelDevice, ctx_id: int, qid: int, code: int) -> None:
    """A queue the firmware could not map never runs: say so in its ring (the process
    then raises at its next submission or wait) and wake the process."""
    ctx = dev.contexts.get(ctx_id)
    q = ctx.queues.get(qid) if ctx is not None else None
    if ctx is None or q is None:
        return
    if q.fd >= 0:
        ring = userq.RingView(q.fd)
        try:
            if not ring.read_fault()[0]:
                ring.write_fault(max(1, ring.completed + 1), code, 0, 0)
        finally:
            ring.close()
    ctx.signal()


def on_fault_replay(dev: AccelDevice, ctx_id: int, status: int,
                    msg: mailbox.fw_fault_replay) -> None:
    """A replayed schedule reached a FAULT entry: inject it if the context may cause it
    (kmod_emul/ras.py ``Ras.replay``), then let the firmware start the context's packets
    again (a fault that lost the context has stopped them for good)."""
    ctx = dev.contexts.get(ctx_id)
    applied = ctx is not None and dev.ras.replay(ctx, schedule.Entry(
        msg.queue, msg.seqno, schedule.Decision.FAULT, msg.value, msg.address))
    dev.fw_send(ctx_id, mailbox.fw_fault_replayed(applied=int(applied)))


#: What the driver does with each completion the firmware sends: one entry per op of
#: ``mailbox.COMPLETIONS`` (checked when the driver loads).
COMPLETION_HANDLERS: dict[mailbox.Op, Callable[[AccelDevice, int, int, Any], None]] = {
    mailbox.Op.MAP: on_map_done,
    mailbox.Op.QUEUE_CREATE: on_queue_done,
    mailbox.Op.QUEUE_IMPORT: on_queue_done,
    mailbox.Op.UNMAP: on_unmap_done,
    mailbox.Op.CTX_DESTROY: on_ctx_destroy_done,
    mailbox.Op.FAULT: on_fault,
    mailbox.Op.LINK: on_link_done,
    mailbox.Op.FAULT_REPLAY: on_fault_replay,
}
assert set(COMPLETION_HANDLERS) == set(mailbox.COMPLETIONS), "a completion without a handler"
