"""Operator correctness against torch's CPU kernels with torch's own OpInfo database:
every sample input of every natively implemented operator (``torch_accel.ops``) gives the
CPU result within torch's default tolerance for the dtype (``torch.testing.assert_close``),
NaNs where the CPU has them. One process per group: the samples of a group share one
interpreter (and its compiled kernels).

Each group also names the operators it may leave to the CPU fallback (overloads that have
no device kernel, such as ``round(decimals=)`` or a clamp by tensors); any other fallback
means a native kernel was skipped, and fails the test.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(600)

ELEMENTWISE = ("add sub mul div remainder floor_divide pow maximum minimum eq ne lt le gt ge "
               "where logical_and logical_or logical_xor logical_not isnan signbit neg abs "
               "exp log log2 log10 log1p expm1 sqrt rsqrt reciprocal sin cos tan tanh sigmoid "
               "nn.functional.relu nn.functional.gelu nn.functional.silu sign floor ceil trunc "
               "round clamp nn.functional.leaky_relu nn.functional.hardtanh nan_to_num zero_ fill")
INTEGER = ("add sub mul div remainder floor_divide maximum minimum bitwise_and bitwise_or "
           "bitwise_xor bitwise_not eq lt where neg abs sign clamp sum prod amax amin argmax "
           "argmin max min any all cat stack index_select")
REDUCE_NN = ("sum mean prod amax amin argmax argmin max min any all mm bmm addmm "
             "nn.functional.linear matmul softmax log_softmax nn.functional.cross_entropy "
             "nn.functional.nll_loss nn.functional.embedding index_select cat stack")

GROUPS = {
    "elementwise-float32": (ELEMENTWISE, "float32", {"aten::round.decimals_out", "aten::clamp.Tensor_out"}),
    "integer-int64": (INTEGER, "int64", {"aten::clamp.Tensor_out", "aten::index_select", "aten::cat"}),
    "reduce-nn-float32": (REDUCE_NN, "float32", {"aten::cat", "aten::index_select"}),
}

SCRIPT = """
import collections
from torch.testing._internal.common_methods_invocations import op_db
from torch.utils._pytree import tree_map
names, dtype = {names!r}.split(), getattr(torch, {dtype!r})
by = collections.defaultdict(list)
for o in op_db:
    by[o.name].append(o)
to_accel = lambda t: t.to("accel") if isinstance(t, torch.Tensor) else t
to_cpu = lambda t: t.cpu() if isinstance(t, torch.Tensor) else t
bad, counted = [], 0
for name in names:
    assert by[name], name
    for info in by[name]:
        if dtype not in info.supported_dtypes("cpu"):
            continue
        for i, s in enumerate(info.sample_inputs("cpu", dtype)):
            counted += 1
            ref = info(s.input, *s.args, **s.kwargs)
            d = s.transform(to_accel)
            try:
                got = tree_map(to_cpu, info(d.input, *d.args, **d.kwargs))
                torch.testing.assert_close(got, ref, equal_nan=True, check_device=False)
            except Exception as e:
                bad.append(f"{{name}}.{{info.variant_test_name}}[{{i}}]: {{str(e).splitlines()[0]}}")
print(counted >= len(names))  # every operator had samples
print(bad)
print(sorted(torch_accel.fallback_counts))
"""


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_native_operators_match_cpu_on_every_opinfo_sample(torch_run, group):
    names, dtype, allowed = GROUPS[group]
    lines = torch_run(SCRIPT.format(names=names, dtype=dtype), timeout=580)
    assert lines[:2] == ["True", "[]"]
    assert set(eval(lines[2])) <= allowed  # noqa: S307 - our own subprocess's list
