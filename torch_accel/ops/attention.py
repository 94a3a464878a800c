"""Scaled dot-product attention: ``F.scaled_dot_product_attention`` on accel takes torch's
"overrideable" backend, the fused-attention entry torch keeps for out-of-tree devices
(``SDPBackend.OVERRIDEABLE``, what OpenReg's test_sdpa exercises).

``_fused_sdp_choice`` answers it for every call the fused operator can run: any mask
(boolean or additive, broadcast), ``is_causal``, ``scale`` and dropout. It answers MATH
(torch's decomposition, which handles them) for grouped-query attention with fewer key
than query heads, because torch does not pass ``enable_gqa`` to the fused operator, and
follows ``torch.nn.attention.sdpa_kernel``'s switches as torch.cuda's choice does.

The fused forward and backward are composed of the device's operators: both products on
the matrix unit, the row softmax as ``exp(s - logsumexp)`` (so a fully masked row gives
zeros, as the CPU does, not NaNs), and the softmax backward kernel. 16-bit inputs are
computed in float32 (the kernels have no 16-bit float type) and the results cast back,
as torch.cuda's kernels accumulate in float32. The backward recomputes the probabilities
from the saved ``logsumexp`` instead of keeping them, and redraws the forward's dropout
mask from the Philox ``(seed, offset)`` the forward returned.
"""

from __future__ import annotations

import math

import torch
from torch.nn.attention import SDPBackend

from torch_accel.ops._register import implements
from torch_accel.ops.random import bernoulli_at, take_philox

_COMPUTE = (torch.float32, torch.float64)


def _wide(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype in _COMPUTE else t.float()


@implements("_fused_sdp_choice")
def fused_sdp_choice(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                     is_causal: bool = False, *, scale: float | None = None,
                     enable_gqa: bool = False) -> int:
    gqa = enable_gqa and query.dim() >= 3 and query.size(-3) != key.size(-3)
    if torch._C._get_overrideable_sdp_enabled() and not gqa:
        return SDPBackend.OVERRIDEABLE.value
    if torch._C._get_math_sdp_enabled():
        return SDPBackend.MATH.value
    raise RuntimeError("No available kernel. Aborting execution.")  # torch's words


def _scores(q: torch.Tensor, k: torch.Tensor, attn_bias: torch.Tensor | None, is_causal: bool,
            scale: float | None) -> tuple[torch.Tensor, float]:
    """``q k^T * scale`` with the mask applied (-inf where a boolean mask or the causal
    triangle, torch's top-left aligned one, hides a key), and the scale used."""
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
    s = torch.matmul(q, k.transpose(-2, -1)) * scale
    if is_causal:
        rows = torch.arange(s.size(-2), device=s.device).unsqueeze(-1)
        s = torch.where(rows >= torch.arange(s.size(-1), device=s.device), s, -math.inf)
    if attn_bias is not None:
        s = (torch.where(attn_bias, s, -math.inf) if attn_bias.dtype == torch.bool
             else s + attn_bias.to(s.dtype))
    return s, scale


def _logsumexp(s: torch.Tensor) -> torch.Tensor:
    """Row ``logsumexp`` of the scores, as torch's (-inf for a fully masked row) but with
    the device's kernels: torch's own fills infinite maxima with ``masked_fill_``, which
    has no device kernel."""
    peak = s.amax(-1, keepdim=True)
    peak = torch.where(peak.abs() == math.inf, 0.0, peak)
    return (torch.log(torch.exp(s - peak).sum(-1, keepdim=True)) + peak).squeeze(-1)


def _probabilities(s: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """``softmax(s)`` from its row ``logsumexp``: zeros where every key is masked."""
    return torch.exp(s - torch.where(lse == -math.inf, 0.0, lse).unsqueeze(-1))


def _keep(probs: torch.Tensor, dropout_p: float, seed: int, offset: int) -> torch.Tensor:
    """The dropout mask scaled by ``1 / (1 - p)``, drawn at ``(seed, offset)``."""
    keep = bernoulli_at(torch.empty_like(probs), 1.0 - dropout_p, seed, offset)
    return keep * (0.0 if dropout_p == 1 else 1.0 / (1.0 - dropout_p))


@implements("_scaled_dot_product_fused_attention_overrideable")
def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attn_bias: torch.Tensor | None = None, dropout_p: float = 0.0,
              is_causal: bool = False, return_debug_mask: bool = False, *,
              scale: float | None = None) -> tuple:
    s, _ = _scores(_wide(query), _wide(key), attn_bias, is_causal, scale)
    lse = _logsumexp(s)
    probs = _probabilities(s, lse)
    seed = offset = 0
    if dropout_p > 0:
        seed, offset = take_philox(probs)
        probs = probs * _keep(probs, dropout_p, seed, offset)
    out = torch.matmul(probs.to(_wide(value).dtype), _wide(value)).to(query.dtype)
    none = torch.empty(0, dtype=torch.int64, device=query.device)
    debug = probs.to(query.dtype) if return_debug_mask else torch.empty(0, device=query.device,
                                                                        dtype=query.dtype)
    return (out, lse.float(), none, none.clone(), query.size(-2), key.size(-2),
            torch.tensor(seed, dtype=torch.int64), torch.tensor(offset, dtype=torch.int64), debug)


@implements("_scaled_dot_product_fused_attention_overrideable_backward")
def attention_backward(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                       value: torch.Tensor, attn_bias: torch.Tensor | None,
                       grad_input_mask: list[bool], out: torch.Tensor, logsumexp: torch.Tensor,
                       cum_seq_q: torch.Tensor, cum_seq_k: torch.Tensor, max_q: int, max_k: int,
                       dropout_p: float, is_causal: bool, philox_seed: torch.Tensor,
                       philox_offset: torch.Tensor, *, scale: float | None = None) -> tuple:
    q, k, v, g = _wide(query), _wide(key), _wide(value), _wide(grad_out)
    s, scale = _scores(q, k, attn_bias, is_causal, scale)
    probs = _probabilities(s, logsumexp.to(s.dtype))
    grad_probs = torch.matmul(g, v.transpose(-2, -1))
    dropped = probs
    if dropout_p > 0:
        keep = _keep(probs, dropout_p, int(philox_seed), int(philox_offset))
        dropped, grad_probs = probs * keep, grad_probs * keep
    grad_v = torch.matmul(dropped.transpose(-2, -1), g)
    grad_s = torch._softmax_backward_data(grad_probs, probs, -1, probs.dtype)
    grad_q = torch.matmul(grad_s, k) * scale
    grad_k = torch.matmul(grad_s.transpose(-2, -1), q) * scale
    nothing = torch.empty(0, device=query.device, dtype=query.dtype)
    grad_bias = nothing
    if grad_input_mask[3] and attn_bias is not None and attn_bias.dtype != torch.bool:
        grad_bias = grad_s.sum_to_size(attn_bias.shape).to(attn_bias.dtype)
    grads = [grad.sum_to_size(t.shape).to(t.dtype)  # inputs broadcast against each other
             for grad, t in ((grad_q, query), (grad_k, key), (grad_v, value))]
    return (*(grad if wanted else nothing for grad, wanted in zip(grads, grad_input_mask)),
            grad_bias)
