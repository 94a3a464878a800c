"""The stream-race sanitizer (``ACCEL_SANITIZE=1``, docs/sanitizer.md) under torch_accel:
racy and correct torch programs on two streams; a race names the aten operators, the
kernels they launched, their modes and the user's lines (the runtime's corpus is
tests/runtime/test_sanitizer.py)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(300)

PROGRAMS = """
import dataclasses
from runtime import sanitizer
assert sanitizer.active is not None
N = 4096
s = torch.accel.Stream()
results = {}
def here():
    return sys._getframe(1).f_lineno
def run(name, program):
    lines = {}
    try:
        program(lines)
        torch.accel.synchronize()
        results[name] = {"raised": False, "lines": lines}
    except runtime.RaceError as e:
        torch.accel.synchronize()
        results[name] = {"raised": True, "lines": lines, "n": len(e.reports),
                         "report": dataclasses.asdict(e.report)}

def op_then_inplace_on_side_stream(lines):  # x read on the current stream, written on s
    x = torch.ones(N, device="accel")
    torch.accel.synchronize()
    y = x * 2; lines["first"] = here()
    with torch.accel.stream(s):
        x.add_(1); lines["second"] = here()
run("op_then_inplace_on_side_stream", op_then_inplace_on_side_stream)

def side_stream_waits(lines):  # the same, with s.wait_stream(current) first
    x = torch.ones(N, device="accel")
    torch.accel.synchronize()
    y = x * 2
    s.wait_stream(torch.accel.current_stream())
    with torch.accel.stream(s):
        x.add_(1)
run("side_stream_waits", side_stream_waits)

def reuse_without_record_stream(lines):  # x used on s, freed, its block reused
    x = torch.empty(N, device="accel")
    torch.accel.synchronize()
    p = x.data_ptr()
    with torch.accel.stream(s):
        x.fill_(1); lines["first"] = here()
    del x
    y = torch.empty(N, device="accel")
    lines["reused"] = y.data_ptr() == p
    y.fill_(2); lines["second"] = here()
run("reuse_without_record_stream", reuse_without_record_stream)

def reuse_with_record_stream(lines):
    x = torch.empty(N, device="accel")
    torch.accel.synchronize()
    with torch.accel.stream(s):
        x.fill_(1)
    x.record_stream(s)
    del x
    y = torch.empty(N, device="accel")
    y.fill_(2)
run("reuse_with_record_stream", reuse_with_record_stream)
def train_step(model, opt):
    loss = model(torch.ones(16, 8, device="accel")).square().sum()
    opt.zero_grad()
    loss.backward()
    opt.step()

def snapshot(lines, wait_back):  # parameters cloned on a side stream while training goes on
    model = torch.nn.Linear(8, 4).to("accel")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train_step(model, opt)
    s.wait_stream(torch.accel.current_stream())
    with torch.accel.stream(s):
        snap = [p.detach().clone() for p in model.parameters()]; lines["first"] = here()
    if wait_back:
        torch.accel.current_stream().wait_stream(s)
    train_step(model, opt)
run("snapshot_without_wait_back", lambda lines: snapshot(lines, False))
run("snapshot_with_wait_back", lambda lines: snapshot(lines, True))
def peer_copy_then_free(lines):  # x's block reused on accel:0 after a copy to accel:1
    x = torch.randn(1000, device="accel")
    p = x.data_ptr()
    y = x.to("accel:1")
    del x
    z = torch.randn(1000, device="accel")
    lines["reused"] = z.data_ptr() == p
run("peer_copy_then_free", peer_copy_then_free)
report(results=results)
"""


def test_torch_corpus(torch_json):
    """The racy programs raise naming the aten operators, modes and lines; the correct
    ones do not (one process: torch's import and the kernels' compiles are paid once)."""
    results = torch_json(PROGRAMS, timeout=280, ACCEL_SANITIZE="1")["results"]

    r = results["op_then_inplace_on_side_stream"]
    assert r["raised"] and r["n"] == 1, r
    first, second = r["report"]["first"], r["report"]["second"]
    assert (first["aten"], first["mode"], first["site"]) == \
        ("aten::mul.Tensor", "read", f"<string>:{r['lines']['first']}"), first
    assert (second["aten"], second["mode"], second["site"]) == \
        ("aten::add_.Tensor", "write", f"<string>:{r['lines']['second']}"), second
    assert first["queue"] != second["queue"] and r["report"]["kind"] == "device"
    assert r["report"]["end"] - r["report"]["start"] == 4096 * 4

    r = results["reuse_without_record_stream"]
    assert r["lines"]["reused"], "the caching allocator handed x's block to y"
    assert r["raised"] and r["n"] == 1, r
    first, second = r["report"]["first"], r["report"]["second"]
    assert (first["aten"], first["site"]) == ("aten::fill_.Scalar",
                                               f"<string>:{r['lines']['first']}"), first
    assert (second["aten"], second["site"]) == ("aten::fill_.Scalar",
                                                f"<string>:{r['lines']['second']}"), second

    # a realistic one: the optimizer's next step writes the parameters a side stream is
    # still cloning (each parameter's race is reported: weight and bias; SGD's step is one
    # _foreach_add_, whose pairs' adds it makes)
    r = results["snapshot_without_wait_back"]
    assert r["raised"] and r["n"] == 2, r
    first, second = r["report"]["first"], r["report"]["second"]
    assert (first["aten"], first["mode"], first["site"]) == \
        ("aten::_copy_from", "read", f"<string>:{r['lines']['first']}"), first
    assert (second["aten"], second["mode"]) == ("aten::_foreach_add_.List", "write"), second
    assert second["site"].endswith("torch/optim/sgd.py:" + second["site"].split(":")[-1])

    assert results["peer_copy_then_free"]["lines"]["reused"]
    for name in ("side_stream_waits", "reuse_with_record_stream", "snapshot_with_wait_back",
                 "peer_copy_then_free"):
        assert not results[name]["raised"], (name, results[name])


def test_a_peer_copy_reads_its_source_before_the_source_is_reused(torch_json):
    """``x.to("accel:1")`` queues the transfer on accel:1's stream; freeing ``x`` gives its
    block back to accel:0's stream, whose next allocation takes it. The transfer must read
    ``x`` before that work writes it: here it waits behind a busy kernel on accel:1 while
    accel:0 is idle. Found by the sanitizer (``peer_copy_then_free`` above raised
    aten::_copy_from against aten::normal_); before the fix ``y`` held ``z``'s values."""
    r = torch_json("""
        x = torch.randn(1000, device="accel")
        want = x.cpu()
        with torch.accel.device(1):
            torch.accel._sleep(10**8)
        y = x.to("accel:1")
        del x
        z = torch.randn(1000, device="accel")
        report(y_is_x=torch.equal(y.cpu(), want), y_is_z=torch.equal(y.cpu(), z.cpu()))
    """)
    assert r == {"y_is_x": True, "y_is_z": False}, r
