"""Counter-based random numbers: Philox-4x32-10 (Salmon et al., SC'11, as in cuRAND and
torch), so element ``i``'s value depends only on (seed, offset, i), never on the grid.

Thread ``g`` runs Philox once on the 128-bit counter ``(offset + g) mod 2**64`` (low
word first; the upper two words 0) under the key ``(seed mod 2**32, seed >> 32 mod
2**32)`` and gets four 32-bit words: four float32 (or int/bool) outputs ``4g .. 4g+3``, or
two float64 outputs ``2g, 2g+1`` (53 bits from each pair of words). One call therefore
consumes :func:`counters` ``(n, dtype)`` counter values: the caller advances ``offset`` by
that for the next call.

- uniform: ``low + (high - low) * u``, u = 24 (float64: 53) random bits / 2**bits, in [0, 1);
- normal: Box-Muller on word pairs, ``mean + std * r * (cos, sin)(2 pi u2)`` with
  ``r = sqrt(-2 log u1)`` and u1 in (0, 1];
- bernoulli: ``u < p`` (1 or 0, in the output's dtype; p is the probability of 1).

The language's integers are typed by numba; every value here is kept in int64 below
2**32 (products of two 32-bit words wrap in int64 and their high word is recovered with
a shift and a mask), so no uint64 arithmetic, whose mixing with int64 numba types as
float64, is involved.
"""

from __future__ import annotations

import enum

import numpy as np

import runtime
from torch_accel.kernels import _shared as shared
from torch_accel.kernels._shared import Array

M0, M1 = 0xD2511F53, 0xCD9E8D57
W0, W1 = 0x9E3779B9, 0xBB67AE85
ROUNDS = 10


class Dist(enum.IntEnum):
    """The distributions ``philox`` writes."""

    uniform = 0
    normal = 1
    bernoulli = 2


def _rounds() -> str:
    """Philox's ten rounds on words x0..x3 with the key in y0, y1 (kernel text; scalar
    parameters cannot be assigned)."""
    out = []
    for r in range(ROUNDS):
        if r:
            out += [f"y0 = (y0 + {W0}) & 4294967295", f"y1 = (y1 + {W1}) & 4294967295"]
        out += [f"p0 = {M0} * x0", f"p1 = {M1} * x2",
                "x0 = ((p1 >> 32) & 4294967295) ^ x1 ^ y0", "x1 = p1 & 4294967295",
                "x2 = ((p0 >> 32) & 4294967295) ^ x3 ^ y1", "x3 = p0 & 4294967295"]
    return "\n".join("    " + s for s in out)


def _outputs(wide: bool) -> str:
    """Kernel text storing thread g's outputs for each distribution (``wide``: float64,
    two outputs from (x0, x1) and (x2, x3); else four)."""
    if wide:
        us = ["((x0 & 2097151) * 4294967296 + x1) * 1.1102230246251565e-16",
              "((x2 & 2097151) * 4294967296 + x3) * 1.1102230246251565e-16"]
        half = 1.1102230246251565e-16
    else:
        us = [f"(x{q} & 16777215) * 5.960464477539063e-08" for q in range(4)]
        half = 5.960464477539063e-08
    width = len(us)
    lines = [f"base = g * {width}"]
    lines += [f"u{q} = {u}" for q, u in enumerate(us)]
    # normals: Box-Muller on pairs (u0, u1), (u2, u3), the first shifted into (0, 1] for the log
    norm = []
    for q in range(0, width, 2):
        norm += [f"r{q} = sqrt(-2.0 * log(u{q} + {half}))",
                 f"z{q} = a + b * r{q} * cos(6.283185307179586 * u{q + 1})",
                 f"z{q + 1} = a + b * r{q} * sin(6.283185307179586 * u{q + 1})"]
    stores = {Dist.uniform: [f"v{q} = a + (b - a) * u{q}" for q in range(width)],
              Dist.normal: norm + [f"v{q} = z{q}" for q in range(width)],
              Dist.bernoulli: [f"v{q} = 1 if u{q} < a else 0" for q in range(width)]}
    text = [*lines, shared.dispatch({d: "\n".join(s) for d, s in stores.items()}, "")]
    for q in range(width):
        text += [f"if base + {q} < n:", f"    out[base + {q}] = v{q}"]
    return "\n".join("    " + s for t in text for s in t.split("\n"))


def _source() -> str:
    parts = []
    for name, wide in (("philox", False), ("philox_wide", True)):
        parts.append(f"""def {name}(out, k0: 'int64', k1: 'int64', offset: 'int64', n: 'int64',
            op: 'int64', a: 'float64', b: 'float64'):
    g = global_id(0)
    if g * {2 if wide else 4} >= n:
        return
    c = offset + g
    x0 = c & 4294967295
    x1 = (c >> 32) & 4294967295
    x2 = 0
    x3 = 0
    y0 = k0
    y1 = k1
{_rounds()}
{_outputs(wide)}
""")
    return "\n".join(parts)


SOURCE = _source()


def counters(n: int, dtype: np.dtype | str) -> int:
    """Counter values a call writing ``n`` elements of ``dtype`` consumes."""
    per = 2 if np.dtype(dtype) == np.float64 else 4
    return -(-n // per)


def _philox(out: Array, seed: int, offset: int, dist: Dist, a: float, b: float,
            stream: runtime.Stream | None) -> None:
    n = shared.size(out)
    if n == 0:
        return
    wide = out.dtype == np.float64
    threads = counters(n, out.dtype)
    k = shared.module("random", SOURCE, out.device).get_kernel("philox_wide" if wide else "philox")
    seed &= 2**64 - 1
    off = offset & (2**64 - 1)
    k[shared.grid(threads), shared.BLOCK](shared.flat(out), seed & 0xFFFFFFFF, seed >> 32,
                                          off - 2**64 if off >= 2**63 else off, n, int(dist),
                                          float(a), float(b), stream=shared.stream_of(out, stream))


def uniform(out: Array, seed: int, offset: int, low: float = 0.0, high: float = 1.0,
            stream: runtime.Stream | None = None) -> None:
    """Uniform in ``[low, high)`` (float32 or float64 ``out``)."""
    _philox(out, seed, offset, Dist.uniform, low, high, stream)


def normal(out: Array, seed: int, offset: int, mean: float = 0.0, std: float = 1.0,
           stream: runtime.Stream | None = None) -> None:
    """Normal with ``mean`` and ``std`` (float32 or float64 ``out``)."""
    _philox(out, seed, offset, Dist.normal, mean, std, stream)


def bernoulli_mask(out: Array, seed: int, offset: int, p: float,
                   stream: runtime.Stream | None = None) -> None:
    """1 with probability ``p``, else 0 (any dtype but float64 uses 24-bit uniforms, four
    per counter; a float64 ``out`` uses 53-bit ones, two per counter). For dropout pass
    the keep probability and scale separately."""
    _philox(out, seed, offset, Dist.bernoulli, p, 0.0, stream)
