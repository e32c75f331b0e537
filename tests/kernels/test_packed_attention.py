"""triton/packed_attention.py: token-block packed attention (forward + backward on fused qkv) vs the reference.

CPU: the kernels under TRITON_INTERPRET=1 on tiny ragged packs (length-1 sequences, a block straddling
several sequences, a sequence longer than a tile) in fp32 / fp16 with 16-row tiles: output, LSE2,
gradients, isolation, determinism; the registered op's autograd and torch.compile on the CPU
reference. GPU (`gpu`): bf16 / fp16 at the graph-transformer shapes (H=8, K=64 and a folded K=65)
with the 2x rule, and eager inference (direct launch) equal to the op.
"""

import math

import pytest
import torch

from packedenc.kernels import reference
from packedenc.kernels.reference import backward as reference_bwd
from packedenc.kernels.triton import packed_attention as P
from tests.kernels._assert import DEVICE, assert_close_to_ref, cu_seqlens, other_rows

TINY = (16, 16, 4, 1)  # tl.dot's smallest tile: several blocks and inner tiles per pack
CPU_LENS = (1, 5, 3, 20, 2, 17, 1)  # singletons, a block straddling several sequences, one > a tile


def _ref(qkv, cu, L, scale=None):
    q, k, v = qkv.float().unbind(1)
    return reference.varlen_attention(q, k, v, cu, L, (-1, -1), scale)


def _lse2_ref(qkv, cu, scale):
    from packedenc.packing import segment_ids

    q, k, _ = qkv.float().unbind(1)
    T = q.shape[0]
    seq = segment_ids(cu, T)
    s = torch.einsum("thk,shk->hts", q, k) * scale
    s = s.masked_fill(seq[None, :, None] != seq[None, None, :], float("-inf"))
    return torch.logsumexp(s, -1) / math.log(2)  # (H, T)


