"""DLPack (OpenReg's test_dlpack, torch.cuda's semantics): an accel tensor exported with
``to_dlpack`` or handed to ``torch.from_dlpack`` comes back as a tensor sharing its device
memory -- writes through either show in the other, views export their own window, the
import outlives the producer's name -- and operators run on it like on any accel tensor."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(200)


def test_dlpack_round_trip_shares_storage(torch_json):
    r = torch_json("""
        from torch.utils.dlpack import to_dlpack
        x = torch.arange(6, dtype=torch.float32, device="accel")
        y = torch.from_dlpack(to_dlpack(x))          # through a capsule
        z = torch.from_dlpack(x)                     # through __dlpack__
        report(device=list(x.__dlpack_device__()), types=[str(y.device), str(z.device)],
               same_ptr=[y.data_ptr() == x.data_ptr(), z.data_ptr() == x.data_ptr()])
        y.add_(10)                                   # a kernel writing through the import
        z[0] = -1                                    # a copy into the import
        x[5] = 50                                    # and one into the producer
        report(x=x.cpu().tolist(), y=y.cpu().tolist(), z=z.cpu().tolist())
    """)
    assert r["device"] == [12, 0], r                 # kDLExtDev, as torch maps PrivateUse1
    assert r["types"] == ["accel:0", "accel:0"] and r["same_ptr"] == [True, True], r
    want = [-1.0, 11.0, 12.0, 13.0, 14.0, 50.0]
    assert r["x"] == want and r["y"] == want and r["z"] == want, r


def test_dlpack_of_views_devices_and_lifetime(torch_json):
    """A view exports its own first element (the import's storage starts inside the
    producer's block); a tensor on accel:1 stays on accel:1; the import keeps the memory
    alive after the producer is gone; operators of every kind run on imports."""
    r = torch_json("""
        import gc
        x = torch.arange(12, dtype=torch.float32, device="accel").reshape(3, 4)
        row = torch.from_dlpack(x[1])
        cols = torch.from_dlpack(x[:, 1:3])          # strided
        row.mul_(2)
        report(x=x.cpu().tolist(), cols=cols.cpu().tolist(), strides=list(cols.stride()),
               mm=(cols.T @ cols).cpu().tolist(), sum=row.sum().item())
        x1 = torch.ones(3, device="accel:1")
        w1 = torch.from_dlpack(x1)
        report(dev1=str(w1.device), w1=(w1 * 3).cpu().tolist())
        del x; gc.collect()
        torch.empty(48, device="accel").fill_(-7)    # memory the producer held, were it freed
        report(after=row.cpu().tolist())
    """)
    x = [[0.0, 1.0, 2.0, 3.0], [8.0, 10.0, 12.0, 14.0], [8.0, 9.0, 10.0, 11.0]]
    assert r["x"] == x, r
    assert r["cols"] == [row[1:3] for row in x] and r["strides"] == [4, 1], r
    cols = [row[1:3] for row in x]
    want = [[sum(c[i] * c[j] for c in cols) for j in range(2)] for i in range(2)]
    assert r["mm"] == want and r["sum"] == 44.0, r
    assert r["dev1"] == "accel:1" and r["w1"] == [3.0] * 3, r
    assert r["after"] == x[1], r
