"""A kernel with block-shared memory and a barrier: a sum per block, then on the host
(run: python examples/kernels.py against a serving accel-emud, ACCEL_EMU_ROOT set)."""

import numpy as np

import runtime


@runtime.kernel
def block_sums(x, out):
    tile = shared_array(256, "float32")
    t = local_id(0)
    i = global_id(0)
    tile[t] = x[i] if i < x.size else 0.0
    barrier()
    step = 128
    while step > 0:          # uniform across the block: barriers inside are allowed
        if t < step:
            tile[t] = tile[t] + tile[t + step]
        barrier()
        step = step // 2
    if t == 0:
        out[group_id(0)] = tile[0]


x = np.random.default_rng(0).random(1 << 16, dtype=np.float32)
blocks = x.size // 256
out = runtime.empty(blocks, np.float32)
block_sums[blocks, 256](runtime.to_device(x), out)
total = float(out.copy_to_host().sum())
assert np.isclose(total, float(x.sum()), rtol=1e-4), (total, float(x.sum()))
print(f"sum of {x.size} floats in {blocks} blocks: {total:.3f} (numpy {float(x.sum()):.3f})")