def _lowp_grads(qkv, do, cu, scale=None):
    """Gradients of the plain low-precision attention (low-precision products, fp32 softmax)."""
    from packedenc.packing import segment_ids

    T, _, H, K = qkv.shape
    scale = K**-0.5 if scale is None else scale
    x = qkv.detach().clone().requires_grad_()
    q, k, v = (t.transpose(0, 1) for t in x.unbind(1))
    seq = segment_ids(cu, T)
    s = (q @ k.transpose(1, 2)) * scale
    p = torch.softmax(s.float().masked_fill(seq[:, None] != seq[None, :], float("-inf")), -1).to(qkv.dtype)
    (p @ v).transpose(0, 1).backward(do)
    return x.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_forward_and_lse_equal_the_reference(dtype):
    H, K = 2, 16
    cu, L = cu_seqlens(CPU_LENS), max(CPU_LENS)
    qkv = torch.randn(sum(CPU_LENS), 3, H, K).to(DEVICE, dtype)
    out, lse2 = P.packed_attention_fwd(qkv, cu, tile=TINY)
    assert out.dtype == dtype and out.is_contiguous()
    ref = _ref(qkv, cu, L)
    q, k, v = qkv.unbind(1)
    from tests.kernels.test_triton_attention import _lowp

    assert_close_to_ref(out, ref, _lowp(q, k, v, cu, L, (-1, -1)), what=str(dtype))
    # LSE2 = log2 sum_k 2^(scale * log2(e) * q.k) = (natural logsumexp of scale * q.k) / ln 2
    torch.testing.assert_close(lse2, _lse2_ref(qkv, cu, K**-0.5).to(lse2.device), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_backward_equals_the_reference(dtype, scale):
    H, K = 2, 16
    cu = cu_seqlens(CPU_LENS)
    T = sum(CPU_LENS)
    qkv = torch.randn(T, 3, H, K).to(DEVICE, dtype)
    do = torch.randn(T, H, K).to(DEVICE, dtype)
    out, lse2 = P.packed_attention_fwd(qkv, cu, scale, tile=TINY)
    dqkv = P.packed_attention_bwd(do, qkv, out, lse2, cu, scale, tile=TINY)
    assert dqkv.shape == qkv.shape and dqkv.dtype == dtype
    q, k, v = qkv.float().unbind(1)
    want = torch.stack(reference_bwd.varlen_attention_bwd(do.float(), q, k, v, cu, (-1, -1), scale), 1)
    if dtype == torch.float32:
        torch.testing.assert_close(dqkv, want, atol=2e-5, rtol=1e-4)
    else:
        assert_close_to_ref(dqkv, want, _lowp_grads(qkv, do, cu, scale), atol=1e-3, what="dqkv")


def test_strided_views_tiles_isolation_and_determinism():
    H, K = 3, 8  # K below the 16-wide head-dim tile: masked columns
    cu = cu_seqlens(CPU_LENS)
    T = sum(CPU_LENS)
    # qkv as a view of a wider buffer (row stride > 3HK), as a sliced projection output would be
    base = torch.randn(T, 3 * H * K + 5).to(DEVICE)
    qkv = base[:, : 3 * H * K].view(T, 3, H, K)
    do = torch.randn(T, H, K).to(DEVICE)
    runs = []
    for tile in (TINY, (32, 16, 4, 1), (16, 32, 4, 1)):
        out, lse2 = P.packed_attention_fwd(qkv, cu, tile=tile)
        runs.append((out, P.packed_attention_bwd(do, qkv, out, lse2, cu, tile=tile)))
    for out, d in runs[1:]:
        torch.testing.assert_close(out, runs[0][0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(d, runs[0][1], atol=1e-5, rtol=1e-5)
    again = P.packed_attention_fwd(qkv, cu, tile=TINY)[0]
    assert torch.equal(again, runs[0][0])  # deterministic
    # another sequence's keys / values do not reach sequence 3 (rows 9..28), nor its gradients
    other = other_rows(CPU_LENS, 3)
    qkv2 = qkv.clone()
    qkv2[other, 1:] = qkv2[other, 1:] * 3 + 1
    out2, lse2b = P.packed_attention_fwd(qkv2, cu, tile=TINY)
    d2 = P.packed_attention_bwd(do, qkv2, out2, lse2b, cu, tile=TINY)
    mine = ~other
    torch.testing.assert_close(out2[mine], runs[0][0][mine], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(d2[mine], runs[0][1][mine], atol=1e-6, rtol=1e-6)


def test_registered_op_autograd_and_compile_on_cpu():
    # On the CPU the op runs the reference (forward) and reference_bwd (backward): this checks the
    # registration, the autograd wiring into one (T, 3, H, K) gradient and the fake under compile.
    cu, L = cu_seqlens(CPU_LENS, "cpu"), max(CPU_LENS)
    qkv = torch.randn(sum(CPU_LENS), 3, 2, 8, requires_grad=True)
    out = P.packed_attention(qkv, cu, L)
    w = torch.randn_like(out)
    (g,) = torch.autograd.grad((out * w).sum(), qkv)
    x = qkv.detach().clone().requires_grad_()
    ref = _ref(x, cu, L)
    (g_ref,) = torch.autograd.grad((ref * w).sum(), x)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(g, g_ref, atol=1e-5, rtol=1e-5)
    compiled = torch.compile(P.packed_attention, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(qkv, cu, L), out)


# ---- GPU ---------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("K", [64, 65])  # 65: the key-bias fold's extra column
def test_gpu_forward_backward_2x_rule(dtype, K):
    lens = [1, 90, 3, 256, 17, 1, 64, 129, 200, 2] * 4
    cu, L, T, H = cu_seqlens(lens), max(lens), sum(lens), 8
    qkv = torch.randn(T, 3, H, K, device="cuda").to(dtype)
    do = torch.randn(T, H, K, device="cuda").to(dtype)
    x = qkv.clone().requires_grad_()
    out = P.packed_attention(x, cu, L)
    (dqkv,) = torch.autograd.grad(out, x, do)
    q, k, v = qkv.float().unbind(1)
    ref = _ref(qkv, cu, L)
    from tests.kernels.test_triton_attention import _lowp

    assert_close_to_ref(out, ref, _lowp(*qkv.unbind(1), cu, L, (-1, -1)), what="out")
    want = torch.stack(reference_bwd.varlen_attention_bwd(do.float(), q, k, v, cu), 1)
    assert_close_to_ref(dqkv, want, _lowp_grads(qkv, do, cu), atol=1e-3, what="dqkv")
    with torch.no_grad():  # eager inference launches directly (no LSE): same output
        assert torch.equal(P.packed_attention(qkv, cu, L), out.detach())
