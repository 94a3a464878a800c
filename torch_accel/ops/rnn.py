"""The fused LSTM and GRU cells, on the device: what ``nn.LSTM``, ``nn.GRU``,
``nn.LSTMCell`` and ``nn.GRUCell`` call for a PrivateUse1 tensor.

torch's RNN code (``at::lstm``, ``at::gru``, ``lstm_cell``, ``gru_cell``) takes the fused
cell for a CUDA, XPU or PrivateUse1 input, and the CPU has no kernel for it, so without
these every recurrent layer failed on accel ("Could not run 'aten::_thnn_fused_lstm_cell'
with arguments from the 'CPU' backend"). The gate products (``input @ W_ih^T`` and
``h @ W_hh^T``) already ran on the matrix unit; these are the elementwise tails, composed
of the device's elementwise kernels. The workspaces have CUDA's layout (its
``RNN.cu``) because torch's autograd hands them back to the backwards unchanged: LSTM
``[i, f, g, o]`` after their activations, GRU ``[r, z, n, h_n + b_hn, hx]``.
"""

from __future__ import annotations

import torch

from torch_accel.ops._register import implements


def _gates(input_gates: torch.Tensor, hidden_gates: torch.Tensor,
           input_bias: torch.Tensor | None, hidden_bias: torch.Tensor | None,
           chunks: int) -> list[torch.Tensor]:
    gates = input_gates + hidden_gates
    if input_bias is not None and hidden_bias is not None:
        gates = gates + (input_bias + hidden_bias)
    return list(gates.chunk(chunks, 1))


@implements("_thnn_fused_lstm_cell")
def lstm_cell(input_gates: torch.Tensor, hidden_gates: torch.Tensor, cx: torch.Tensor,
              input_bias: torch.Tensor | None = None, hidden_bias: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(hy, cy, workspace)``: ``cy = f * cx + i * g``, ``hy = o * tanh(cy)``."""
    i, f, g, o = _gates(input_gates, hidden_gates, input_bias, hidden_bias, 4)
    i, f, g, o = i.sigmoid(), f.sigmoid(), g.tanh(), o.sigmoid()
    cy = f * cx + i * g
    hy = o * cy.tanh()
    return hy, cy, torch.cat([i, f, g, o], 1)


@implements("_thnn_fused_lstm_cell_backward_impl")
def lstm_cell_backward(grad_hy: torch.Tensor | None, grad_cy: torch.Tensor | None,
                       cx: torch.Tensor, cy: torch.Tensor, workspace: torch.Tensor,
                       has_bias: bool) -> tuple[torch.Tensor, torch.Tensor,
                                                torch.Tensor | None]:
    """``(grad of the gates before their activations, grad_cx, grad_bias)``; either output
    gradient may be absent (undefined), meaning zero."""
    i, f, g, o = workspace.chunk(4, 1)
    tanh_cy = cy.tanh()
    grad_c = torch.zeros_like(cy) if grad_cy is None else grad_cy.clone()
    grad_o = torch.zeros_like(cy)
    if grad_hy is not None:
        grad_c = grad_c + grad_hy * o * (1 - tanh_cy * tanh_cy)
        grad_o = grad_hy * tanh_cy
    grad_gates = torch.cat([grad_c * g * i * (1 - i), grad_c * cx * f * (1 - f),
                            grad_c * i * (1 - g * g), grad_o * o * (1 - o)], 1)
    grad_bias = grad_gates.sum(0) if has_bias else None
    return grad_gates, grad_c * f, grad_bias


@implements("_thnn_fused_gru_cell")
def gru_cell(input_gates: torch.Tensor, hidden_gates: torch.Tensor, hx: torch.Tensor,
             input_bias: torch.Tensor | None = None, hidden_bias: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hy, workspace)``: ``n = tanh(i_n + r * (h_n + b_hn))``, ``hy = n + z * (hx - n)``."""
    i_r, i_z, i_n = input_gates.chunk(3, 1)
    h_r, h_z, h_n = hidden_gates.chunk(3, 1)
    if input_bias is not None and hidden_bias is not None:
        (b_ir, b_iz, b_in), (b_hr, b_hz, b_hn) = input_bias.chunk(3), hidden_bias.chunk(3)
        i_r, i_z, i_n = i_r + b_ir, i_z + b_iz, i_n + b_in
        h_r, h_z, h_n = h_r + b_hr, h_z + b_hz, h_n + b_hn
    r, z = (i_r + h_r).sigmoid(), (i_z + h_z).sigmoid()
    n = (i_n + r * h_n).tanh()
    hy = n + z * (hx - n)
    return hy, torch.cat([r, z, n, h_n, hx], 1)


@implements("_thnn_fused_gru_cell_backward")
def gru_cell_backward(grad_hy: torch.Tensor, workspace: torch.Tensor, has_bias: bool
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                 torch.Tensor | None, torch.Tensor | None]:
    """``(grad_input_gates, grad_hidden_gates, grad_hx, grad_input_bias,
    grad_hidden_bias)``, the gates' gradients before their activations."""
    r, z, n, h_n, hx = workspace.chunk(5, 1)
    grad_in = grad_hy * (1 - z) * (1 - n * n)
    grad_r = grad_in * h_n * r * (1 - r)
    grad_z = grad_hy * (hx - n) * z * (1 - z)
    grad_input = torch.cat([grad_r, grad_z, grad_in], 1)
    grad_hidden = torch.cat([grad_r, grad_z, grad_in * r], 1)
    return (grad_input, grad_hidden, grad_hy * z,
            grad_input.sum(0) if has_bias else None, grad_hidden.sum(0) if has_bias else None)
