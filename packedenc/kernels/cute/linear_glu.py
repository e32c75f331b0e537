"""The GeGLU input projection on one CuteDSL GEMM (sm90): the "cute" backend's `linear_glu`.

Shapes: T packed tokens, D hidden, F mlp width (weight is (2F, D): input rows, then gate rows).

`geglu_gemm.py`'s kernel computes gelu(x @ W_in.T) * (x @ W_gate.T) with both products in fp32
registers and rounds once, where the "triton" entry rounds u = x @ W.T to x's dtype, writes it
(T, 2F) and reads it back for the gate. It is wrapped in the custom op `packedenc::cute_linear_glu`
(CPU implementation: the reference; a fake for tracing), so `torch.compile(fullgraph=True)` and
CUDA-graph capture see one op; cutlass is imported inside the CUDA kernel only.

Forward only: there is no backward, so `covers_linear_glu` refuses calls that need a gradient and
the op table routes training to the next choice (the "triton" entry). The other calls it takes
(host values only): CUDA fp16 / bf16 on an sm90 device (WGMMA is Hopper's instruction; sm100 has
none), exact GELU, no bias, contiguous x and weight, D and F multiples of 8 (TMA's 16-byte strides).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from packedenc.errors import InputError
from packedenc.kernels import reference
from packedenc.kernels.triton._common import eager_cuda

__all__ = ["linear_glu", "covered_linear_glu", "covers_linear_glu", "GELU_ACTS", "CAPABILITY"]

GELU_ACTS = ("gelu", "gelu_python")  # HF names of exact-erf GELU (reference._ACTS gives both F.gelu)
CAPABILITY = 9  # major compute capability: Hopper (sm90a) only


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)  # a host query, cached: no device sync


def _needs_grad(*tensors: Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def covers_linear_glu(x_TD: Tensor, weight: Tensor, bias: Tensor | None = None, act: str = "gelu") -> bool:
    """The linear_glu calls the CuteDSL GEMM takes (host values only)."""
    return (
        x_TD.is_cuda
        and x_TD.dtype in (torch.float16, torch.bfloat16)
        and weight.dtype == x_TD.dtype
        and weight.device == x_TD.device
        and act in GELU_ACTS
        and bias is None
        and x_TD.dim() == 2
        and weight.dim() == 2
        and weight.shape[1] == x_TD.shape[1]
        and x_TD.shape[1] % 8 == 0
        and weight.shape[0] % 16 == 0  # F = weight rows / 2, a multiple of 8
        and x_TD.is_contiguous()
        and weight.is_contiguous()
        and not _needs_grad(x_TD, weight)
        and _capability(x_TD.device.index if x_TD.device.index is not None else torch.cuda.current_device())[0]
        == CAPABILITY
    )


@torch.library.custom_op("packedenc::cute_linear_glu", mutates_args=(), device_types="cpu")
def _cute_linear_glu(x: Tensor, weight: Tensor, act: str) -> Tensor:
    return reference.linear_glu(x, weight, None, act)


@_cute_linear_glu.register_kernel("cuda")
def _(x, weight, act):
    from packedenc.kernels.cute import geglu_gemm

    return geglu_gemm.geglu(x, weight)


@_cute_linear_glu.register_fake
def _(x, weight, act):
    return x.new_empty((x.shape[0], weight.shape[0] // 2))


def linear_glu(x_TD: Tensor, weight: Tensor, bias: Tensor | None = None, act: str = "gelu") -> Tensor:
    """gelu(u[:, :F]) * u[:, F:] with u = x @ weight.T, as one GEMM; see `reference.linear_glu`.

    Arguments:
        x_TD: (T, D) fp16 / bf16, contiguous, on an sm90 GPU; D a multiple of 8. On the CPU the op
            runs the reference.
        weight: (2F, D), same dtype, contiguous: input rows then gate rows; F a multiple of 8.
        bias: None (the kernel has no bias). act: "gelu" (exact erf).
    Return:
        (T, F) in x's dtype, forward only: inputs that need a gradient raise InputError (the op
        table sends them to the next choice before they get here).
    """
    if _needs_grad(x_TD, weight, bias):
        raise InputError("cute linear_glu is forward-only (no backward): call it under torch.no_grad() or "
                         "through the op table, which sends training calls to the triton entry")
    if x_TD.is_cuda and not covers_linear_glu(x_TD, weight, bias, act):
        raise InputError(f"cute linear_glu: the Hopper GEMM needs contiguous fp16 / bf16 x and weight on an sm90 "
                         f"GPU, act in {GELU_ACTS}, no bias, D and F multiples of 8; got x {x_TD.dtype} "
                         f"{tuple(x_TD.shape)}, weight {weight.dtype} {tuple(weight.shape)}, "
                         f"bias {'None' if bias is None else tuple(bias.shape)}, act {act!r} on {x_TD.device}")
    if bias is not None or act not in GELU_ACTS:  # the CPU: the same inputs as on the GPU, or none
        raise InputError(f"cute linear_glu takes act in {GELU_ACTS} and no bias, got act {act!r}, "
                         f"bias {'None' if bias is None else tuple(bias.shape)}")
    return covered_linear_glu(x_TD, weight, bias, act)


@functools.lru_cache(maxsize=1)
def _geglu():
    from packedenc.kernels.cute import geglu_gemm  # imports cutlass: only once a CUDA call comes

    return geglu_gemm.geglu


def covered_linear_glu(x_TD: Tensor, weight: Tensor, bias: Tensor | None = None, act: str = "gelu") -> Tensor:
    """The op table's entry: takes only the calls `covers_linear_glu` took (the table asks first), so
    it checks nothing again. Eager calls on plain CUDA tensors launch the kernel directly: the custom
    op's dispatch costs more host time than the kernel's own launch (benchmarks/NOTES.md, the
    TVM-FFI row); a trace, a dispatch mode or functorch keeps the custom op (`triton/_common.eager_cuda`)."""
    if eager_cuda(x_TD):
        return _geglu()(x_TD, weight)
    return torch.ops.packedenc.cute_linear_glu(x_TD, weight, act)
