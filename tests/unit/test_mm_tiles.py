"""The tiles of an ``mm`` launch (torch_accel/kernels/matmul.py ``_config``): every block
one tile of ``out``, the tiles covering it exactly, none larger than ``MAX_TILE``, and a
product large enough to share cut so that each of the device's compute engines gets an
equal share (an MLP's ``64 x 256`` product over 784 was one block: one engine idled)."""

from __future__ import annotations

import pytest

from torch_accel.kernels import matmul
from torch_accel.kernels.matmul import ALIGN, MAX_TILE, ROUNDS, SPLIT_WORK, _config

pytestmark = pytest.mark.timeout(60)

#: (m, n, k): the MLP step's products, mm 1024, ragged and degenerate shapes
SHAPES = [(64, 256, 784), (64, 10, 256), (64, 256, 10), (10, 256, 64), (256, 784, 64),
          (1024, 1024, 1024), (1000, 1000, 1000), (300, 520, 40), (65, 33, 130), (1, 1, 1),
          (17, 5000, 100), (20, 20, 100_000), (4096, 16, 4096), (1, 1, 1 << 30), (7, 3, 1)]


@pytest.mark.parametrize("engines", [1, 2, 3, 8])
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_tiles_cover_the_output_exactly_and_share_it_between_the_engines(m, n, k, engines):
    config = _config(m, n, k, engines)
    grid_n, grid_m = config.grid
    assert config.threads == matmul.THREADS
    assert 1 <= config.tile_m <= min(m, MAX_TILE) and 1 <= config.tile_n <= min(n, MAX_TILE)
    for extent, tile, blocks in ((m, config.tile_m, grid_m), (n, config.tile_n, grid_n)):
        assert tile == extent or tile % ALIGN == 0, config
        assert (blocks - 1) * tile < extent <= blocks * tile, config  # no empty block
    tiles = grid_m * grid_n
    if m * n * k >= SPLIT_WORK:
        cut_out = config.tile_m <= ALIGN and config.tile_n <= ALIGN
        assert tiles % engines == 0 or tiles >= ROUNDS * engines or cut_out, config
    else:
        assert (grid_n, grid_m) == (-(-n // MAX_TILE), -(-m // MAX_TILE)), config


def test_the_mlp_products_use_every_engine_and_small_ones_stay_one_block():
    # x @ W1.T of a 784-256 layer, batch 64: one 64 x 256 tile before, two halves now
    assert _config(64, 256, 784, 2) == matmul.Config((2, 1), matmul.THREADS, 64, 128)
    # its weight's gradient g.T @ x: four near-equal tiles, not three full and one of 16
    assert _config(256, 784, 64, 2) == matmul.Config((4, 1), matmul.THREADS, 256, 208)
    # mm 1024: sixteen 256 x 256 tiles, eight per engine, whatever the engines
    for engines in (1, 2, 3, 4):
        assert _config(1024, 1024, 1024, engines).grid == (4, 4)
    # the 256-10 layer's products are a few microseconds of BLAS: one block
    for m, n, k in ((64, 10, 256), (64, 256, 10), (10, 256, 64)):
        assert _config(m, n, k, 2).grid == (1, 1)
