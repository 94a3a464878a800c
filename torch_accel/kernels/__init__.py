"""The backend's device kernels, written in the runtime's kernel language and launched on
runtime arrays (``runtime.DeviceArray`` / ``DeviceView``): no torch in here, so each is
tested against numpy on its own (tests/torch/test_device_kernels.py).

Every function launches on ``stream`` (default: the current stream of the output's
device) and returns without synchronising. Modules are compiled once per device per
process, on first use; each (kernel, argument dtypes) is a numba compile in the firmware
on its first launch, so most kernels choose their operation by an op code (the enums).
"""

from torch_accel.kernels._shared import plane_tile
from torch_accel.kernels.conv import conv_direct, fold, fold_rows, swap01, unfold, unfold_rows
from torch_accel.kernels.elementwise import (
    Binary,
    Compare,
    Predicate,
    Unary,
    arange,
    binary,
    binary_launch,
    compare,
    fill,
    fill_launch,
    predicate,
    unary,
    unary_launch,
    where,
)
from torch_accel.kernels.layout import strided_copy
from torch_accel.kernels.matmul import bmm, mm, mm_plan
from torch_accel.kernels.nn import (
    Backward,
    Reduction,
    activation_backward,
    activation_backward_launch,
    gelu_backward,
    index_add_rows,
    index_rows,
    nll_loss_backward_launch,
    nll_loss_backward_rows,
    nll_loss_launch,
    nll_loss_rows,
    sigmoid_backward,
    softmax_backward_rows,
    softmax_backward_rows_launch,
    softmax_rows,
    softmax_rows_launch,
    tanh_backward,
    threshold_backward,
)
from torch_accel.kernels.pool import (
    adaptive_avg_pool2d,
    adaptive_avg_pool2d_backward,
    adaptive_max_pool2d,
    avg_pool2d,
    avg_pool2d_backward,
    disjoint_rows,
    halves,
    max_pool2d,
    max_pool2d_backward,
)
from torch_accel.kernels.random import bernoulli_mask, counters, normal, uniform
from torch_accel.kernels.reduce import Reduce, reduce_rows, var_rows
from torch_accel.kernels.sleep import sleep

__all__ = [
    "Backward", "Binary", "Compare", "Predicate", "Reduce", "Reduction", "Unary",
    "activation_backward", "activation_backward_launch", "adaptive_avg_pool2d",
    "adaptive_avg_pool2d_backward", "adaptive_max_pool2d", "arange", "avg_pool2d",
    "avg_pool2d_backward",
    "bernoulli_mask", "binary", "binary_launch", "bmm", "compare", "conv_direct",
    "counters", "disjoint_rows", "fill", "fill_launch", "fold", "fold_rows",
    "gelu_backward", "halves", "index_add_rows", "index_rows", "max_pool2d",
    "max_pool2d_backward", "mm", "mm_plan", "nll_loss_backward_launch",
    "nll_loss_backward_rows", "nll_loss_launch", "nll_loss_rows", "normal",
    "plane_tile", "predicate", "reduce_rows", "sigmoid_backward", "sleep",
    "softmax_backward_rows", "softmax_backward_rows_launch", "softmax_rows",
    "softmax_rows_launch", "strided_copy", "swap01", "tanh_backward",
    "threshold_backward", "unary", "unary_launch", "unfold", "unfold_rows", "uniform",
    "var_rows", "where",
]
