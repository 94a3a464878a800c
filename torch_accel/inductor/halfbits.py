"""16-bit floats in generated kernels, as their bits.

The kernel language has no float16 or bfloat16 buffers (docs/kernels.md: its dtypes are
the integer types, float32, float64 and bool). A generated kernel therefore gets such a
buffer as uint16 (launcher.py) and converts: a load decodes the bits into a float, a store
rounds a float to the nearest 16-bit value (ties to even, as torch's casts do) and encodes
it. Only arithmetic the language has is used: no bit casts, no frexp.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Format(NamedTuple):
    """A binary16-style format: mantissa bits and exponent bias."""

    mbits: int
    bias: int

    @property
    def emax_field(self) -> int:  # the all-ones exponent field (inf, NaN)
        return 2 * self.bias + 1

    @property
    def inf_bits(self) -> int:
        return self.emax_field << self.mbits

    @property
    def overflow(self) -> float:
        """Magnitudes at or above this round to infinity."""
        return (2.0 - 2.0 ** -(self.mbits + 1)) * 2.0 ** self.bias


FORMATS = {torch.float16: Format(10, 15), torch.bfloat16: Format(7, 127)}


def decode(bits: str, fmt: Format) -> str:
    """An expression: the float64 value of the 16-bit pattern ``bits`` (a uint16 load)."""
    e = f"(({bits} >> {fmt.mbits}) & {fmt.emax_field})"
    m = f"({bits} & {(1 << fmt.mbits) - 1})"
    sign = f"(-1.0 if {bits} >= 32768 else 1.0)"
    inf = "(1e308 * 10.0)"
    special = f"({inf} if {m} == 0 else ({inf} - {inf}))"
    normal = f"(({1 << fmt.mbits} + {m}) * 2.0 ** ({e} - {fmt.bias + fmt.mbits}))"
    sub = f"({m} * {2.0 ** (1 - fmt.bias - fmt.mbits)!r})"
    return f"({sign} * ({sub} if {e} == 0 else ({special} if {e} == {fmt.emax_field} " \
           f"else {normal})))"


def encode(value: str, out: str, fmt: Format, tag: str) -> list[str]:
    """Statements setting ``out`` to the bits of ``value`` rounded to ``fmt`` (ties to
    even); ``tag`` makes the temporaries' names unique."""
    a, e, q, m, r = (f"_h{tag}{c}" for c in "aeqmr")
    one = 1 << fmt.mbits
    return [
        f"{a} = abs(float({value}))",
        f"if {value} != {value}:",
        f"    {out} = {fmt.inf_bits | (1 << (fmt.mbits - 1))}",
        f"elif {a} >= {fmt.overflow!r}:",
        f"    {out} = {fmt.inf_bits}",
        f"elif {a} < {2.0 ** (1 - fmt.bias)!r}:",  # subnormal (or zero)
        f"    {q} = {a} * {2.0 ** (fmt.bias - 1 + fmt.mbits)!r}",
        f"    {m} = floor({q})",
        f"    {r} = {q} - {m}",
        f"    if {r} > 0.5 or ({r} == 0.5 and {m} % 2 == 1):",
        f"        {m} = {m} + 1",
        f"    {out} = {m}",  # m == 2**mbits is the smallest normal's encoding
        "else:",
        f"    {e} = int(floor(log({a}) * 1.4426950408889634))",
        f"    if 2.0 ** {e} > {a}:",
        f"        {e} = {e} - 1",
        f"    if 2.0 ** ({e} + 1) <= {a}:",
        f"        {e} = {e} + 1",
        f"    {q} = {a} * 2.0 ** ({fmt.mbits} - {e})",
        f"    {m} = floor({q})",
        f"    {r} = {q} - {m}",
        f"    if {r} > 0.5 or ({r} == 0.5 and {m} % 2 == 1):",
        f"        {m} = {m} + 1",
        f"    if {m} == {2 * one}:",
        f"        {m} = {one}",
        f"        {e} = {e} + 1",
        f"    {out} = ({e} + {fmt.bias}) * {one} + {m} - {one}",
        f"if {value} < 0 or ({value} == 0 and 1.0 / {value} < 0):",
        f"    {out} = {out} + 32768",
    ]
