"""The ``accel`` operators: device kernels where written (one module per family), every
other operator through the counted CPU fallback (fallback.py)."""

from torch_accel.ops import copy, fallback  # noqa: F401 - each registers its kernels
