"""Linear + cross-entropy fused for training (MLM decoder): the loss saves d loss / d logits, not logits.

Shapes: M scored rows (masked tokens), D hidden, V vocab.

The unfused head, `F.cross_entropy(F.linear(x, W, b).float(), t)`, keeps the (M, V) logits in the
activation dtype, their fp32 copy and fp32 log-softmax, and its backward allocates two more
(M, V) fp32 tensors: about 36 bytes and 8 passes per logit (ModernBERT-base, 64k tokens, 30%
masked: M ~ 19k, V = 50368, ~12 GB transient and ~8 ms on an H200). Here:

- forward: the logits `x @ W^T + b` come from one GEMM in x's dtype (the same call and rounding as
  `F.linear`; rows padded to an aligned stride, `ROW_ALIGN`), then `_ce_kernel` takes one row per program: pass 1 reads the row for an online
  max / sum of exp in fp32 (the loss is lse - x[target]); pass 2 reads it again and overwrites it
  with softmax - onehot, rounded once to x's dtype. That buffer, G, is the only (M, V) tensor and
  is what autograd saves.
- backward: with g = d total / d loss_i (per row), dlogits = g_i * G_i, so the row scale is applied
  on the small side of each GEMM: dx = g * (G @ W), dW = G^T @ (g * x), db = G^T @ g (g split
  into two terms of x's dtype, so its rounding does not bias db). No pass over (M, V) but the
  GEMMs' own reads.

Targets outside [0, V) (F.cross_entropy's ignore_index -100) give loss 0 and no gradient, as
`reduction="none"` does. The CPU implementation of the op is the same math in plain torch, over
chunks of rows so that no (M, V) fp32 tensor exists at once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op

from packedenc.kernels.triton._common import check_float, eager_autograd, eager_cuda, launch, next_pow2

__all__ = ["linear_cross_entropy", "ce_grad_", "chunked_ce", "CPU_CHUNK_ELEMS"]

LOG2E = tl.constexpr(1.4426950408889634)  # constexpr: compiled kernels may not read plain globals
LN2 = tl.constexpr(0.6931471805599453)
CPU_CHUNK_ELEMS = 1 << 24  # logits per chunk of the CPU implementation (64 MB in fp32)


@triton.jit
def _ce_kernel(
    LOGITS,  # (M, V) in: logits; out: softmax - onehot (in place), activation dtype
    TARGETS,  # (M,) int target ids; outside [0, V): ignored (loss 0, gradient 0)
    LOSS,  # (M,) fp32 out: lse - logits[target]
    V,  # row width (vocab)
    stride_m,  # row stride of LOGITS (elements); columns contiguous
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = LOGITS + row * stride_m
    tgt = tl.load(TARGETS + row).to(tl.int64)
    valid = (tgt >= 0) & (tgt < V)
    cols = tl.arange(0, BLOCK_V)
    # pass 1: running max m and sum d of exp(x - m), in base-2 units (one FMA feeds exp2)
    m = float("-inf")
    d = 0.0
    for v0 in range(0, V, BLOCK_V):
        c = v0 + cols
        x = tl.load(base + c, mask=c < V, other=float("-inf")).to(tl.float32) * LOG2E
        m_new = tl.maximum(m, tl.max(x, 0))
        d = d * tl.exp2(m - m_new) + tl.sum(tl.exp2(x - m_new), 0)
        m = m_new
    lse2 = m + tl.log2(d)  # log2 of the row's sum of exp
    # read the target logit before pass 2 overwrites the row
    x_t = tl.load(base + tl.where(valid, tgt, 0)).to(tl.float32)
    tl.store(LOSS + row, tl.where(valid, lse2 * LN2 - x_t, 0.0))
    # pass 2: gradient of this row's loss, in place
    keep = tl.where(valid, 1.0, 0.0)
    for v0 in range(0, V, BLOCK_V):
        c = v0 + cols
        cmask = c < V
        x = tl.load(base + c, mask=cmask, other=0.0).to(tl.float32)
        p = tl.exp2(x * LOG2E - lse2)
        g = (p - tl.where(c == tgt, 1.0, 0.0)) * keep
        tl.store(base + c, g.to(LOGITS.dtype.element_ty), mask=cmask)


def ce_grad_(logits_MV: Tensor, targets_M: Tensor, block_v: int | None = None) -> Tensor:
    """Launch the kernel: return the (M,) fp32 losses; `logits_MV` is overwritten with
    softmax - onehot (zeros on ignored rows). CUDA, or CPU tensors under TRITON_INTERPRET=1."""
    check_float("linear_cross_entropy", logits_MV)
    assert logits_MV.dim() == 2 and logits_MV.stride(1) == 1, "logits must be (M, V), columns contiguous"
    M, V = logits_MV.shape
    loss = torch.empty(M, dtype=torch.float32, device=logits_MV.device)
    if M:
        BLOCK_V = block_v or min(4096, next_pow2(V))
        num_warps = 8 if BLOCK_V >= 4096 else 4 if BLOCK_V >= 1024 else 1
        launch(_ce_kernel, (M,), logits_MV, targets_M.contiguous(), loss, V, logits_MV.stride(0),
                         BLOCK_V=BLOCK_V, num_warps=num_warps)
    return loss


# Row stride of the (M, V) logits / G buffer, in elements. Rows that start 16-byte aligned let
# cuBLAS pick its sm90 (TMA) GEMMs for the logits and both backward GEMMs; DeBERTa-v3's
# 128100-word vocab (256,200-byte bf16 rows) otherwise ran on sm80 kernels, 7.3-8.3 ms each on an
# H200 for a 64k-token pack's ~10k masked rows (benchmarks/results/history/NOTES-diary.md).
ROW_ALIGN = 64


def _padded(V: int) -> int:
    return -(-V // ROW_ALIGN) * ROW_ALIGN


def _padded_head(weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """W and b with zero rows appended up to `_padded(V)` rows (themselves when already aligned)."""
    V = int(weight.shape[0])  # a symbolic vocab (dynamic=True) is specialised: F.pad takes ints
    pad = _padded(V) - V
    if not pad:
        return weight, bias
    return F.pad(weight, (0, 0, 0, pad)), (F.pad(bias, (0, pad)) if bias is not None else None)


def _logits(x: Tensor, weight: Tensor, bias: Tensor | None, V: int) -> Tensor:
    """x @ W^T + b for a padded head (`_padded_head`) as an (M, V) view with an aligned row stride.

    One GEMM, `F.linear` (= addmm(bias, x, W^T), the unfused head's call): it writes the aligned
    rows directly, no copy of the logits.
    """
    return F.linear(x, weight, bias)[:, :V]


def _ce_grad_torch(logits_MV: Tensor, targets_M: Tensor) -> tuple[Tensor, Tensor]:
    """Plain-torch `ce_grad_` on one chunk: (losses fp32, softmax - onehot in logits' dtype)."""
    V = logits_MV.shape[1]
    lf = logits_MV.float()
    valid = (targets_M >= 0) & (targets_M < V)
    t = torch.where(valid, targets_M, 0)[:, None]
    lse = torch.logsumexp(lf, dim=-1, keepdim=True)
    loss = torch.where(valid, (lse - lf.gather(1, t))[:, 0], 0.0)
    p = lf.sub_(lse).exp_()
    p.scatter_add_(1, t, torch.full_like(lse, -1.0))
    return loss, p.mul_(valid[:, None]).to(logits_MV.dtype)


# ---- the registered op: (losses, G) forward, GEMM-only backward ----------------------------------


def chunked_ce(x: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor,
               chunk_elems: int = CPU_CHUNK_ELEMS) -> tuple[Tensor, Tensor]:
    """The CPU op's (losses, G), `chunk_elems` logits at a time: no (M, V) fp32 tensor at once."""
    M, V = x.shape[0], weight.shape[0]
    loss = torch.empty(M, dtype=torch.float32)
    grad = torch.empty((M, _padded(V)), dtype=x.dtype)[:, :V]  # the CUDA kernel's layout
    rows = max(1, chunk_elems // max(V, 1))
    w, b = _padded_head(weight, bias)
    for r0 in range(0, M, rows):
        r1 = min(M, r0 + rows)
        loss[r0:r1], grad[r0:r1] = _ce_grad_torch(_logits(x[r0:r1], w, b, V), targets[r0:r1])
    return loss, grad


def _linear_ce_cuda(x, weight, bias, targets):
    grad = _logits(x, *_padded_head(weight, bias), weight.shape[0])
    return ce_grad_(grad, targets), grad


@triton_op("packedenc::linear_cross_entropy", mutates_args=())
def _linear_ce(x: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor) -> tuple[Tensor, Tensor]:
    if x.is_cuda:
        return _linear_ce_cuda(x, weight, bias, targets)
    return chunked_ce(x, weight, bias, targets)


def _setup(ctx, inputs, output):
    x, weight, bias, targets = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.has_bias = bias is not None
    ctx.mark_non_differentiable(output[1])  # G is the saved gradient, not a differentiable output
    ctx.set_materialize_grads(False)  # ... so no (M, V) zeros are made for it in the backward


def _backward(ctx, dloss, _dgrad):
    x, weight, grad = ctx.saved_tensors
    if dloss is None:
        return None, None, None, None
    g = dloss.float()[:, None]  # (M, 1) d total / d loss_i
    dt = x.dtype
    dx = dw = db = None
    if ctx.needs_input_grad[0]:
        dx = (grad @ weight).float().mul_(g).to(dt)
    if ctx.needs_input_grad[1]:
        dw = grad.t() @ (x.float() * g).to(dt)
    if ctx.has_bias and ctx.needs_input_grad[2]:
        hi = g.to(dt)
        lo = (g - hi.float()).to(dt)  # g = hi + lo to ~fp32 precision: the rounding of g biases nothing
        db = (grad.t() @ torch.cat((hi, lo), dim=1)).float().sum(1).to(dt)
    return dx, dw, db, None


_linear_ce.register_autograd(_backward, setup_context=_setup)
_linear_ce_eager = eager_autograd(_linear_ce_cuda, _setup, _backward)


def linear_cross_entropy(x_MD: Tensor, weight_VD: Tensor, bias_V: Tensor | None, targets_M: Tensor) -> Tensor:
    """Per-row cross-entropy of the logits x @ W^T + b; see `reference.linear_cross_entropy`.

    Arguments:
        x_MD: (M, D) features of the scored rows. weight_VD: (V, D) decoder, x's dtype; bias_V: (V,) or None.
        targets_M: (M,) int ids in [0, V); -100 (any id outside [0, V)) is ignored: loss 0.
    Return:
        (M,) fp32 losses. Saves one (M, V) tensor in x's dtype for the backward (module docstring).
    """
    if x_MD.dtype != weight_VD.dtype or (bias_V is not None and bias_V.dtype != x_MD.dtype):
        raise TypeError(f"linear_cross_entropy: x {x_MD.dtype}, weight {weight_VD.dtype} and bias "
                        f"{None if bias_V is None else bias_V.dtype} must share one dtype (as F.linear)")
    if eager_cuda(x_MD, weight_VD, bias_V):
        return _linear_ce_eager(x_MD, weight_VD, bias_V, targets_M)[0]
    return torch.ops.packedenc.linear_cross_entropy(x_MD, weight_VD, bias_V, targets_M)[0]
