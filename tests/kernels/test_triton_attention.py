"""triton/attention.py: packed token-block varlen attention (forward) vs the reference.

CPU: the kernel under TRITON_INTERPRET=1 on tiny ragged packs in fp32 / fp16 with 16-row tiles
(length-1 sequences, blocks straddling several sequences, windows narrower and wider than the
sequences, one-sided windows), isolation, determinism, the dispatch rules and the custom op.
GPU (`gpu`): bf16 / fp16 over the lengths that cross tile edges, head dims 32 / 64 / 128 (and 256),
against the fp32 reference with the 2x rule; isolation; determinism; every tile the launcher picks.
"""

import pytest
import torch

from packedenc.kernels import reference
from packedenc.kernels.triton import attention as A
from tests.kernels._assert import (
    CPU_LENGTHS, DEVICE, GPU_LENGTHS, assert_close_to_ref, cu_seqlens, other_rows,
)

TINY_TILE = (16, 16, 4, 1)  # tl.dot's smallest tile; several blocks and key tiles per pack
LONG_CPU = (1, 70, 3, 40, 90, 2)  # sequences longer than a (64, 64) window, one block straddling four


def _qkv(T, H, K, dtype, device=DEVICE):
    return [torch.randn(T, H, K).to(device, dtype) for _ in range(3)]


def _lowp(q, k, v, cu, L, window, scale=None):
    """The plain low-precision attention (HF eager): low-precision scores, fp32 softmax rounded,
    low-precision P @ V. The 2x rule's baseline: the reference upcasts to fp32 inside."""
    from packedenc.packing import segment_ids

    T, H, K = q.shape
    seq, i = segment_ids(cu, T), torch.arange(T, device=q.device)
    keep = seq[:, None] == seq[None, :]
    if window[0] >= 0:
        keep &= i[None, :] >= i[:, None] - window[0]
    if window[1] >= 0:
        keep &= i[None, :] <= i[:, None] + window[1]
    qh, kh, vh = (t.transpose(0, 1) for t in (q, k, v))
    s = (qh @ kh.transpose(1, 2)) * (K**-0.5 if scale is None else scale)
    p = torch.softmax(s.float().masked_fill(~keep, float("-inf")), dim=-1).to(q.dtype)
    return (p @ vh).transpose(0, 1)


def _check(lengths, H, K, dtype, window, tile=None, scale=None, atol=1e-5):
    T, L = sum(lengths), max(lengths)
    q, k, v = _qkv(T, H, K, dtype)
    cu = cu_seqlens(lengths)
    out = A.varlen_attention_fwd(q, k, v, cu, L, window, scale, tile=tile)
    assert out.is_contiguous()
    ref32 = reference.varlen_attention(q.float(), k.float(), v.float(), cu, L, window, scale)
    assert_close_to_ref(out, ref32, _lowp(q, k, v, cu, L, window, scale), atol=atol, what=f"{dtype} {window}")
    return q, k, v, cu, L, out


# ---- CPU (interpreter) and GPU alike: tiny shapes -------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [(-1, -1), (2, 2), (3, 0), (0, 2), (-1, 1), (2, -1)])
def test_matches_reference_on_a_ragged_pack(dtype, window):
    _check(CPU_LENGTHS, 2, 16, dtype, window, TINY_TILE)


@pytest.mark.parametrize("window", [(-1, -1), (64, 64), (5, 5)])
def test_long_enough_sequences_for_the_window(window):
    _check(LONG_CPU, 2, 16, torch.float32, window, TINY_TILE)


def test_head_dim_not_a_power_of_two_and_a_custom_scale():
    _check(CPU_LENGTHS, 3, 24, torch.float32, (2, 2), TINY_TILE, scale=0.3)


def test_the_launchers_own_tile_and_an_empty_sequence():
    lengths = (4, 0, 7, 1)  # a zero-length sequence in cu_seqlens
    for window in ((-1, -1), (2, 2)):
        _check(lengths, 2, 16, torch.float32, window)


def test_isolation_and_determinism():
    lengths = LONG_CPU
    q, k, v, cu, L, out = _check(lengths, 2, 16, torch.float16, (-1, -1), TINY_TILE, atol=1e-4)
    other = other_rows(lengths, 3)
    k2, v2 = k.clone(), v.clone()
    k2[other] *= 100
    v2[other] *= 100
    out2 = A.varlen_attention_fwd(q, k2, v2, cu, L, (-1, -1), tile=TINY_TILE)
    assert torch.equal(out[~other], out2[~other]) and not torch.equal(out[other], out2[other])
    assert torch.equal(A.varlen_attention_fwd(q, k, v, cu, L, (-1, -1), tile=TINY_TILE), out)


def test_strided_v_from_a_fused_qkv():
    T, H, K = sum(CPU_LENGTHS), 2, 16
    qkv = torch.randn(T, 3, H, K).to(DEVICE)
    cu, L = cu_seqlens(CPU_LENGTHS), max(CPU_LENGTHS)
    out = A.varlen_attention_fwd(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu, L, (2, 2), tile=TINY_TILE)
    ref = reference.varlen_attention(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu, L, (2, 2))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


# ---- dispatch (host logic) -------------------------------------------------------------------------


