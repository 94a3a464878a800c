"""The ``accel`` operators: device kernels where written (one module per family), every
other operator through the counted CPU fallback (fallback.py). ``_register.native`` lists
the natively implemented ``name.overload``s."""

from torch_accel.ops import (  # noqa: F401 - each registers its kernels
    attention,
    conv,
    copy,
    elementwise,
    fallback,
    geometry,
    linalg,
    nn,
    norm,
    pool,
    random,
    reduce,
    rnn,
    shape,
)
