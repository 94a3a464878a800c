"""Tensors in device memory: storages are runtime blocks, copies every way, pinned memory,
views and strides, serialisation (OpenReg's test_storage and the copy half of test_ops)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(240)


def test_storage_is_a_device_block_never_mapped_and_counted(torch_run):
    lines = torch_run("""
        x = torch.arange(1 << 16, dtype=torch.float32)
        before = torch.accel.memory_allocated()
        d = x.to("accel")
        print(d.device, d.data_ptr() != 0, d.untyped_storage().device)
        print(torch.accel.memory_allocated() - before >= x.nbytes)
        maps = open("/proc/self/maps").read()
        print("vram" in maps)                                # device memory is not mapped
        print(d.cpu().equal(x), d.to("cpu").dtype)
        try:
            d.numpy()
        except TypeError as e:
            print("numpy:", "accel" in str(e))
        del d
        print(torch.accel.memory_allocated() == before)
    """)
    assert lines == ["accel:0 True accel:0", "True", "False", "True torch.float32",
                     "numpy: True", "True"]


def test_copies_host_device_peer_any_strides_and_dtypes(torch_run):
    lines = torch_run("""
        x = torch.arange(24, dtype=torch.float32).reshape(4, 6)
        d = x.to("accel")
        checks = {
            "transpose": d.t().contiguous().cpu().equal(x.t().contiguous()),
            "slice": d[1:3, ::2].cpu().equal(x[1:3, ::2]),
            "to int64": d.to(torch.int64).cpu().equal(x.to(torch.int64)),
            "to bool": d.bool().cpu().equal(x.bool()),
            "half": d.half()[:, 1].cpu().equal(x.half()[:, 1]),
            "peer": d.to("accel:1").cpu().equal(x),
            "peer strided": d.t().to("accel:1").cpu().equal(x.t()),
            "broadcast": torch.empty(3, 6, device="accel").copy_(d[0]).cpu().equal(x[0].expand(3, 6)),
            "into strided": torch.zeros(6, 4, device="accel").t().copy_(x).cpu().equal(x),
            "host strided": x.t().to("accel").cpu().equal(x.t()),
            "item": d[2, 3].item() == 15.0,
            "clone": d.clone().cpu().equal(x),
            "item of [1, 1]": torch.ones(1, 1, device="accel").item() == 1.0,
            # a copy to the host is an ordinary CPU tensor: its storage can still grow
            "host copy resizable": d.cpu().resize_(100).shape == (100,),
            "copy_ into resizable": torch.empty(4, 6).copy_(d).resize_(50).numel() == 50,
        }
        print([k for k, ok in checks.items() if not ok])
        print(d.to("accel:1").device, torch.empty(2, device="accel:1").device)
    """)
    assert lines == ["[]", "accel:1 accel:1"]


def test_non_blocking_copies_with_pinned_memory_are_stream_ordered(torch_run):
    """A pinned source or destination makes ``non_blocking=True`` asynchronous on the
    current stream: the copy is queued behind a kernel that keeps the stream busy, and
    the data is there once the stream is synchronised."""
    lines = torch_run("""
        x = torch.arange(1 << 20, dtype=torch.float32)
        p = x.pin_memory()
        print(p.is_pinned(), x.is_pinned())
        d = torch.empty_like(x, device="accel")
        torch.accel._sleep(2_000_000)
        d.copy_(p, non_blocking=True)
        print(torch.accel.current_stream().query())          # still queued behind the sleep
        h = torch.empty_like(x).pin_memory()
        h.copy_(d, non_blocking=True)
        torch.accel.current_stream().synchronize()
        print(h.equal(x))
    """)
    assert lines == ["True False", "False", "True"]


def test_save_and_load_with_map_location(torch_run):
    lines = torch_run("""
        x = torch.arange(12, dtype=torch.float64).reshape(3, 4)
        b = io.BytesIO(); torch.save({"w": x.to("accel:1"), "v": x.to("accel")[:, 1]}, b)
        for where in (None, "cpu", "accel:1", {"accel:1": "accel:0"}):
            b.seek(0)
            obj = torch.load(b, map_location=where)
            print(where, obj["w"].device, obj["w"].cpu().equal(x), obj["v"].cpu().equal(x[:, 1]))
    """)
    assert lines == ["None accel:1 True True", "cpu cpu True True",
                     "accel:1 accel:1 True True", "{'accel:1': 'accel:0'} accel:0 True True"]


def test_resize_and_untyped_storage(torch_run):
    lines = torch_run("""
        d = torch.arange(4, dtype=torch.float32).to("accel")
        d.resize_(10)
        print(d.shape, d[:4].cpu().tolist())                 # the old elements kept
        s = torch.UntypedStorage(64, device="accel")
        print(s.device, s.nbytes())
        t = torch.empty(0, device="accel").set_(d.untyped_storage(), 2, (2,), (1,))
        print(t.cpu().tolist())
    """)
    assert lines == ["torch.Size([10]) [0.0, 1.0, 2.0, 3.0]", "accel:0 64", "[2.0, 3.0]"]


def test_pinned_storages_location_tags_and_restore_locations(torch_run):
    """Pinned host storages stay pinned through slices and rewrapping; storages carry
    their device as serialisation's location tag, and a tag restores onto that device."""
    lines = torch_run("""
        import warnings
        warnings.simplefilter("ignore")  # TypedStorage's deprecation
        pinned = torch.arange(10.0).pin_memory()
        rewrapped = torch.tensor((), dtype=torch.float32).set_(
            pinned.untyped_storage()[8:], size=(5,), stride=(1,), storage_offset=0)
        print(pinned[2:5].is_pinned(), rewrapped.is_pinned(), rewrapped.data_ptr() != pinned.data_ptr(),
              rewrapped.equal(pinned[2:7]))
        for s in (torch.randn(10).storage(), torch.randn(10).untyped_storage()):
            print(s.is_pinned("accel"), s.pin_memory("accel").is_pinned("accel"))
        tag = torch.serialization.location_tag
        print(tag(torch.UntypedStorage(4, device="accel")), tag(torch.UntypedStorage(4, device="accel:1")),
              tag(torch.empty(2, device="accel:1").storage()))
        cpu = torch.arange(4.0).storage()
        for where in ("accel:0", "accel:1"):
            restored = torch.serialization.default_restore_location(cpu, where)
            print(restored.is_accel, restored.device, restored.cpu().tolist())
    """)
    assert lines == ["True True True True", "False True", "False True", "accel:0 accel:1 accel:1",
                     "True accel:0 [0.0, 1.0, 2.0, 3.0]", "True accel:1 [0.0, 1.0, 2.0, 3.0]"]
