"""rotary_attention's fused forward: RoPE applied as the attention reads q and k, vs the reference.

The reference is `varlen_attention(*rotary(qkv, ...))`; the kernel rotates q once per query block
and every key tile as it is read, rounding the rotated values to qkv's dtype as `rotary` does.
CPU: the interpreter on tiny ragged packs with 16-row tiles; GPU (`gpu`): bf16 against the two
Triton ops it replaces, and a ModernBERT encode through both chains.
"""

import pytest
import torch

from packedenc.errors import InputError
from packedenc.kernels import reference
from packedenc.kernels.triton import attention as A
from packedenc.kernels.triton import attention_op as OP
from packedenc.kernels.triton.rotary import _inv_freq
from tests.kernels._assert import DEVICE, assert_close_to_ref, cu_seqlens, other_rows, positions

MIXED = (1, 2, 5, 3, 20, 1, 17, 2)  # 1- and 2-token sequences, blocks straddling several, one > a tile
TINY = (16, 16, 4, 1)


def _fused(qkv, pos, theta, cu, L, window, scaling=1.0, tile=TINY, table=128):
    """`table`: positions in the cos / sin table; tiles with a position past it compute their own."""
    q, k, v = qkv.unbind(1)
    inv = _inv_freq(qkv.shape[-1], theta, qkv.device)
    rope = (pos, inv, A.rope_table(inv, table, scaling, qkv.dtype), scaling)
    return A.attention_fwd(q, k, v, cu, L, window, qkv.shape[-1] ** -0.5, lse=False, tile=tile, rope=rope)[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [(-1, -1), (2, 2), (3, -1)])
@pytest.mark.parametrize("K,theta", [(16, 10000.0), (24, 160000.0)])  # 24: a masked head-dim tail
@pytest.mark.parametrize("table", [128, 4])  # 4: the tiles holding positions >= 4 compute cos / sin
def test_fused_forward_matches_the_reference(dtype, window, K, theta, table):
    qkv, pos, cu = torch.randn(sum(MIXED), 3, 2, K).to(DEVICE, dtype), positions(MIXED), cu_seqlens(MIXED)
    got = _fused(qkv, pos, theta, cu, max(MIXED), window, table=table)
    want32 = reference.rotary_attention(qkv.float(), pos, theta, cu, max(MIXED), window)
    want = reference.rotary_attention(qkv, pos, theta, cu, max(MIXED), window)
    assert_close_to_ref(got, want32, want, atol=1e-5 if dtype == torch.float32 else 1e-3, what="out")


def test_positions_and_scaling_are_taken_as_given():
    # positions that do not restart at 0 and HF's attention_scaling != 1: the same numbers as the reference
    qkv, cu = torch.randn(sum(MIXED), 3, 2, 16).to(DEVICE), cu_seqlens(MIXED)
    pos = positions(MIXED) * 3 + 100
    want = reference.rotary_attention(qkv, pos, 10000.0, cu, max(MIXED), scaling=0.7)
    for table in (128, 256):  # positions 100..157: some past the table, then all inside it
        got = _fused(qkv, pos, 10000.0, cu, max(MIXED), (-1, -1), scaling=0.7, table=table)
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


def test_the_table_holds_what_rotary_computes():
    inv = _inv_freq(24, 160000.0, torch.device(DEVICE))
    for dtype in (torch.float32, torch.bfloat16):
        t = A.rope_table(inv, 50, 0.7, dtype)
        assert t.shape == (50, 2, 32) and t.dtype == torch.float32 and not t[:, :, 24:].any()
        ang = torch.arange(50, dtype=torch.float32, device=inv.device)[:, None] * inv[None, :]
        cos, sin = ((f(ang) * 0.7).to(dtype).float() for f in (torch.cos, torch.sin))
        assert torch.equal(t[:, 0, :24], torch.cat((cos, cos), 1))
        assert torch.equal(t[:, 1, :24], torch.cat((-sin, sin), 1))


@pytest.mark.parametrize("window", [(-1, -1), (2, 2)])
def test_the_output_can_take_the_place_of_q(window, monkeypatch):
    qkv, pos, cu = torch.randn(sum(MIXED), 3, 2, 16).to(DEVICE), positions(MIXED), cu_seqlens(MIXED)
    want = _fused(qkv, pos, 1e4, cu, max(MIXED), window)
    q, k, v = (t.clone() for t in qkv.unbind(1))  # the kernel reads k and v after others wrote their rows
    inv = _inv_freq(16, 1e4, qkv.device)
    rope = (pos, inv, A.rope_table(inv, 128, 1.0, qkv.dtype), 1.0)
    got = A.attention_fwd(q, k, v, cu, max(MIXED), window, 0.25, lse=False, tile=TINY, rope=rope, out=q)[0]
    assert got.data_ptr() == q.data_ptr() and torch.equal(got, want)
    # the op: with overwrite_input, eager inference returns a view of qkv's q slot (no allocation)
    monkeypatch.setattr(OP, "direct_launch", lambda *t: True)
    buf = qkv.clone()
    out = OP.rotary_attention(buf, pos, 1e4, cu, max(MIXED), window, overwrite_input=True)
    assert out.data_ptr() == buf.data_ptr() and out.stride()[0] == 3 * 2 * 16
    torch.testing.assert_close(out, reference.rotary_attention(qkv, pos, 1e4, cu, max(MIXED), window),
                               atol=2e-6, rtol=1e-5)
    assert torch.equal(buf[:, 1:], qkv[:, 1:])  # k and v are left as they were


