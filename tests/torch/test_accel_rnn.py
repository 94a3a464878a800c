"""Recurrent layers on accel (OpenReg's test_rnn, compared with the CPU rather than only
shaped): ``nn.LSTM``, ``nn.GRU``, ``nn.LSTMCell`` and ``nn.GRUCell`` forward and every
gradient (input, initial state, weights) match the CPU's, with the fused cells
(ops/rnn.py) on the device and nothing through the fallback."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(400)

#: the module on the CPU and on accel from the same weights; a fixed weighting of every
#: output back-propagated; the largest gap of each output and each gradient
COMPARE = """
import copy
import torch.nn as nn
from torch.utils._pytree import tree_leaves
torch.manual_seed(0)
def compare(module, *inputs):
    res = {}
    for dev in ("cpu", "accel"):
        m = copy.deepcopy(module).to(dev)
        xs = [t.to(dev).detach().requires_grad_() for t in inputs]
        outs = tree_leaves(m(*xs))
        loss = sum((o * torch.linspace(-1, 1, o.numel()).reshape(o.shape).to(dev)).sum()
                   for o in outs)
        loss.backward()
        res[dev] = ([("out", o.detach()) for o in outs] + [("grad x", x.grad) for x in xs]
                    + [(n, p.grad) for n, p in m.named_parameters()])
        devices = {t.device.type for _, t in res[dev]}
        assert devices == {dev}, devices
    return {f"{i} {name}": (a.cpu() - c).abs().max().item()
            for i, ((name, a), (_, c)) in enumerate(zip(res["accel"], res["cpu"]))}
"""


def test_recurrent_layers_match_cpu_forward_and_backward(torch_json):
    r = torch_json(COMPARE + """
seq = lambda *s: torch.randn(*s)
cases = {
    "lstm 2 layers bidirectional": (nn.LSTM(3, 4, num_layers=2, bidirectional=True), seq(5, 2, 3)),
    "lstm initial state": (nn.LSTM(3, 4), seq(5, 2, 3), (seq(1, 2, 4), seq(1, 2, 4))),
    "lstm no bias batch_first": (nn.LSTM(3, 4, bias=False, batch_first=True), seq(2, 5, 3)),
    "lstm proj_size": (nn.LSTM(3, 4, proj_size=2), seq(5, 2, 3)),
    "gru 2 layers bidirectional": (nn.GRU(3, 4, num_layers=2, bidirectional=True), seq(5, 2, 3)),
    "gru initial state batch_first": (nn.GRU(3, 4, batch_first=True), seq(2, 5, 3), seq(1, 2, 4)),
    "gru no bias": (nn.GRU(3, 4, bias=False), seq(5, 2, 3)),
    "lstm cell": (nn.LSTMCell(3, 4), seq(2, 3)),
    "gru cell": (nn.GRUCell(3, 4), seq(2, 3), seq(2, 4)),
    "gru cell unbatched": (nn.GRUCell(3, 4), seq(3)),
    "rnn tanh": (nn.RNN(3, 4, num_layers=2), seq(5, 2, 3)),
}
def flat(module, x, *state):
    return compare(module, x, *tree_leaves(state)) if not state else \\
        compare(_Wrap(module, state), x, *tree_leaves(state))
class _Wrap(nn.Module):
    def __init__(self, m, state):
        super().__init__()
        self.m, self.lstm = m, isinstance(state[0], tuple)
    def forward(self, x, *s):
        return self.m(x, (s[0], s[1]) if self.lstm else s[0])
gaps = {name: flat(*case) for name, case in cases.items()}
report(gaps=gaps, fallback=dict(torch_accel.fallback_counts))
""")
    for name, gaps in r["gaps"].items():
        for label, gap in gaps.items():
            assert gap < 1e-5, (name, label, gap)
    assert r["fallback"] == {}, r["fallback"]


def test_lstm_packed_sequence_matches_cpu(torch_json):
    r = torch_json(COMPARE + """
from torch.nn.utils.rnn import pack_sequence, pad_packed_sequence
class Packed(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(3, 4)
    def forward(self, a, b, c):
        out, (h, cell) = self.lstm(pack_sequence([a, b, c], enforce_sorted=False))
        assert out.data.device == a.device
        return pad_packed_sequence(out)[0], h, cell
report(gaps=compare(Packed(), torch.randn(3, 3), torch.randn(5, 3), torch.randn(1, 3)))
""")
    for label, gap in r["gaps"].items():
        assert gap < 1e-5, (label, gap)
