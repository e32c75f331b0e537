"""The ops whose extra outputs are softmax statistics (the LSE of the varlen and DeBERTa
attentions, the graph readout's max and denominator) get no zero-filled gradient for them in the
backward: autograd would otherwise allocate and fill one per layer per step.

CPU: the registered ops' autograd (the same setup and backward as the eager CUDA path).
"""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import packedenc.kernels.triton  # noqa: F401  (registers the ops)
from packedenc.kernels.triton.attention_op import varlen_attention
from packedenc.kernels.triton.deberta.op import deberta_attention
from packedenc.kernels.triton.graph_readout import graph_readout

_FILLS = {torch.ops.aten.zeros.default, torch.ops.aten.zeros_like.default, torch.ops.aten.new_zeros.default,
          torch.ops.aten.full.default, torch.ops.aten.fill_.Scalar, torch.ops.aten.zero_.default}


class _Fills(TorchDispatchMode):
    """Shapes of the zero / constant tensors made while active."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _FILLS and isinstance(out, torch.Tensor):
            self.shapes.append(tuple(out.shape))
        return out


def _packed(T=10, H=2, K=16):
    torch.manual_seed(0)
    q, k, v = (torch.randn(T, H, K, requires_grad=True) for _ in range(3))
    return q, k, v, torch.tensor([0, 4, T], dtype=torch.int32)


def test_varlen_attention_backward_makes_no_lse_gradient():
    q, k, v, cu = _packed()
    out = varlen_attention(q, k, v, cu, 6)
    with _Fills() as fills:
        out.sum().backward()
    assert (2, 10) not in fills.shapes, fills.shapes  # (H, T): the LSE's shape
    assert all(t.grad is not None for t in (q, k, v))


def test_deberta_attention_backward_makes_no_lse_gradient():
    q, k, v, cu = _packed()
    R = 8
    pk, pq = (torch.randn(R, 2, 16, requires_grad=True) for _ in range(2))
    out = deberta_attention(q, k, v, cu, 6, pk, pq, pos_att_type=("c2p", "p2c"), position_buckets=4,
                            max_relative_positions=8, scale=0.2)
    with _Fills() as fills:
        out.sum().backward()
    assert (10, 2) not in fills.shapes, fills.shapes  # (T, H): the LSE's shape
    assert all(t.grad is not None for t in (q, k, v, pk, pq))


def test_graph_readout_backward_makes_no_statistics_gradient():
    torch.manual_seed(0)
    z = torch.randn(10, 8, requires_grad=True)
    w, b = torch.randn(1, 16, requires_grad=True), torch.randn(1, requires_grad=True)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    out = graph_readout(z, w, b, cu, 6)
    with _Fills() as fills:
        out.sum().backward()
    assert (2,) not in fills.shapes and (2, 1) not in fills.shapes, fills.shapes  # (S,) statistics
    assert all(t.grad is not None for t in (z, w, b))

