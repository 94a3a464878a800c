"""The PyTorch backend's tests: snippets in fresh processes (torch_accel's state, like the
runtime's, is per process) against the session's 2-device daemon. The processes are forks
of one interpreter that has imported torch and torch_accel and initialised nothing
(``torch_runner``, tests/zygote.py says why that is a fresh process to them): a torch
import is 3-4 s of CPU, a fork a fraction of one.

``torch_run(body)`` runs ``TORCH_PRELUDE`` + ``body`` and returns its printed lines;
``torch_json(body)`` runs it with ``report(**values)`` defined and returns what it
reported (scenario.py), for the snippets that measure something. The prelude imports torch
(which autoloads torch_accel through its entry point) and asserts that the backend is
registered, so a test never passes against the CPU by mistake.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from scenario import Runner, run_json, run_scenario
from zygote import Zygote

TORCH_PRELUDE = """
import os, sys, io, time, numpy as np, torch, torch_accel, runtime
assert torch.accel is torch_accel.accel and torch._C._get_privateuse1_backend_name() == "accel"
"""


#: a snippet's default time limit: the first use of a kernel compiles it in the firmware
#: (seconds each on this machine), and a fresh daemon has compiled none
SNIPPET_TIMEOUT = 200


@pytest.fixture(scope="session")
def torch_runner(daemon) -> Iterator[Runner]:
    """What runs the snippets: the forking interpreter for the session's daemon (a file
    that overrides ``daemon`` with a private one overrides this with that daemon: its
    snippets run in new interpreters)."""
    zygote = Zygote(daemon)
    try:
        yield zygote
    finally:
        zygote.close()


@pytest.fixture
def torch_run(torch_runner) -> Callable[..., list[str]]:
    def run(body: str, timeout: float = SNIPPET_TIMEOUT, **kw) -> list[str]:
        return run_scenario(torch_runner, TORCH_PRELUDE, body, timeout=timeout, **kw)
    return run


@pytest.fixture
def torch_json(torch_runner) -> Callable[..., dict[str, Any]]:
    def run(body: str, timeout: float = SNIPPET_TIMEOUT, **kw) -> dict[str, Any]:
        return run_json(torch_runner, TORCH_PRELUDE, body, timeout=timeout, **kw)
    return run
