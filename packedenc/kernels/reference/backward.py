"""Plain-torch backward of every fused op: the executable spec of the gradients.

Each function is the vector-Jacobian product of the `kernels/reference/ops.py` op of the same name,
written out with explicit formulas (fp32 math, one rounding) rather than autograd, because it is
the CPU implementation of the `packedenc::*_bwd` custom ops and autograd does not run inside a
custom op's kernel. `tests/kernels/` checks each one against autograd through the reference, and
the GPU backward kernels against these.

Shapes: T packed tokens, D hidden, H heads, K head dim, F mlp width.
"""

from __future__ import annotations

import torch
from torch import Tensor

from packedenc.kernels.reference import ops as reference

__all__ = ["layer_norm_bwd", "activation_bwd", "bias_activation_bwd", "glu_bwd", "rotary_bwd", "varlen_attention_bwd"]


def layer_norm_bwd(
    dy_TD: Tensor, x_TD: Tensor, weight: Tensor, eps: float, dsum_TD: Tensor | None = None,
    need_dxb: bool = False,
) -> tuple[Tensor, ...]:
    """(dx in x's dtype, dweight, dbias in weight's dtype) of `reference.layer_norm`.

    `dsum_TD` is gradient reaching the LayerNorm input from elsewhere (add_layer_norm's returned
    sum); it is added to dx in fp32 before the one rounding. `need_dxb`: also return, fourth, the
    column sums of that fp32 dx in weight's dtype: the gradient of add_layer_norm's `x_bias`.
    """
    x, dy, w = x_TD.float(), dy_TD.float(), weight.float()
    mean = x.mean(-1, keepdim=True)
    xc = x - mean
    rstd = torch.rsqrt((xc * xc).mean(-1, keepdim=True) + eps)
    xhat = xc * rstd
    wdy = w * dy
    dx = (wdy - xhat * (xhat * wdy).mean(-1, keepdim=True) - wdy.mean(-1, keepdim=True)) * rstd
    if dsum_TD is not None:
        dx = dx + dsum_TD.float()
    dims = tuple(range(dy.dim() - 1))
    out = dx.to(x_TD.dtype), (dy * xhat).sum(dims).to(weight.dtype), dy.sum(dims).to(weight.dtype)
    return (*out, dx.sum(dims).to(weight.dtype)) if need_dxb else out


def _act_bwd(g: Tensor, a: Tensor, act: str) -> Tensor:
    """g * act'(a) in fp32, through aten's own backward ops where one exists."""
    aten = torch.ops.aten
    if act in ("gelu", "gelu_python"):
        return aten.gelu_backward(g, a, approximate="none")
    if act in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"):  # gelu_fast is the tanh formula
        return aten.gelu_backward(g, a, approximate="tanh")
    if act == "quick_gelu":
        s = torch.sigmoid(1.702 * a)
        return g * (s + 1.702 * a * s * (1 - s))
    if act in ("silu", "swish"):
        return aten.silu_backward(g, a)
    if act == "relu":
        return aten.threshold_backward(g, a, 0)
    if act == "tanh":
        return aten.tanh_backward(g, torch.tanh(a))
    if act == "sigmoid":
        return aten.sigmoid_backward(g, torch.sigmoid(a))
    assert act == "linear", act
    return g


def activation_bwd(dy: Tensor, x: Tensor, act: str) -> Tensor:
    """dx = dy * act'(x) of `reference.activation`, fp32 math, in x's dtype."""
    return _act_bwd(dy.float(), x.float(), reference.check_activation(act)).to(x.dtype)


def bias_activation_bwd(dy: Tensor, x: Tensor, bias: Tensor, act: str) -> tuple[Tensor, Tensor]:
    """(dx in x's dtype, dbias in bias's dtype) of `reference.activation(x, act, bias=bias)`:
    dx = dy * act'(x + bias) in fp32, one rounding; dbias = the column sums of that fp32 dx."""
    g = _act_bwd(dy.float(), x.float() + bias.float(), reference.check_activation(act))
    return g.to(x.dtype), g.reshape(-1, g.shape[-1]).sum(0).to(bias.dtype)


def glu_bwd(dout_TF: Tensor, u_T2F: Tensor, act: str = "gelu") -> Tensor:
    """du (T, 2F) of `reference.glu`: [d input half | d gate half], in u's dtype."""
    a, g = u_T2F.float().chunk(2, dim=-1)
    d = dout_TF.float()
    y = reference._ACTS[reference.check_activation(act)](a)
    return torch.cat((_act_bwd(d * g, a, act), d * y), dim=-1).to(u_T2F.dtype)


def rotary_bwd(
    dq_THK: Tensor, dk_THK: Tensor, positions_T: Tensor, theta: float, scaling: float = 1.0,
    dv_THK: Tensor | None = None,
) -> Tensor:
    """dqkv (T, 3, H, K) of `reference.rotary`: dv in the v slot (`with_v=True`), else zero.

    The rotation's transpose is the rotation by -angle, i.e. the same op at -positions:
    cos is even and sin odd, bit for bit, and rounding to the activation dtype is symmetric.
    """
    zero = torch.zeros_like(dq_THK)
    g = torch.stack((dq_THK, dk_THK, zero), dim=1)
    dq, dk = reference.rotary(g, -positions_T, theta, scaling)
    return torch.stack((dq, dk, zero if dv_THK is None else dv_THK.to(dq.dtype)), dim=1)


def varlen_attention_bwd(
    do_THK: Tensor, q_THK: Tensor, k_THK: Tensor, v_THK: Tensor, cu_seqlens: Tensor,
    window: tuple[int, int] = (-1, -1), scale: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of `reference.varlen_attention`, through a dense (T, T) mask: tests only."""
    from packedenc.packing import segment_ids

    T, H, K = q_THK.shape
    scale = K**-0.5 if scale is None else scale
    seq = segment_ids(cu_seqlens, T)
    i = torch.arange(T, device=q_THK.device)
    keep = seq[:, None] == seq[None, :]
    if window[0] >= 0:
        keep &= i[None, :] >= i[:, None] - window[0]
    if window[1] >= 0:
        keep &= i[None, :] <= i[:, None] + window[1]
    q, k, v, do = (t.float().transpose(0, 1) for t in (q_THK, k_THK, v_THK, do_THK))  # (H, T, K)
    p = torch.softmax((q @ k.transpose(1, 2) * scale).masked_fill(~keep, float("-inf")), dim=-1)
    dp = do @ v.transpose(1, 2)
    ds = p * (dp - (dp * p).sum(-1, keepdim=True)) * scale
    dq, dk, dv = ds @ k, ds.transpose(1, 2) @ q, p.transpose(1, 2) @ do
    return tuple(t.transpose(0, 1).to(q_THK.dtype) for t in (dq, dk, dv))

