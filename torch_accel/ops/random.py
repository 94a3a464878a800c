"""Random numbers on the device: ``uniform_``, ``normal_``, ``bernoulli_`` and dropout
(``native_dropout`` and its backward), from a counter-based generator in a kernel.

A draw takes ``(seed, offset)`` from the accel generator (the given one, else the device's
default) and moves its offset past the counter values it uses, so a sequence of draws is
the same for the same seed whatever the grid, and ``get_rng_state``/``set_rng_state``
replay it exactly. Other random operators (``randint``, ``randperm`` ...) run on the CPU
with the CPU generator: they are not reproduced by ``torch.accel.manual_seed``.
"""

from __future__ import annotations

import torch

from torch_accel import _C
from torch_accel import kernels
from torch_accel.ops import _operands as operands
from torch_accel.ops._register import Unsupported, implements
from torch_accel.ops._tensors import NUMPY, stream

_FLOAT = (torch.float32, torch.float64)


def _draw(x: torch.Tensor, generator: torch.Generator | None) -> tuple[int, int]:
    gen = generator if generator is not None else torch.accel.default_generator(x.device)
    if gen.device.type != "accel":
        raise Unsupported  # a CPU generator: torch's CPU sampling
    return _C._philox_take(gen, kernels.counters(x.numel(), NUMPY[x.dtype]))


def _sample(x: torch.Tensor, generator: torch.Generator | None, fn, a: float, b: float  # noqa: ANN001
            ) -> torch.Tensor:
    if x.dtype not in _FLOAT:
        raise Unsupported
    seed, offset = _draw(x, generator)
    return operands.result(x.shape, x.dtype, x.device, x, lambda o: fn(
        o, seed, offset, a, b, stream=stream(x.device.index)))


@implements("uniform_")
def uniform_(x: torch.Tensor, from_: float = 0.0, to: float = 1.0, *,
             generator: torch.Generator | None = None) -> torch.Tensor:
    return _sample(x, generator, kernels.uniform, float(from_), float(to))


@implements("normal_")
def normal_(x: torch.Tensor, mean: float = 0.0, std: float = 1.0, *,
            generator: torch.Generator | None = None) -> torch.Tensor:
    return _sample(x, generator, kernels.normal, float(mean), float(std))


@implements("bernoulli_.float")
def bernoulli_(x: torch.Tensor, p: float = 0.5, *,
               generator: torch.Generator | None = None) -> torch.Tensor:
    if not operands.supported(x.dtype):
        raise Unsupported
    seed, offset = _draw(x, generator)
    return bernoulli_at(x, p, seed, offset)


def bernoulli_at(x: torch.Tensor, p: float, seed: int, offset: int) -> torch.Tensor:
    """Fill ``x`` with ones of probability ``p`` drawn at a given Philox ``(seed, offset)``:
    a backward that must see its forward's dropout mask again (attention.py) redraws it
    from the pair the forward took, instead of keeping the mask alive."""
    return operands.result(x.shape, x.dtype, x.device, x, lambda o: kernels.bernoulli_mask(
        o, seed, offset, float(p), stream=stream(x.device.index)))


def take_philox(x: torch.Tensor) -> tuple[int, int]:
    """The ``(seed, offset)`` a draw filling ``x`` takes from the device's default
    generator, which it moves past them (as ``bernoulli_(x)`` would)."""
    return _draw(x, None)


@implements("native_dropout")
def native_dropout(x: torch.Tensor, p: float, train: bool | None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    if x.dtype not in _FLOAT:
        raise Unsupported
    if not train or p == 0:
        return x.clone(), torch.ones_like(x, dtype=torch.bool)
    keep = torch.empty_like(x, dtype=torch.bool)
    bernoulli_(keep, 1.0 - p)
    scale = 0.0 if p == 1 else 1.0 / (1.0 - p)
    return x * keep * scale, keep


@implements("native_dropout_backward")
def native_dropout_backward(grad: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    return grad * mask * scale
