"""The torch tests' snippets run in forks of one interpreter that has imported torch
(tests/zygote.py): each must be the fresh process a ``python -c`` would be, as far as the
tests can tell -- the same output, exit status and traceback, an uninitialised runtime and
torch_accel that then initialise and use the device, none of the harness's modules --
and a snippet that hangs or dies must leave the zygote serving the next one."""

from __future__ import annotations

import os
import subprocess

import pytest

pytestmark = pytest.mark.timeout(200)

#: what a snippet sees of its process: the runtime's and torch_accel's state, the
#: modules loaded, and a use of the device
FRESH = """
import os, sys, torch, runtime.devices, torch_accel._hooks
print("initialised", runtime.devices.is_initialized(), torch_accel._hooks.in_bad_fork())
print("harness", sorted(m for m in ("testkit", "kmod_emul", "firmware", "zygote", "pytest")
                        if m in sys.modules))
print("main", __name__, sys.argv, repr(sys.path[0]), os.getcwd() == os.environ["PYTHONPATH"])
print("sum", (torch.arange(6, device="accel") * 2).sum().item(), torch.accel.device_count())
print("to stderr", file=sys.stderr)
"""


def test_a_fork_runs_a_snippet_as_a_fresh_interpreter_does(daemon, torch_runner):
    fresh = daemon.run_py(FRESH, timeout=120)
    forked = torch_runner.run_py(FRESH, timeout=120)
    assert (forked.returncode, forked.stdout) == (fresh.returncode, fresh.stdout) == \
        (0, "initialised False False\nharness []\nmain __main__ ['-c'] '' True\nsum 30 2\n"), \
        (fresh, forked)
    assert forked.stderr.endswith("to stderr\n") and fresh.stderr.endswith("to stderr\n")


@pytest.mark.parametrize("code, status, stderr_tail", [
    ("import sys; sys.exit(3)", 3, ""),
    ("import sys; sys.exit('gave up')", 1, "gave up\n"),
    ("raise KeyError('k')", 1,
     'Traceback (most recent call last):\n  File "<string>", line 1, in <module>\n'
     "KeyError: 'k'\n"),
    ("x = = 1", 1, "SyntaxError: invalid syntax\n"),
    ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", -9, ""),
    ("import threading, time\nthreading.Thread(target=lambda: (time.sleep(0.5), print('joined'))"
     ").start()", 0, ""),
], ids=["exit_3", "exit_message", "exception", "syntax_error", "sigkill", "thread_joined"])
def test_exit_status_and_traceback_are_a_fresh_interpreters(daemon, torch_runner, code,
                                                            status, stderr_tail):
    """What ``python -c`` answers for each ending, the zygote's child answers too: the
    status, the traceback of the snippet's own frames, and non-daemon threads joined
    before the exit."""
    forked, fresh = torch_runner.run_py(code), daemon.run_py(code)
    assert (forked.returncode, forked.stdout) == (fresh.returncode, fresh.stdout), \
        (forked, fresh)
    assert forked.returncode == status and forked.stderr.endswith(stderr_tail), forked
    assert fresh.stderr.endswith(stderr_tail), fresh


def test_a_snippet_past_its_timeout_is_killed_and_the_next_one_runs(torch_runner):
    with pytest.raises(subprocess.TimeoutExpired):
        torch_runner.run_py("import os, time\nprint(os.getpid(), flush=True)\ntime.sleep(600)",
                            timeout=2)
    assert torch_runner.run_py("import torch; print(torch.ones(2, device='accel').sum().item())"
                               ).stdout == "2.0\n"
    assert torch_runner.proc.poll() is None


def test_an_environment_of_its_own_runs_in_a_fresh_interpreter(torch_runner):
    """A variable the zygote did not start with may be read at import (it was not, in
    the zygote): such a snippet gets a new interpreter, not a fork."""
    code = "import os; print(os.getppid(), os.environ.get('TORCH_ACCEL_FALLBACK_WARN'))"
    forked = torch_runner.run_py(code)
    own = torch_runner.run_py(code, TORCH_ACCEL_FALLBACK_WARN="1")
    assert forked.stdout == f"{torch_runner.proc.pid} None\n", forked
    assert own.stdout == f"{os.getpid()} 1\n", own


def test_a_snippet_longer_than_one_read_arrives_whole(torch_runner):
    """The request is read to the client's end of it: a snippet of 300 KB (the opinfo
    script is 8 KB) runs as written."""
    code = "x = 0\n" + "x += 1\n" * 50_000 + "print(x)\n"
    assert len(code) > 300_000
    assert torch_runner.run_py(code).stdout == "50000\n"
