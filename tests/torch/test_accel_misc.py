"""The backend's registration (OpenReg's test_misc): the renamed PrivateUse1 key and its
guards, the device module, the generated tensor/module/storage/PackedSequence methods,
legacy type strings, and torch.accelerator agreeing with torch.accel."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(120)


def test_backend_name_device_module_and_their_guards(torch_run):
    """The name and the module are set once: renaming to the same name is allowed, anything
    else is refused with torch's messages."""
    lines = torch_run("""
        import types
        print(torch._C._get_privateuse1_backend_name(), torch.get_device_module("accel").__name__)
        torch.utils.rename_privateuse1_backend("accel")
        reg = torch.utils.backend_registration
        refusals = {
            "has already been set": lambda: torch.utils.rename_privateuse1_backend("dev"),
            "Expected one of cpu": lambda: torch._register_device_module("dev", types.ModuleType("m")),
            "The runtime module of": lambda: torch._register_device_module("accel", types.ModuleType("m")),
            "The custom device module of": lambda: torch.utils.generate_methods_for_privateuse1_backend(),
            "Try to call torch.accel": lambda: reg._get_custom_mod_func("no_such_function"),
        }
        for expected, refuse in refusals.items():
            try:
                refuse()
                print(expected, "not refused")
            except RuntimeError as e:
                print(expected, "|", str(e).replace("\\n", " "))
        print(reg._get_custom_mod_func("device_count")())
        from torch._C._autograd import DeviceType
        from torch._C._profiler import ProfilerActivity
        print(repr(DeviceType.ACCEL), DeviceType.ACCEL == DeviceType.PrivateUse1)
        print(repr(ProfilerActivity.ACCEL), ProfilerActivity.ACCEL == ProfilerActivity.PrivateUse1)
    """)
    assert lines[0] == "accel torch_accel.accel", lines
    refused = [line.split(" | ", 1) for line in lines[1:6]]
    assert all(len(r) == 2 and r[0] in r[1] for r in refused), lines  # each says what it expects
    assert lines[6:] == ["2", "<DeviceType.ACCEL: 20> True", "<ProfilerActivity.ACCEL: 5> True"]


def test_generated_methods_move_tensors_modules_storages_and_sequences(torch_run):
    lines = torch_run("""
        import warnings
        warnings.simplefilter("ignore")  # TypedStorage's deprecation
        x = torch.arange(6.0).reshape(2, 3)
        print(x.is_accel, x.accel().is_accel, x.accel(1).device, x.accel(torch.device("accel:1")).device,
              x.accel().cpu().tolist())
        m = torch.nn.Linear(3, 2).accel(1)
        print(m.weight.device, type(m.weight).__name__, m(x.accel(1)).device)
        print(x.untyped_storage().is_accel, x.untyped_storage().accel().is_accel,
              x.storage().accel().is_accel, x.accel().storage().is_accel, x.accel().storage().size())
        seq = torch.nn.utils.rnn.PackedSequence(torch.rand(5, 3), torch.tensor([1, 1, 1, 1, 1]))
        print(seq.is_accel, seq.accel().is_accel, seq.accel().data.is_accel)
        names = {torch.bool: "Bool", torch.float64: "Double", torch.float32: "Float",
                 torch.float16: "Half", torch.int32: "Int", torch.int64: "Long", torch.int8: "Char",
                 torch.int16: "Short", torch.uint8: "Byte"}
        print([d for d, n in names.items()
               if torch.empty(2, dtype=d, device="accel").type() != f"torch.accel.{n}Tensor"])
        print(x.accel().storage().type(), x.storage().type())
    """)
    assert lines == ["False True accel:1 accel:1 [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]",
                     "accel:1 Parameter accel:1",
                     "False True True True 6", "False True True", "[]",
                     "torch.storage.TypedStorage torch.FloatStorage"]


def test_torch_accelerator_agrees_with_torch_accel(torch_run):
    lines = torch_run("""
        acc = torch.accelerator
        print(acc.current_accelerator(), torch._C._get_accelerator(), acc.device_count(), torch.accel.device_count())
        torch.accel.set_device(1)
        s = torch.accel.Stream()
        torch.accel.set_stream(s)
        x = torch.empty(1 << 16, device="accel")
        print(acc.current_device_index(), acc.current_stream() == torch.accel.current_stream() == s)
        print(acc.memory_allocated(), torch.accel.memory_allocated(1))
        print(acc.get_memory_info(), torch.accel.mem_get_info(1))
    """)
    accelerator, backend, count, accel_count = lines[0].split()
    assert (accelerator, backend) == ("accel", "accel") and count == accel_count, lines
    assert lines[1] == "1 True", lines
    allocated, allocated_1 = map(int, lines[2].split())
    assert allocated == allocated_1 > 0, lines
    info, info_1 = lines[3].split(") (")
    assert info + ")" == "(" + info_1, lines

