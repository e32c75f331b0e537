"""Gated MLP input projection, `linear_glu(x, weight, bias, act)`: cuBLAS GEMM, then the Triton gate.

Shapes: T packed tokens, D hidden, F mlp width (weight is (2F, D): input rows, then gate rows).

The "triton" entry of the op is the two steps the model ran before the op existed: `F.linear`
(cuBLAS) writes u (T, 2F), and `glu.py`'s kernel applies act(u[:, :F]) * u[:, F:]. u is this
call's own temporary, so eager inference writes the gate's output into u's first half
(`overwrite_input`) and allocates no second buffer. Autograd: torch's for the GEMM, `glu.py`'s
registered backward for the gate; the result equals `reference.linear_glu` step for step.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from packedenc.kernels.triton import glu

__all__ = ["linear_glu"]


def linear_glu(x_TD: Tensor, weight: Tensor, bias: Tensor | None = None, act: str = "gelu") -> Tensor:
    """act(u[:, :F]) * u[:, F:] with u = x @ weight.T + bias; see `reference.linear_glu`.

    Arguments:
        x_TD: (T, D). weight: (2F, D), input rows then gate rows. bias: (2F,) or None.
        act: an HF activation name; an unknown one raises ConfigError.
    Return:
        (T, F) in x's dtype (in eager inference a view of u with row stride 2F).
    """
    glu._code(act)  # an unknown activation fails before the GEMM runs
    return glu.glu(F.linear(x_TD, weight, bias), act, overwrite_input=True)
