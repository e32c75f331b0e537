"""`layer_norm_linear(x, norm_weight, norm_bias, eps, weight, bias)`: the LayerNorm before a
projection read inside the GEMM, eager inference (ModernBERT's attn_norm and Wqkv).

Shapes: T packed tokens, D input width, N output width (weight is (N, D), HF's layout).

What it replaces: the op's parts, the LayerNorm kernel writing the normalised rows (T, D) and the
GEMM reading them back (`reference.compose_layer_norm_linear`, the table's last link for the calls
this does not take): one launch fewer a layer, where an eager batch of short sequences waits on the
host. It is `linear_glu.py`'s kernel with the gate off (GATED=False: one accumulator over all N
rows) and its NORM prologue: the program sums x's rows and squares as the tiles stream through the
K loop and feeds the dot x * norm_weight; the epilogue applies rstd * (acc - mean * (norm_weight
W^T)), those column sums kept per weight (`linear_glu._colsums`). So the values differ from the
parts' by the rounding of x * w instead of (x - mean) * rstd * w, as `layer_norm_linear_glu`'s.

No backward and no norm bias: `covers_layer_norm_linear` takes eager CUDA calls that need no
gradient, on fp16 / bf16 row-major operands; the op table (`kernels/auto.py`) says where it is chosen.
"""

from __future__ import annotations

from torch import Tensor

from packedenc.errors import InputError
from packedenc.kernels.triton._common import direct_launch
from packedenc.kernels.triton.linear_glu import _LOW, _layout, _norm_layout, _norm_unusable, linear_glu_fwd

__all__ = ["layer_norm_linear", "covers_layer_norm_linear", "covered_layer_norm_linear"]


def covers_layer_norm_linear(x_TD: Tensor, norm_weight: Tensor, norm_bias: Tensor | None, eps: float,
                             weight: Tensor, bias: Tensor | None = None) -> bool:
    """The calls this kernel takes: eager CUDA inference on fp16 / bf16 row-major operands, with a
    LayerNorm without bias."""
    return (x_TD.dtype in _LOW and direct_launch(x_TD, weight, bias, norm_weight)
            and _layout(x_TD, weight, bias, gated=False) is None and _norm_layout(x_TD, norm_weight, norm_bias) is None)


def layer_norm_linear(x_TD: Tensor, norm_weight: Tensor, norm_bias: Tensor | None, eps: float,
                      weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """linear(layer_norm(x), weight, bias) in one GEMM, the normalised rows never written; see
    `reference.layer_norm_linear`.

    Arguments: x_TD (T, D); norm_weight (D,), norm_bias None (a bias raises InputError), eps;
    weight (N, D); bias (N,) or None. Return: (T, N) in x's dtype. Forward only: an input that
    needs a gradient raises InputError.
    """
    why = _norm_unusable(x_TD, weight, bias, norm_weight, norm_bias, gated=False)
    if why is not None:
        raise InputError(f"triton layer_norm_linear: {why}")
    return linear_glu_fwd(x_TD, weight, bias, None, norm_weight=norm_weight, eps=eps)


def covered_layer_norm_linear(x_TD: Tensor, norm_weight: Tensor, norm_bias: Tensor | None, eps: float,
                              weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """The op table's entry: takes only the calls `covers_layer_norm_linear` took."""
    return linear_glu_fwd(x_TD, weight, bias, None, norm_weight=norm_weight, eps=eps)
