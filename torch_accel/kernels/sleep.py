"""``sleep(cycles)``: keep a stream busy (like ``torch.cuda._sleep``), for tests of
stream ordering, events and overlap. One block of one thread counts to ``cycles``; the
loop cannot be folded away because every loop iteration reads the firmware's abort word
(which is also what lets the watchdog stop an overlong sleep)."""

from __future__ import annotations

import numpy as np

import runtime
from torch_accel.kernels import _shared as shared

SOURCE = """def sleep(scratch, cycles: 'int64'):
    acc = 0
    for k in range(cycles):
        acc += 1
    scratch[0] = acc
"""

_scratch: dict[int, runtime.DeviceArray] = {}


def sleep(cycles: int, device: int | None = None, stream: runtime.Stream | None = None) -> None:
    """Queue a kernel running about ``cycles`` loop iterations on ``stream`` (default: the
    current stream of ``device``, default the current device)."""
    dev = stream.device if stream is not None else (
        runtime.current_device() if device is None else device)
    scratch = _scratch.get(dev)
    if scratch is None:
        scratch = _scratch[dev] = runtime.empty(1, np.int64, device=dev)
    shared.module("sleep", SOURCE, dev).sleep[1, 1](
        scratch, int(cycles), stream=stream if stream is not None else runtime.current_stream(dev))
