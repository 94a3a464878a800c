"""The tiles of an ``mm`` launch (torch_accel/kernels/matmul.py ``_config``): every block
one tile of ``out``, the tiles covering it exactly, near-equal, none larger than
``MAX_ROWS`` x ``MAX_COLS``, and a product worth ``SHARE_WORK`` per engine cut so that each of the
device's compute engines gets an equal share of tiles."""

from __future__ import annotations

import pytest

from torch_accel.kernels import matmul
from torch_accel.kernels.matmul import ALIGN, MAX_COLS, MAX_ROWS, ROUNDS, SHARE_WORK, _config

pytestmark = pytest.mark.timeout(60)

#: (m, n, k): the MLP step's products, mm 1024, ragged and degenerate shapes
SHAPES = [(64, 256, 784), (256, 256, 1024), (64, 256, 4096), (6, 25, 50176), (64, 10, 256),
          (64, 256, 10), (10, 256, 64), (256, 784, 64), (1024, 1024, 1024), (1000, 1000, 1000),
          (300, 520, 40), (65, 33, 130), (1, 1, 1), (17, 5000, 100), (20, 20, 100_000),
          (4096, 16, 4096), (1, 1, 1 << 30), (7, 3, 1)]


@pytest.mark.parametrize("engines", [1, 2, 3, 8])
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_tiles_cover_the_output_exactly_and_share_it_between_the_engines(m, n, k, engines):
    config = _config(m, n, k, engines)
    grid_n, grid_m = config.grid
    assert config.threads == matmul.THREADS
    assert 1 <= config.tile_m <= min(m, MAX_ROWS) and 1 <= config.tile_n <= min(n, MAX_COLS)
    for extent, tile, blocks in ((m, config.tile_m, grid_m), (n, config.tile_n, grid_n)):
        assert tile == extent or tile % ALIGN == 0, config
        assert (blocks - 1) * tile < extent <= blocks * tile, config  # no empty block
    tiles = grid_m * grid_n
    if m * n * k >= SHARE_WORK * engines:
        cut_out = config.tile_m <= ALIGN and config.tile_n <= ALIGN
        assert tiles % engines == 0 or tiles >= ROUNDS * engines or cut_out, config
    else:
        assert (grid_n, grid_m) == (-(-n // MAX_COLS), -(-m // MAX_ROWS)), config


def test_large_products_are_shared_and_small_ones_keep_their_tiles():
    # mm 1024: two tiles of the unit's own 1024 x 512 chunk, one per engine of two (every
    # row in each: BLAS packs the right operand once per call, for all of the call's rows)
    for engines in (1, 2):
        assert _config(1024, 1024, 1024, engines) == matmul.Config(
            (2, 1), matmul.THREADS, 1024, 512)
    assert _config(1024, 1024, 1024, 4) == matmul.Config((2, 2), matmul.THREADS, 512, 512)
    assert _config(1024, 1024, 1024, 3).grid == (2, 3)  # six: two per engine
    # an MLP's weight gradient g.T @ x (256 x 784 over 64): two near-equal tiles, not a
    # full one and one of 272 columns
    assert _config(256, 784, 64, 2) == matmul.Config((2, 1), matmul.THREADS, 256, 400)
    # one tile over k 1024 (67 M multiply-adds): a half for each of two engines
    assert _config(256, 256, 1024, 2) == matmul.Config((1, 2), matmul.THREADS, 128, 256)
    assert _config(256, 256, 1024, 1).grid == (1, 1)
    # an MLP's x @ W1.T (64 x 256 over 784, 13 M): a second engine's job costs more
    assert _config(64, 256, 784, 2) == matmul.Config((1, 1), matmul.THREADS, 64, 256)
    # a convolution's weight gradient (6 x 25 over 50176): one block, not two thin ones
    assert _config(6, 25, 50176, 2).grid == (1, 1)