def test_auto_rule_uses_host_values_only():
    assert A.prefer_triton((64, 64), 64) and A.prefer_triton((64, 64), 128)  # windowed: the kernel
    assert A.prefer_triton((-1, -1), 64) and A.prefer_triton((-1, -1), 32)  # global, measured head dim
    assert not A.prefer_triton((-1, -1), 128)  # global, larger head dims: FA2 (not measured)
    assert A.tiles(81_000, 2048, (64, 64), 64) == A.TILE_WINDOW
    assert A.tiles(3_600, 128, (-1, -1), 64) == A.TILE_SHORT
    assert A.tiles(14_000, 2048, (-1, -1), 64) == A.TILE_MID
    assert A.tiles(81_000, 2048, (-1, -1), 64) == A.TILE_LONG


def test_gradients_go_to_the_flash_backend(monkeypatch):
    calls = []
    monkeypatch.setattr(A, "_flash", lambda *a: calls.append(a) or reference.varlen_attention(*a))
    q, k, v = _qkv(sum(CPU_LENGTHS), 2, 16, torch.float32)
    cu, L = cu_seqlens(CPU_LENGTHS), max(CPU_LENGTHS)
    q.requires_grad_()
    for fn in (A.varlen_attention, A.triton_varlen_attention):
        calls.clear()
        out = fn(q, k, v, cu, L, (2, 2))
        assert len(calls) == 1 and out.requires_grad
        with torch.no_grad():
            calls.clear()
            fn(q, k, v, cu, L, (2, 2))
            assert len(calls) == (0 if q.is_cuda else 1)  # CPU tensors: always the reference


def test_op_opcheck_and_compile():
    q, k, v = _qkv(10, 2, 8, torch.float32, "cpu")
    cu = cu_seqlens((1, 6, 3), "cpu")
    torch.library.opcheck(torch.ops.packedenc.triton_varlen_attention.default, (q, k, v, cu, 6, 2, 2, None))
    got = torch.ops.packedenc.triton_varlen_attention(q, k, v, cu, 6, 2, 2, None)
    torch.testing.assert_close(got, reference.varlen_attention(q, k, v, cu, 6, (2, 2)), rtol=0, atol=0)
    f = lambda q, k, v: torch.ops.packedenc.triton_varlen_attention(q, k, v, cu, 6, -1, -1, None)  # noqa: E731
    torch.testing.assert_close(torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v), f(q, k, v))


def test_bad_inputs_are_refused():
    q, k, v = _qkv(10, 2, 8, torch.float32, "cpu")
    with pytest.raises(AssertionError, match="int32"):
        A.varlen_attention_fwd(q, k, v, cu_seqlens((4, 6), "cpu").long(), 6)
    with pytest.raises(TypeError, match="float16"):
        A.varlen_attention_fwd(q.int(), k.int(), v.int(), cu_seqlens((4, 6), "cpu"), 6)


# ---- GPU -------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [(-1, -1), (64, 64)])
@pytest.mark.parametrize("H,K", [(12, 64), (4, 32), (4, 128)])
def test_gpu_forward(dtype, window, H, K):
    q, k, v, cu, L, out = _check(GPU_LENGTHS, H, K, dtype, window, atol=1e-3)
    assert torch.equal(A.varlen_attention_fwd(q, k, v, cu, L, window), out)  # deterministic
    assert torch.equal(torch.ops.packedenc.triton_varlen_attention(q, k, v, cu, L, *window, None), out)
    other = other_rows(GPU_LENGTHS, 7)  # all but the 2047-token sequence
    k2, v2 = k.clone(), v.clone()
    k2[other] *= 100
    v2[other] *= 100
    out2 = A.varlen_attention_fwd(q, k2, v2, cu, L, window)
    assert torch.equal(out[~other], out2[~other]) and not torch.equal(out[other], out2[other])


@pytest.mark.gpu
@pytest.mark.parametrize("tile", [A.TILE_WINDOW, A.TILE_MID, A.TILE_LONG, (32, 32, 4, 1)])
@pytest.mark.parametrize("window", [(-1, -1), (64, 64)])
def test_gpu_every_tile(tile, window):
    lengths = (3, 24, 1, 17, 60, 128, 5, 130, 33) * 3  # query-like, blocks straddle many sequences
    _check(lengths, 12, 64, torch.bfloat16, window, tile, atol=1e-3)


@pytest.mark.gpu
def test_gpu_head_dim_256_and_fp32():
    _check((1, 63, 64, 65, 300), 2, 256, torch.float16, (-1, -1), atol=1e-3)
    T, L = 1 + 63 + 64 + 65 + 300, 300
    q, k, v = _qkv(T, 2, 64, torch.float32)
    cu = cu_seqlens((1, 63, 64, 65, 300))
    out = A.varlen_attention(q, k, v, cu, L, (64, 64))  # fp32: the kernel, ieee dots
    torch.testing.assert_close(out, reference.varlen_attention(q, k, v, cu, L, (64, 64)), rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
def test_gpu_dispatch_matches_flash_and_trains_through_it():
    from packedenc.kernels import flash

    lengths = (1, 63, 64, 65, 129, 700)
    T, L = sum(lengths), max(lengths)
    cu = cu_seqlens(lengths)
    q, k, v = _qkv(T, 12, 64, torch.bfloat16)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = A.varlen_attention(*leaves, cu, L, (64, 64))
    assert torch.equal(out, flash.varlen_attention(q, k, v, cu, L, (64, 64)))  # grad needed: FA2
    out.float().sum().backward()
    assert all(t.grad is not None for t in leaves)
    with torch.no_grad():
        assert torch.equal(A.varlen_attention(q, k, v, cu, L, (64, 64)), A.varlen_attention_fwd(q, k, v, cu, L, (64, 64)))