def test_sequences_stay_apart():
    qkv, pos, cu = torch.randn(sum(MIXED), 3, 2, 16).to(DEVICE), positions(MIXED), cu_seqlens(MIXED)
    base = _fused(qkv, pos, 10000.0, cu, max(MIXED), (-1, -1))
    rest = other_rows(MIXED, 4)  # everything but the 20-token sequence
    moved = qkv.clone()
    moved[rest] *= 7.0
    again = _fused(moved, pos, 10000.0, cu, max(MIXED), (-1, -1))
    s = ~rest
    assert torch.equal(again[s], base[s])


def test_the_entry_checks_its_inputs():
    qkv, pos, cu = torch.randn(6, 3, 2, 16), torch.arange(6), torch.tensor([0, 6], dtype=torch.int32)
    with pytest.raises(InputError, match="even K"):
        OP.rotary_attention(torch.randn(6, 3, 2, 15), pos, 1e4, cu, 6)
    with pytest.raises(InputError, match=r"\(T, 3, H, K\)"):
        OP.rotary_attention(torch.randn(6, 2, 16), pos, 1e4, cu, 6)
    with pytest.raises(InputError, match="positions must be"):
        OP.rotary_attention(qkv, pos[:5], 1e4, cu, 6)
    with pytest.raises(InputError, match="positions must be"):
        OP.rotary_attention(qkv, pos.float(), 1e4, cu, 6)
    with pytest.raises(InputError, match="cu_seqlens"):
        OP.rotary_attention(qkv, pos, 1e4, cu.long(), 6)


def test_covers_only_short_eager_inference_without_dropout(monkeypatch):
    qkv, pos, cu = torch.randn(6, 3, 2, 16), torch.arange(6), torch.tensor([0, 6], dtype=torch.int32)
    assert not OP.covers_rotary_attention(qkv, pos, 1e4, cu, 6)  # CPU tensors: the parts (the reference)
    monkeypatch.setattr(OP, "direct_launch", lambda *t: True)  # as for plain CUDA inference
    assert OP.covers_rotary_attention(qkv, pos, 1e4, cu, 128)
    assert not OP.covers_rotary_attention(qkv, pos, 1e4, cu, 129)  # long sequences: rotary + attention
    assert not OP.covers_rotary_attention(qkv, pos, 1e4, cu, 6, dropout_p=0.1, dropout_seed=1)
    assert not OP.covers_rotary_attention(torch.randn(6, 3, 2, 15), pos, 1e4, cu, 6)


# ---- GPU ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("window", [(-1, -1), (64, 64)])
@pytest.mark.parametrize("K", [64, 128])
def test_gpu_fused_equals_rotary_then_attention(window, K):
    from packedenc.kernels import get_ops

    torch.manual_seed(0)
    lengths = [int(n) for n in torch.randint(1, 129, (300,))]
    qkv = torch.randn(sum(lengths), 3, 12 if K == 64 else 6, K, device="cuda", dtype=torch.bfloat16)
    pos, cu = positions(lengths, "cuda"), cu_seqlens(lengths, "cuda")
    ops = get_ops("triton", "cuda")
    with torch.no_grad():
        got = ops.rotary_attention(qkv, pos, 160000.0, cu, max(lengths), window=window)
        parts = ops.varlen_attention(*ops.rotary(qkv, pos, 160000.0, with_v=True), cu, max(lengths), window=window)
    want32 = reference.rotary_attention(qkv.float(), pos, 160000.0, cu, max(lengths), window)
    assert_close_to_ref(got, want32, parts, atol=1e-3, what="fused vs rotary + attention")


@pytest.mark.gpu
def test_gpu_modernbert_encode_fused_and_unfused_agree():
    import packedenc as pe
    from packedenc import kernels
    from packedenc.models.modernbert import ModernBertConfig, init

    cfg = ModernBertConfig(num_hidden_layers=3)
    params = pe.tree_to(init(cfg, torch.Generator().manual_seed(0), dtype=torch.bfloat16), "cuda")
    g = torch.Generator().manual_seed(1)
    b = pe.pack([list(range(5, 5 + int(n))) for n in torch.randint(1, 100, (64,), generator=g)], device="cuda")
    ops = kernels.get_ops("triton", "cuda")
    assert dict(ops.chosen)["rotary_attention"] == "triton>rotary+varlen_attention"
    with torch.no_grad():
        fused = pe.encode(params, b.ids, b.cu_seqlens, b.max_seqlen, backend=ops)
        parts = pe.encode(params, b.ids, b.cu_seqlens, b.max_seqlen,
                          backend=kernels.unfused(ops, "rotary_attention"))
    cos = torch.nn.functional.cosine_similarity(fused.float(), parts.float(), dim=-1)
    assert cos.min() > 0.9999, cos.min()
