"""Devices (OpenReg's test_device): discovery that initialises nothing, switching the
current device through torch.accel, torch.accelerator and device guards, a current device
per thread, capability and properties, and errors that leave the device usable."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(120)


def test_discovery_initialises_nothing_so_a_fork_after_it_is_fine(torch_run):
    """is_available and device_count read the device tree only (torch.cuda's rule): the
    process stays uninitialised, and a child forked then owns its device state."""
    lines = torch_run("""
        print(torch.accel.is_available(), torch.accel.device_count(),
              torch.accelerator.is_available(), torch.accelerator.device_count(),
              torch.accelerator.current_accelerator())
        print(torch.accel.is_initialized())
        pid = os.fork()
        if pid == 0:
            ok = torch.ones(3, device="accel").sum().item() == 3 and torch.accel.is_initialized()
            os._exit(0 if ok else 1)
        print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), torch.accel.is_initialized())
        torch.accel.init()
        print(torch.accel.is_initialized())
    """)
    assert lines == ["True 2 True 2 accel", "False", "0 False", "True"]


def test_set_device_and_device_contexts_move_where_tensors_go(torch_run):
    lines = torch_run("""
        def where():
            # a new tensor's device, torch.accelerator's and torch.accel's current device
            return (torch.empty(1, device="accel").device.index,
                    torch.accelerator.current_device_index(), torch.accel.current_device())
        torch.accel.set_device(1); print(where())
        torch.accelerator.set_device_index(0); print(where())
        with torch.accel.device(1):
            print(where())
        print(where())
        with torch.accelerator.device_index(1):
            with torch.accelerator.device_index(None):  # None: stay where we are
                print(where())
        try:
            with torch.accelerator.device_index(1), torch.accel.device("accel:0"):
                raise KeyError
        except KeyError:
            print("restored", where())
        with torch.accel.device_of(torch.ones(2, device="accel:1")):
            print(where())
        torch.accel.set_device(torch.device("accel:1")); print(where())
    """)
    assert lines == ["(1, 1, 1)", "(0, 0, 0)", "(1, 1, 1)", "(0, 0, 0)", "(1, 1, 1)",
                     "restored (0, 0, 0)", "(1, 1, 1)", "(1, 1, 1)"]


def test_bad_index_and_failed_operators_raise_and_leave_the_device_usable(torch_run):
    """An index out of range is torch's RuntimeError; an operator's own error (shapes)
    arrives as itself, also when its arguments are temporaries freed while it unwinds."""
    lines = torch_run("""
        for bad in (lambda: torch.accelerator.set_device_index(2), lambda: torch.accel.set_device(2),
                    lambda: torch.empty(1, device="accel:2")):
            try:
                bad()
            except RuntimeError as e:
                print(type(e).__name__, "|", str(e).replace("\\n", " "))
        try:
            torch.matmul(torch.ones(5, 5, device="accel"), torch.ones(3, 3, device="accel"))
        except RuntimeError as e:
            print(type(e).__name__, e)
        print(torch.accelerator.current_device_index(),
              (torch.ones(2, 2, device="accel") @ torch.ones(2, 2, device="accel")).sum().item())
    """)
    assert all(line.startswith("RuntimeError | ") and "the device index is out of range" in line
               for line in lines[:3]), lines
    assert lines[3:] == [
        "RuntimeError mat1 and mat2 shapes cannot be multiplied (5x5 and 3x3)", "0 8.0"]


def test_current_device_is_per_thread(torch_run):
    """A thread starts on device 0 whatever another thread chose; set_device in one thread
    never moves another, even while they interleave."""
    lines = torch_run("""
        import threading
        torch.accel.set_device(1)
        barrier, seen = threading.Barrier(4), {}
        def worker(n):
            start = torch.accel.current_device()
            barrier.wait()
            torch.accelerator.set_device_index(n % 2)
            moved = 0
            for _ in range(10):
                x = torch.ones(4, device="accel")
                moved += x.device.index != n % 2 or torch.accel.current_device() != n % 2
            seen[n] = (start, x.device.index, moved)
        threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        print(sorted(seen.items()), torch.accel.current_device())
    """)
    assert lines == ["[(0, (0, 0, 0)), (1, (0, 1, 0)), (2, (0, 0, 0)), (3, (0, 1, 0))] 1"]


def test_capability_and_properties(torch_run):
    lines = torch_run("""
        cap = torch.accelerator.get_device_capability("accel:0")
        dtypes = cap["supported_dtypes"]
        print(type(dtypes).__name__, "missing", sorted(map(str, {torch.float32, torch.float16,
              torch.bfloat16, torch.float64, torch.int64, torch.int8, torch.uint8, torch.bool} - dtypes)),
              torch.complex64 in dtypes)
        plain = lambda c: {k: sorted(map(str, v)) if isinstance(v, set) else v for k, v in c.items()}
        print(plain(cap))                          # sets in a stable order, to compare
        print(plain(torch.accelerator.get_device_capability("accel:1")))

        props = torch.accel.get_device_properties("accel:1")
        print(props.total_memory, torch.accel.get_device_capability())
        print(torch.accel.get_device_name(1))
        print(props.name)
        print(torch.accel.is_initialized())
    """)
    assert lines[0] == "set missing [] True", lines
    assert lines[1] == lines[2], lines  # both devices' capabilities
    assert lines[3] == f"{256 << 20} (1, 0)" and lines[4] == lines[5], lines
    assert lines[6:] == ["True"], lines



def test_operators_read_the_device_tree_once_not_per_device_guard(torch_json):
    """Every operator passes torch's device guard, which asks whether its index exists.
    That answer comes from what initialisation recorded: reading the device tree (a FUSE
    listdir and a file read) per guard made a 4 Ki ``a + b`` cost 1.3 ms instead of
    0.17 ms. Index checks still hold after the warm-up (a bad index is torch's error)."""
    got = torch_json("""
        from runtime import discovery
        x = torch.ones(4096, device="accel")
        reads = []
        real = discovery.visible_devices
        discovery.visible_devices = lambda: reads.append(1) or real()
        for _ in range(50):
            x = x + x
        torch.accel.synchronize()
        try:
            torch.empty(1, device="accel:9")
            bad = None
        except RuntimeError as exc:
            bad = "invalid device index 9" in str(exc)
        report(tree_reads=len(reads), value=x[0].item(), bad_index_refused=bad)
    """)
    assert got == {"tree_reads": 0, "value": 2.0 ** 50, "bad_index_refused": True}


def test_backward_reads_the_device_tree_once_not_per_step(torch_json):
    """torch's autograd engine asks the device count at every ``backward()``: once the
    runtime is initialised that is the count it recorded (torch.cuda caches it too), not
    a read of the device tree, which cost ~6 ms of a small MLP's training step."""
    got = torch_json("""
        from runtime import discovery
        w = torch.ones(64, 64, device="accel", requires_grad=True)
        (w * 2).sum().backward()
        reads = []
        real = discovery.visible_devices
        discovery.visible_devices = lambda: reads.append(1) or real()
        for _ in range(5):
            (w * 2).sum().backward()
        torch.accel.synchronize()
        report(tree_reads=len(reads), grad=w.grad[0, 0].item(),
               count=torch.accel.device_count(), accelerator=torch.accelerator.device_count())
    """)
    assert got == {"tree_reads": 0, "grad": 12.0, "count": 2, "accelerator": 2}
