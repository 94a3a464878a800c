"""Graphs (torch.cuda.graph / CUDAGraph's surface as torch.accel.graph / AccelGraph):
captured operators replay on new values written into the static inputs, a replay runs no
operator's Python (its host work does not grow with the operators captured), captures
allocate from the graph's private pool, and work that needs the host is refused at the
call, as CUDA refuses it."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(300)

#: the capture every test starts from, torch.cuda's recipe: warm up on a side stream (the
#: first launch of a kernel compiles it), then capture on the graph's own side stream
WARM_AND_CAPTURE = """
    def body(x, w):
        return torch.softmax((x @ w).relu() * 2 - 1, dim=1).sum(dim=0)
    x = torch.zeros(4, 8, device="accel")
    w = torch.randn(8, 5).to("accel")
    s = torch.accel.Stream()
    with torch.accel.stream(s):
        body(x, w)
    torch.accel.synchronize()
    g = torch.accel.AccelGraph()
    with torch.accel.graph(g):
        y = body(x, w)
"""


def test_replay_computes_from_new_static_inputs(torch_json):
    r = torch_json(WARM_AND_CAPTURE + """
    wc, worst = w.cpu(), 0.0
    for seed in range(3):
        new = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))
        x.copy_(new)
        g.replay()
        worst = max(worst, (y.cpu() - body(new, wc)).abs().max().item())
    report(worst=worst, capturing_after=torch.accel.is_current_stream_capturing())
    """)
    assert r["worst"] < 1e-5, r
    assert r["capturing_after"] is False, r


def test_replay_runs_no_operator_python(torch_json):
    """A replay dispatches no aten operator and runs none of the operators' or the launch
    path's Python (counted with a TorchDispatchMode and sys.setprofile): what is left is
    the runtime writing the recorded packets into the stream's ring, a few calls a packet,
    against the twenty an operator costs eagerly on its planned path."""
    r = torch_json("""
    from torch.utils._python_dispatch import TorchDispatchMode
    class Count(TorchDispatchMode):
        ops = 0
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))
    x = torch.ones(64, device="accel")
    x.add_(1); torch.accel.synchronize()          # compile add before capturing
    def host_work(run):
        files = []
        prof = lambda frame, event, arg: files.append(frame.f_code.co_filename) if event == "call" else None
        sys.setprofile(prof)
        run()
        sys.setprofile(None)
        with Count():                             # the dispatches, counted apart
            run()
        return len(files), sorted({"/".join(f.split("/")[-2:]) for f in files})
    def forty():
        for _ in range(40):
            x.add_(1)
    g = torch.accel.AccelGraph()
    with torch.accel.graph(g):
        forty()
    g.replay()                                    # the first replay sets up the arena
    eager_calls, _ = host_work(forty)
    eager_ops, Count.ops = Count.ops, 0
    before = x.cpu()[0].item()
    calls, files = host_work(g.replay)
    report(calls=calls, eager_calls=eager_calls, files=files, ops=Count.ops,
           eager_ops=eager_ops, packets=len(g), added=x.cpu()[0].item() - before)
    """)
    assert r["packets"] == 40 and r["added"] == 2 * 40, r
    assert r["eager_ops"] == 40 and r["ops"] == 0, r
    assert not [f for f in r["files"] if f.startswith("ops/") or f in (
        "runtime/launch.py", "runtime/arg_packer.py", "runtime/kernels.py")], r
    # a replay's host work is a few calls per packet (its argument block into the arena,
    # its packet into the ring), not the operator's: eager's planned path is ~20 per op
    assert r["calls"] <= 5 * r["packets"] < r["eager_calls"], r


def test_capture_allocates_from_a_private_pool(torch_json):
    """Tensors made during capture (the output and the temporaries freed at once) stay the
    graph's: memory allocated after the capture never lands on them, so replays cannot
    overwrite it, and reset() gives them back."""
    r = torch_json(WARM_AND_CAPTURE.replace("y = body(x, w)", """t = x * 3
        captured = [t.data_ptr()]
        del t
        y = body(x, w)
        captured.append(y.data_ptr())""") + """
    pool_segments = [s for s in torch.accel.memory_snapshot() if s["stream"] is None]
    later = [torch.empty(4, 8, device="accel") for _ in range(20)]
    later += [torch.empty(5, device="accel") for _ in range(20)]
    x.fill_(1.0)
    g.replay()
    want = body(torch.ones(4, 8), w.cpu())
    allocated = torch.accel.memory_allocated()
    p = g.pool()
    g.reset()
    del y
    report(reused=sorted({t.data_ptr() for t in later} & set(captured)),
           pool_segments=len(pool_segments), right=torch.allclose(body(x, w).cpu(), want),
           freed=allocated - torch.accel.memory_allocated(), pool=list(p))
    g2 = torch.accel.AccelGraph()
    with torch.accel.graph(g2, pool=p):
        z = x + 1
    g2.replay()
    report(shared_pool=list(g2.pool()), z=z.cpu()[0, 0].item())
    """)
    assert r["reused"] == [], r
    assert r["pool_segments"] >= 1, r
    assert r["right"] is True, r
    assert r["freed"] > 0, r
    assert r["shared_pool"] == r["pool"] and r["z"] == 2.0, r


def test_capture_refuses_work_that_needs_the_host(torch_json):
    """``.item()`` and ``.cpu()`` wait for the device, which a capture cannot (CUDA raises
    "operation not permitted when stream is capturing"): refused at the call, and the
    stream is usable after."""
    r = torch_json("""
    x = torch.ones(4, device="accel")
    errors = []
    for what in ("item", "cpu"):
        g = torch.accel.AccelGraph()
        try:
            with torch.accel.graph(g):
                getattr(x.sum(), what)()
        except Exception as exc:
            errors.append(type(exc).__name__ + ": " + str(exc)[:80])
    report(errors=errors, after=x.sum().item(), capturing=torch.accel.is_current_stream_capturing())
    """)
    assert len(r["errors"]) == 2 and all("captur" in e for e in r["errors"]), r
    assert r["after"] == 4.0 and r["capturing"] is False, r


def test_capture_begin_end_replay_on_the_current_stream(torch_json):
    """The explicit form (capture_begin/capture_end on a stream the program made current),
    and replay() queues on the stream current at the call, ordered with the work around
    it."""
    r = torch_json("""
    x = torch.zeros(8, device="accel")
    x.mul_(2); x.add_(1); torch.accel.synchronize()
    g = torch.accel.AccelGraph()
    s = torch.accel.Stream()
    with torch.accel.stream(s):
        g.capture_begin()
        x.mul_(2)
        x.add_(1)
        g.capture_end()
    for _ in range(3):
        g.replay()                  # on the default stream, in order with the fill below
    x.fill_(5.0)
    g.replay()
    report(x=x.cpu().tolist())
    try:
        g.capture_begin()
    except RuntimeError as exc:
        report(recapture=str(exc))
    g.reset()
    with torch.accel.graph(g):
        x.add_(1)
    g.replay()
    report(after_reset=x.cpu()[0].item())
    """)
    assert r["x"] == [11.0] * 8, r
    assert "already captured" in r["recapture"], r
    assert r["after_reset"] == 12.0, r


def test_make_graphed_callables_for_inference(torch_json):
    """torch.cuda.make_graphed_callables' algorithm on accel: a module whose parameters and
    inputs need no gradient becomes one forward graph, matching the CPU module."""
    r = torch_json("""
    import copy
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    cpu = copy.deepcopy(m)
    m = m.to("accel").requires_grad_(False)
    gm = torch.accel.make_graphed_callables(m, (torch.zeros(5, 8, device="accel"),))
    worst = 0.0
    for seed in range(3):
        a = torch.randn(5, 8, generator=torch.Generator().manual_seed(seed))
        worst = max(worst, (gm(a.to("accel")).cpu() - cpu(a)).abs().max().item())
    report(worst=worst, same_module=gm is m)
    """)
    assert r["worst"] < 1e-5 and r["same_module"] is True, r
