"""The PyTorch backend's tests: snippets in fresh interpreters (torch_accel's state, like
the runtime's, is per process) against the session's 2-device daemon.

``torch_run(body)`` runs ``TORCH_PRELUDE`` + ``body`` and returns its printed lines; the
prelude imports torch (which autoloads torch_accel through its entry point) and asserts
that the backend is registered, so a test never passes against the CPU by mistake.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from scenario import run_scenario

TORCH_PRELUDE = """
import os, sys, io, time, numpy as np, torch, torch_accel, runtime
assert torch.accel is torch_accel.accel and torch._C._get_privateuse1_backend_name() == "accel"
"""


#: a snippet's default time limit: the first use of a kernel compiles it in the firmware
#: (seconds each on this machine), and a fresh daemon has compiled none
SNIPPET_TIMEOUT = 200


@pytest.fixture
def torch_run(daemon) -> Callable[..., list[str]]:
    def run(body: str, timeout: float = SNIPPET_TIMEOUT, **kw) -> list[str]:
        return run_scenario(daemon, TORCH_PRELUDE, body, timeout=timeout, **kw)
    return run
