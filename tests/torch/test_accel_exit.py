"""A process using accel exits cleanly while torch's own threads still call into the shim.

Once Python begins to finalise, a thread that waits for the GIL is ended with
pthread_exit; from a storage's deleter (a destructor) that unwinding is std::terminate,
"terminate called without an active exception". An autograd device thread freeing a
failed backward's tensors as the program exits did exactly that (issue 31's reset test,
one CI run in six). The shim's atexit handler now closes its entries into Python and waits
for the calls inside to return; later entries are refused (a deleter skips its Python
part, a call raises). These run in new interpreters: the exit under test is the real one.
"""

from __future__ import annotations

import pytest
from conftest import TORCH_PRELUDE

pytestmark = pytest.mark.timeout(120)

#: A thread inside a shim call into Python (torch.accelerator.synchronize reaches the
#: device guard's synchronizeDevice, which calls _hooks.synchronize) while the main thread
#: exits: the call is slowed so the exit begins while it is inside.
CALL_INSIDE_AT_EXIT = """
import threading
from torch_accel import _hooks
inside = threading.Event()
real = _hooks.synchronize
def slow(index):
    inside.set()
    time.sleep(0.5)
    real(index)
    print("the call finished", flush=True)
_hooks.synchronize = slow
torch.ones(4, device="accel")
threading.Thread(target=torch.accelerator.synchronize, daemon=True).start()
assert inside.wait(30)
print("main exits", flush=True)
"""


def test_the_exit_waits_for_a_call_into_python_inside_the_shim(daemon):
    out = daemon.run_py(TORCH_PRELUDE + CALL_INSIDE_AT_EXIT, timeout=90)
    assert out.returncode == 0, out.stderr + out.stdout
    assert out.stdout.splitlines() == ["main exits", "the call finished"], out.stdout
    assert "terminate" not in out.stderr, out.stderr


#: After the gate closed (the shim's atexit handler ran, as at exit), an allocation is
#: refused with a RuntimeError and a freed tensor's deleter skips Python without a word.
AFTER_THE_GATE = """
import atexit
kept = torch.arange(8.0, device="accel")
assert kept.sum().item() == 28.0
atexit._run_exitfuncs()
try:
    torch.empty(4, device="accel")
    print("allocated")
except RuntimeError as exc:
    print("refused:", exc)
del kept
print("freed")
"""


def test_after_the_exit_began_allocations_are_refused_and_frees_are_silent(daemon):
    out = daemon.run_py(TORCH_PRELUDE + AFTER_THE_GATE, timeout=90)
    assert out.returncode == 0, out.stderr + out.stdout
    lines = out.stdout.splitlines()
    assert lines[0].startswith("refused: torch_accel: the interpreter is exiting"), lines
    assert lines[1:] == ["freed"], lines
    assert out.stderr == "", out.stderr
