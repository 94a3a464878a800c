"""The page maps a kernel's managed variant marks (firmware/lower/render.py,
firmware/managed.py), compiled and run in-process: which 64 KiB pages each kind of access
marks, exactly. The migration itself, on a real mount: tests/runtime/test_memory.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from firmware import jit, kernel_check
from firmware.jit import Options
from test_jit_unit import ir_of

PAGE = 65536 // 4  # float32 elements per page


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> jit.KernelCache:
    return jit.KernelCache(Path(tmp_path_factory.mktemp("jit")))


def run(cache: jit.KernelCache, src: str, types: tuple[str, ...], args: list,
        grid: tuple[int, int, int], block: tuple[int, int, int],
        options: Options = Options(), ndims: dict[str, int] | None = None) -> None:
    k = cache.get(ir_of(src, ndims), types, options)
    k.run(0, grid[0] * grid[1] * grid[2], grid, block, args, np.zeros(1, np.int64))


PICK = """
def pick(x, o, k):
    o[0] = x[k]
"""
PICK_T = ("float32[1d]@managed", "float32[1d]", "int64")


def marks(count: int, *pages: int) -> list[int]:
    return [int(p in pages) for p in range(count)]


@pytest.mark.timeout(300)
def test_each_kind_of_access_marks_exactly_its_pages(cache):
    x, o = np.ones(4 * PAGE, np.float32), np.zeros(1, np.float32)
    pm = np.zeros(4, np.uint8)
    run(cache, PICK, PICK_T, [x, o, np.int64(3 * PAGE + 5), pm, 0], (1, 1, 1), (1, 1, 1))
    assert pm.tolist() == marks(4, 3)  # a checked (hoisted) load
    pm[:] = 0  # the buffer's first byte 65530 bytes into its first page: element 2 is in page 1
    run(cache, PICK, PICK_T, [x, o, np.int64(2), pm, 65530], (1, 1, 1), (1, 1, 1))
    assert pm.tolist() == marks(4, 1)
    pm[:] = 0  # a load under a conditional expression (the load helper)
    run(cache, "def cond(x, o, k):\n    o[0] = x[k] if k > 0 else 0.0\n", PICK_T,
        [x, o, np.int64(PAGE + 1), pm, 0], (1, 1, 1), (1, 1, 1))
    assert pm.tolist() == marks(4, 1)
    pm[:] = 0  # an affine store, range-checked per block: the block's box
    fill = "def fill(x, v):\n    i = global_id(0)\n    if i < x.shape[0]:\n        x[i] = v\n"
    run(cache, fill, ("float32[1d]@managed", "float32"), [x, np.float32(2), pm, 0],
        (1, 1, 1), (256, 1, 1))
    assert pm.tolist() == marks(4, 0) and x[255] == 2 and x[256] == 1
    run(cache, fill, ("float32[1d]@managed", "float32"), [x, np.float32(2), pm, 0],
        (4 * PAGE // 256, 1, 1), (256, 1, 1))
    assert pm.tolist() == [1, 1, 1, 1] and (x == 2).all()
    pm[:] = 0  # unchecked code marks the whole buffer
    run(cache, PICK, PICK_T, [x, o, np.int64(2), pm, 0], (1, 1, 1), (1, 1, 1),
        Options(boundscheck=False))
    assert pm.tolist() == [1, 1, 1, 1]
    pm[:] = 0  # a bounds miss marks nothing and faults as on any other memory
    with pytest.raises(jit.KernelFault) as caught:
        run(cache, PICK, PICK_T, [x, o, np.int64(4 * PAGE), pm, 0], (1, 1, 1), (1, 1, 1))
    assert (caught.value.kind, caught.value.param, caught.value.index) == ("bounds", "x", 4 * PAGE)
    assert pm.tolist() == [0, 0, 0, 0]


@pytest.mark.timeout(300)
def test_a_two_dimensional_box_marks_the_rows_it_covers(cache):
    a = np.zeros((512, 128), np.float32)  # 128 rows per page
    pm = np.zeros(4, np.uint8)
    src = "def fill2(a, v):\n    a[global_id(1), global_id(0)] = v\n"
    types = ("float32[2d]@managed", "float32")
    run(cache, src, types, [a, np.float32(1), pm, 0], (1, 9, 1), (16, 16, 1), ndims={"a": 2})
    assert pm.tolist() == marks(4, 0, 1)  # blocks of rows 0-143: pages 0 and 1
    assert a.sum() == 16 * 144


def test_managed_is_a_buffer_type_of_its_own():
    t = kernel_check.ArgType.parse("float32[2d]@managed")
    assert (t.dtype, t.ndim, t.managed) == ("float32", 2, True)
    assert not kernel_check.ArgType.parse("float32[2d]").managed
    assert len(t.extra_numba_types()) == 2
    with pytest.raises(kernel_check.KernelCompileError):
        kernel_check.ArgType.parse("float32@managed")


@pytest.mark.timeout(300)
def test_matrix_unit_operands_are_marked_whole(cache):
    from runtime import kernel_lib, kernels

    ir = kernels.compile_module(kernel_lib.SOURCE)["kernels"]["matmul"]
    a, b = np.ones((128, 256), np.float32), np.ones((256, 128), np.float32)  # 2 pages each
    c = np.zeros((128, 128), np.float32)
    pa, pc = np.zeros(2, np.uint8), np.zeros(1, np.uint8)
    k = cache.get(ir, ("float32[2d]@managed", "float32[2d]", "float32[2d]@managed"),
                        Options())
    k.run(0, 1, (1, 1, 1), (32, 1, 1), [a, b, c, pa, 0, pc, 0], np.zeros(1, np.int64))
    assert pa.tolist() == [1, 1] and pc.tolist() == [1] and (c == 256).all()


@pytest.mark.timeout(300)
def test_a_vectorised_phase_marks_the_pages_its_block_reads(cache):
    """reduce_sum's strided phase runs vectorised (``_phv``, under the block's range
    checks): its managed input's page marks come from the block's index box, so a grid
    over the first two of four pages marks those two and no others."""
    from runtime import kernel_lib
    from runtime.kernels import compile_module

    k = cache.get(compile_module(kernel_lib.SOURCE)["kernels"]["reduce_sum"],
                  ("float32[1d]@managed", "float64[1d]"), Options())
    assert "_phv" in k.source  # the phase this test is about
    x = np.ones(2 * PAGE, np.float32)  # a view of the first half of a 4-page mapping
    total, pm = np.zeros(1), np.zeros(4, np.uint8)
    k.run(0, 8, (8, 1, 1), (256, 1, 1), [x, total, pm, 0], np.zeros(1, np.int64))
    assert total[0] == 2 * PAGE and pm.tolist() == marks(4, 0, 1)
