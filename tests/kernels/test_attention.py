"""triton/attention*.py: the packed varlen attention kernels (forward, dQ, dK/dV) vs the reference.

CPU: the kernels under TRITON_INTERPRET=1 on tiny ragged packs with 16-row tiles (and 32-row
blocks over 16-row inner tiles, the sweep's short-sequence shape) (1- and 2-token
sequences, blocks straddling several sequences, sequences longer than a tile and than the window,
empty sequences), fp32 / fp16, global and windowed (one-sided too), head dims 16..128 and odd ones:
output and all three gradients against the reference; isolation of the gradients; fused qkv
views; the registered op (opcheck, autograd, torch.compile), bad inputs, the op-table routing.
GPU (`gpu`): bf16 / fp16 with the 2x rule on lengths that cross 64-row tiles, every tile the
launcher can pick, determinism, isolation, direct launch vs the op, head dim 256 and fp32.
"""

import pytest
import torch

from packedenc.errors import InputError
from packedenc.kernels import reference
from packedenc.kernels.reference import backward as reference_bwd
from packedenc.kernels.triton import attention as A
from packedenc.kernels.triton import attention_op as OP
from packedenc.kernels.triton.attention_bwd import attention_bwd
from tests.kernels._assert import DEVICE, GPU_LENGTHS, assert_close_to_ref, cu_seqlens, other_rows

TINY = (16, 16, 4, 1)  # tl.dot's smallest tile: several blocks and inner tiles per pack
TINY_BWD = (TINY, TINY)
MIXED = (1, 2, 5, 3, 20, 1, 17, 2)  # 1- and 2-token sequences, blocks straddling 3-4, one > a tile
LONG_CPU = (1, 70, 3, 40, 2)  # longer than a (5, 5) and a (16, 16) window; a block straddling four


def _inputs(lengths, H, K, dtype, device=DEVICE, n=4):
    T = sum(lengths)
    return [torch.randn(T, H, K).to(device, dtype) for _ in range(n)]


def _kernels(q, k, v, do, cu, L, window, scale=None, tile=TINY, bwd=TINY_BWD, fused_qkv=False):
    """(out, dq, dk, dv) from the launchers."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out, lse = A.attention_fwd(q, k, v, cu, L, window, scale, lse=True, tile=tile)
    g = attention_bwd(do, q, k, v, out, lse, cu, L, window, scale, fused_qkv, tiles=bwd)
    return (out, *g.unbind(1 if fused_qkv else 0))


def _plain(q, k, v, do, cu, window, scale=None):
    """(out, dq, dk, dv) of the plain attention in q's dtype (HF eager: low-precision products,
    fp32 softmax rounded), by autograd. The 2x rule's baseline: the reference upcasts inside."""
    from packedenc.packing import segment_ids

    T, H, K = q.shape
    seq, i = segment_ids(cu, T), torch.arange(T, device=q.device)
    keep = seq[:, None] == seq[None, :]
    if window[0] >= 0:
        keep &= i[None, :] >= i[:, None] - window[0]
    if window[1] >= 0:
        keep &= i[None, :] <= i[:, None] + window[1]
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    qh, kh, vh = (t.transpose(0, 1) for t in leaves)
    s = (qh @ kh.transpose(1, 2)) * (K**-0.5 if scale is None else scale)
    p = torch.softmax(s.float().masked_fill(~keep, float("-inf")), dim=-1).to(q.dtype)
    out = (p @ vh).transpose(0, 1)
    return (out.detach(), *torch.autograd.grad(out, leaves, do))


def _reference(q, k, v, do, cu, L, window, scale=None):
    """(out, dq, dk, dv) of the reference in fp32."""
    f = [t.float() for t in (q, k, v, do)]
    return (reference.varlen_attention(*f[:3], cu, L, window, scale),
            *reference_bwd.varlen_attention_bwd(f[3], *f[:3], cu, window, scale))


def _check(lengths, H, K, dtype, window, scale=None, atol=1e-5, **kw):
    q, k, v, do = _inputs(lengths, H, K, dtype)
    cu, L = cu_seqlens(lengths), max(lengths)
    got = _kernels(q, k, v, do, cu, L, window, scale, **kw)
    want = _reference(q, k, v, do, cu, L, window, scale)
    assert got[0].is_contiguous() and all(g.dtype == dtype for g in got)
    if dtype == torch.float32:  # exact fp32 dots: rounding differences only
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4, msg=f"{name} {window}")
    else:
        for name, a, b, c in zip(("out", "dq", "dk", "dv"), got, want, _plain(q, k, v, do, cu, window, scale)):
            assert_close_to_ref(a, b, c, atol=atol, what=f"{name} {dtype} {window}")
    return (q, k, v, do, cu, L), got


# ---- CPU (interpreter) and GPU alike: tiny shapes -------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [(-1, -1), (2, 2), (3, 0), (0, 2), (-1, 1), (2, -1), (0, 0)])
def test_forward_and_gradients_on_a_mixed_pack(dtype, window):
    _check(MIXED, 2, 16, dtype, window, atol=1e-3)


@pytest.mark.parametrize("K", [32, 64, 128])
@pytest.mark.parametrize("window", [(-1, -1), (4, 4)])
def test_head_dims(K, window):
    _check((1, 2, 18, 3), 1, K, torch.float32, window)


@pytest.mark.parametrize("window", [(-1, -1), (5, 5), (16, 16)])
def test_sequences_longer_than_the_window_and_the_tiles(window):
    # blocks whose rows all see whole key tiles: the unmasked middle loops run
    _check(LONG_CPU, 1, 16, torch.float32, window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [(-1, -1), (2, 2)])
def test_owned_blocks_wider_than_the_inner_tiles(dtype, window):
    """The sweep's short-sequence tiles: 32 owned rows looped over in 16-row inner tiles, forward
    and both backward passes (blocks straddling several sequences on both sides)."""
    tile = (32, 16, 2, 1)
    _check(MIXED, 2, 16, dtype, window, atol=1e-3, tile=tile, bwd=(tile, tile))


def test_odd_head_dim_and_a_custom_scale():
    _check(MIXED, 3, 24, torch.float32, (2, 2), scale=0.3)  # 24: a masked head-dim tail of the 32 tile


def test_the_launchers_own_tiles_and_empty_sequences():
    for window in ((-1, -1), (2, 2)):
        _check((4, 0, 7, 1, 0), 2, 16, torch.float32, window, tile=None, bwd=None)  # zero-length sequences
    q, k, v, do = _inputs((0, 0), 2, 16, torch.float32)  # nothing at all: zeros, no launch
    out, dq, dk, dv = _kernels(q, k, v, do, cu_seqlens((0, 0)), 0, (-1, -1))
    assert out.shape == dq.shape == (0, 2, 16)


def test_isolation_of_outputs_and_gradients_and_determinism():
    s = 1  # the 70-token sequence
    (q, k, v, do, cu, L), got = _check(LONG_CPU, 2, 16, torch.float16, (-1, -1), atol=1e-3)
    other = other_rows(LONG_CPU, s)
    k2, v2 = k.clone(), v.clone()
    k2[other] *= 100
    v2[other] *= 100
    again = _kernels(q, k2, v2, do, cu, L, (-1, -1))
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, again):
        assert torch.equal(a[~other], b[~other]), name  # sequence s: bit for bit the same
        assert not torch.equal(a[other], b[other]), name  # the others did change
    assert all(torch.equal(a, b) for a, b in zip(got, _kernels(q, k, v, do, cu, L, (-1, -1))))


def test_fused_qkv_read_as_views_gradient_written_as_one_buffer():
    H, K = 3, 8  # K below the 16-wide head-dim tile: masked columns
    lengths = MIXED
    T, cu, L = sum(lengths), cu_seqlens(lengths), max(lengths)
    base = torch.randn(T, 3 * H * K + 5).to(DEVICE)  # row stride > 3HK, as a sliced projection output
    qkv = base[:, : 3 * H * K].view(T, 3, H, K)
    do = torch.randn(T, H, K).to(DEVICE)
    got = _kernels(*qkv.unbind(1), do, cu, L, (2, 2), fused_qkv=True)
    dqkv = got[1]._base  # the (T, 3, H, K) gradient, written through one kernel argument
    assert dqkv.shape == (T, 3, H, K) and dqkv.is_contiguous() and got[2].data_ptr() - got[1].data_ptr() == H * K * 4
    want = _reference(*qkv.unbind(1), do, cu, L, (2, 2))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)


# ---- the registered op, the entries and the table (host logic; CPU: the reference) -----------------


def test_op_opcheck_autograd_and_compile_in_both_layouts():
    lengths, H, K = (1, 6, 3), 2, 8
    cu, L, T = cu_seqlens(lengths, "cpu"), max(lengths), sum(lengths)
    q, k, v = (torch.randn(T, H, K, requires_grad=True) for _ in range(3))
    qkv = torch.randn(T, 3, H, K, requires_grad=True)
    op = torch.ops.packedenc.triton_varlen_attention.default
    torch.library.opcheck(op, (q, k, v, cu, L, 2, 2, 0.3, True))
    torch.library.opcheck(op, (qkv, None, None, cu, L, -1, 1, 0.3, True))
    w = torch.randn(T, H, K)
    for window in ((2, 2), (-1, 1)):
        got = torch.autograd.grad((OP.varlen_attention(q, k, v, cu, L, window) * w).sum(), (q, k, v))
        want = torch.autograd.grad((reference.varlen_attention(q, k, v, cu, L, window) * w).sum(), (q, k, v))
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
            assert a.is_contiguous()
    (g,) = torch.autograd.grad((OP.attention(qkv, None, None, cu, L) * w).sum(), qkv)
    (g_ref,) = torch.autograd.grad((reference.varlen_attention(*qkv.unbind(1), cu, L) * w).sum(), qkv)
    assert g.shape == qkv.shape  # one (T, 3, H, K) gradient for the fused buffer
    torch.testing.assert_close(g, g_ref, atol=1e-5, rtol=1e-5)
    f = torch.compile(lambda x: OP.attention(x, None, None, cu, L, (1, 1)), fullgraph=True, backend="aot_eager")
    (g_c,) = torch.autograd.grad((f(qkv) * w).sum(), qkv)
    (g_e,) = torch.autograd.grad((OP.attention(qkv, None, None, cu, L, (1, 1)) * w).sum(), qkv)
    torch.testing.assert_close(g_c, g_e, atol=0, rtol=0)


def test_bad_inputs_are_refused_with_the_argument_named():
    q, k, v = _inputs((4, 6), 2, 8, torch.float32, "cpu", 3)
    cu = cu_seqlens((4, 6), "cpu")
    cases = [
        ((q, k, v, cu.long(), 6), "cu_seqlens must be"),
        ((q.int(), k.int(), v.int(), cu, 6), "float16, bfloat16, float32"),
        ((q, k.half(), v, cu, 6), "share one of"),
        ((q, k[:5], v, cu, 6), "shapes differ"),
        ((q[..., None], k, v, cu, 6), r"q must be \(T, H, K\)"),
        ((*_inputs((4, 6), 1, 264, torch.float32, "cpu", 3), cu, 6), "head dims <= 256"),
    ]
    for args, match in cases:
        with pytest.raises(InputError, match=match):
            OP.varlen_attention(*args)
    for scale in (0.0, -0.5):
        with pytest.raises(InputError, match="scale must be > 0"):
            OP.varlen_attention(q, k, v, cu, 6, scale=scale)
    with pytest.raises(InputError, match=r"\(T, 3, H, K\) fused qkv"):
        OP.attention(q, None, None, cu, 6)


@pytest.mark.parametrize("window", [(-1, -1), (2, 2)])
def test_both_program_orders_compute_the_same_bits(window):
    """Heads fastest (the default) and blocks fastest run the same programs in another order."""
    q, k, v, do = _inputs(MIXED, 3, 16, torch.float16)
    cu, L, scale = cu_seqlens(MIXED), max(MIXED), 0.25
    runs = []
    for hm in (True, False):
        out, lse = A.attention_fwd(q, k, v, cu, L, window, scale, lse=True, tile=TINY, head_major=hm)
        runs.append((out, lse, attention_bwd(do, q, k, v, out, lse, cu, L, window, scale, tiles=TINY_BWD, head_major=hm)))
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    assert A.grid(4, 12) == ((12, 4), True) and A.grid(4, 12, head_major=False) == ((4, 12), False)
    assert A.grid(A.MAX_GRID_Y + 1, 12) == ((A.MAX_GRID_Y + 1, 12), False)  # CUDA's grid-y limit


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("window", [(-1, -1), (4, 3)])
def test_tma_loop_tiles_compute_the_pointer_loads_bits(fused, window):
    """TMA tiles load whole blocks (rows of other sequences, zeros past T) where the pointer loads
    mask; the scores' masks make those contribute exact zeros, so every output bit is the same."""
    lengths = LONG_CPU + MIXED
    qkv = torch.randn(sum(lengths), 3, 2, 16).to(DEVICE, torch.float16)
    q, k, v = qkv.unbind(1) if fused else (t.contiguous() for t in qkv.unbind(1))
    do = torch.randn_like(q)
    cu, L = cu_seqlens(lengths), max(lengths)
    assert A.descriptors(16, q, k, v) is not None  # the TMA launches below take their TMA branch
    tma = (*TINY, True)
    plain = _kernels(q, k, v, do, cu, L, window)
    got = _kernels(q, k, v, do, cu, L, window, tile=tma, bwd=(tma, tma))
    assert all(torch.equal(a, b) for a, b in zip(plain, got))


def test_tma_descriptors_only_for_layouts_they_describe():
    x = torch.randn(8, 3, 2, 16, dtype=torch.float16)
    assert A.descriptors(16, x[:, 1]) is not None  # a fused qkv slice: heads K apart, 16-byte strides
    assert A.descriptors(16, x[:, :, 0]) is None  # heads 2 * K apart
    assert A.descriptors(16, torch.randn(8, 2, 24, dtype=torch.float16)) is None  # K not a power of two
    assert A.descriptors(16, torch.randn(8, 2, 16, dtype=torch.float16)[1:]) is not None
    assert A.descriptors(16, torch.randn(8 * 32 + 1, dtype=torch.float16)[1:].view(8, 2, 16)) is None  # base off 16 B
    assert A.descriptors(16, torch.randn(0, 2, 16, dtype=torch.float16)) is None


def test_tiles_come_from_host_values():
    assert A.tiles(81_000, 2048, (64, 64), 64) == A.TILE_WINDOW[0]
    assert A.tiles(3_600, 128, (-1, -1), 64) == A.TILE_SHORT[0]
    assert A.tiles(14_000, 2048, (-1, -1), 64) == A.TILE_MID[0]
    assert A.tiles(81_000, 2048, (-1, -1), 64) == A.TILE_LONG[0]
    assert A.tiles(81_000, 2048, (-1, -1), 256) == A.TILE_WIDE[0]
    assert A.bwd_tiles(81_000, 2048, (-1, -1), 64) == A.TILE_LONG[1:]
    assert A.bwd_tiles(81_000, 2048, (-1, -1), 128) == A.TILE_WINDOW[1:]  # K = 128: no 128-row blocks
    assert A.bwd_tiles(65_000, 128, (64, -1), 64) == A.TILE_WINDOW[1:]  # one-sided windows too


def test_the_table_routes_what_a_partial_implementation_does_not_cover():
    from packedenc import kernels
    from packedenc.kernels import flash

    calls = []
    kernels.register_impl("test-partial", "graph_readout", lambda *a: calls.append("partial"),
                          covers=lambda z, *a: z.dtype == torch.float16)
    kernels.register_impl("test-total", "graph_readout", lambda *a: calls.append("total"))
    assert kernels.chain("graph_readout", ["test-partial", "test-total"]) == "test-partial>test-total"
    assert kernels.chain("graph_readout", ["test-partial"]) == "test-partial>reference"
    assert kernels.chain("graph_readout", ["test-total", "test-partial"]) == "test-total"
    fn = kernels._entry("graph_readout", "test-partial>test-total")
    fn(torch.zeros(2, dtype=torch.float16))
    fn(torch.zeros(2))
    assert calls == ["partial", "total"]
    # the attention rows: triton takes every varlen_attention input; graph_attention only full
    # fused fp16 / bf16 layers (flash, torch's kernels, takes the anchor-only layer and fp32)
    assert kernels.chain("varlen_attention", ["triton", "flash"]) == "triton"
    assert kernels.chain("graph_attention", ["triton", "flash"]) == "triton>flash"
    assert kernels.chain("varlen_attention", ["flash", "triton"]) == "flash>triton"  # forced flash: fp32 -> triton
    qkv, cu = torch.zeros(5, 3, 2, 8, dtype=torch.float16), cu_seqlens((5,), "cpu")
    assert OP.covers_graph(qkv, None, None, cu, cu, 5, 5)
    assert not OP.covers_graph(qkv.float(), None, None, cu, cu, 5, 5)  # fp32
    assert not OP.covers_graph(qkv[:1, 0], qkv[:, 1], qkv[:, 2], cu[[0, 1]], cu, 1, 5)  # anchor-only layer
    assert not OP.covers_graph(torch.zeros(5, 3, 2, 256).half(), None, None, cu, cu, 5, 5, torch.zeros(5, 2))
    # the routed entry traces whole under torch.compile (get_ops builds it outside the trace)
    routed = kernels._entry("graph_attention", "triton>flash")
    x = torch.randn(5, 3, 2, 8).half()
    f = torch.compile(lambda x: routed(x, None, None, cu, cu, 5, 5), fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(f(x), OP.graph_attention(x, None, None, cu, cu, 5, 5), atol=0, rtol=0)
    q = torch.zeros(5, 2, 8, dtype=torch.float16)
    assert not flash.covers_varlen(q, q, q, cu, 5)  # CPU tensors
    with pytest.raises(InputError, match="needs CUDA fp16 / bf16"):
        flash.varlen_attention(q, q, q, cu, 5)


@pytest.mark.parametrize("bias", [False, True])
def test_triton_graph_attention_folds_the_bias_and_returns_one_gradient(bias):
    g = torch.Generator().manual_seed(1)
    cu = torch.tensor([0, 1, 6, 8, 17], dtype=torch.int32)
    qkv = torch.randn(17, 3, 3, 8, generator=g).half().requires_grad_()
    kb = torch.randn(17, 3, generator=g).half() if bias else None
    out = OP.graph_attention(qkv, None, None, cu, cu, 9, 9, kb)
    x = qkv.detach().float().requires_grad_()
    want = reference.graph_attention(x, None, None, cu, cu, 9, 9, kb)
    torch.testing.assert_close(out.float(), want, atol=2e-3, rtol=2e-3)
    (d,) = torch.autograd.grad(out.float().sum(), qkv)
    (d_ref,) = torch.autograd.grad(want.sum(), x)
    assert d.shape == qkv.shape
    torch.testing.assert_close(d.float(), d_ref, atol=5e-3, rtol=5e-3)
    with pytest.raises(InputError, match="fused"):
        OP.graph_attention(*qkv.unbind(1), cu, cu, 9, 9)


# ---- GPU -------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("window", [(-1, -1), (64, 64), (64, 0)])
@pytest.mark.parametrize("dtype,H,K", [(torch.bfloat16, 12, 64), (torch.bfloat16, 4, 32), (torch.bfloat16, 4, 128),
                                       (torch.float16, 12, 64)])
def test_gpu_2x_rule_determinism_isolation(dtype, window, H, K):
    (q, k, v, do, cu, L), got = _check(GPU_LENGTHS, H, K, dtype, window, atol=1e-3, tile=None, bwd=None)
    again = _kernels(q, k, v, do, cu, L, window, tile=None, bwd=None)
    assert all(torch.equal(a, b) for a, b in zip(got, again))  # deterministic: no atomics
    other = other_rows(GPU_LENGTHS, 7)  # all but the 2047-token sequence
    k2, v2 = k.clone(), v.clone()
    k2[other] *= 100
    v2[other] *= 100
    moved = _kernels(q, k2, v2, do, cu, L, window, tile=None, bwd=None)
    for a, b in zip(got, moved):
        assert torch.equal(a[~other], b[~other]) and not torch.equal(a[other], b[other])


# (forward tile, backward tile for both passes): every row of the table and the sweep's extremes
_TILE_PAIRS = [(A.TILE_WINDOW[0], (64, 32, 4, 2)), (A.TILE_MID[0], (128, 32, 8, 3)), (A.TILE_LONG[0], (128, 64, 8, 2)),
               ((32, 32, 4, 1), (32, 32, 4, 1)), ((128, 128, 8, 2), (64, 64, 4, 2)), ((64, 64, 4, 3), (128, 32, 4, 3)),
               ((32, 32, 2, 2), (32, 32, 2, 2)), ((32, 16, 2, 2), (32, 16, 2, 2))]


@pytest.mark.gpu
@pytest.mark.parametrize("tile,bwd", _TILE_PAIRS)
@pytest.mark.parametrize("window", [(-1, -1), (64, 64)])
def test_gpu_every_tile(tile, bwd, window):
    lengths = (3, 24, 1, 17, 60, 128, 5, 130, 33, 300) * 3  # query-like, blocks straddle many sequences
    _check(lengths, 12, 64, torch.bfloat16, window, atol=1e-3, tile=tile, bwd=(bwd, bwd))


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [False, True])
def test_gpu_tma_tiles_2x_rule_and_pointer_bits(fused):
    """The TMA loop tiles (the big packs' row of the table) on sequences that cross 64-row tiles
    and 32k rows: the 2x rule, and the same bits as the pointer loads of the same tiles."""
    lengths = (1, 2047, 3, 600, 70, 129, 1000, 31) * 4
    tiles = [t[:4] for t in A.TILE_LONG]
    for K in (64, 128):
        _check(lengths[:8], 4, K, torch.bfloat16, (-1, -1), atol=1e-3, tile=A.TILE_LONG[0], bwd=A.TILE_LONG[1:])
    qkv = torch.randn(sum(lengths), 3, 12, 64, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.unbind(1) if fused else (t.contiguous() for t in qkv.unbind(1))
    do = torch.randn_like(q)
    cu, L = cu_seqlens(lengths), max(lengths)
    assert A.descriptors(64, q, k, v) is not None
    plain = _kernels(q, k, v, do, cu, L, (-1, -1), tile=tiles[0], bwd=tuple(tiles[1:]))
    got = _kernels(q, k, v, do, cu, L, (-1, -1), tile=A.TILE_LONG[0], bwd=A.TILE_LONG[1:])
    assert all(torch.equal(a, b) for a, b in zip(plain, got))


@pytest.mark.gpu
def test_gpu_head_dim_256_and_fp32():
    _check((1, 63, 64, 65, 300), 2, 256, torch.float16, (-1, -1), atol=1e-3, tile=None, bwd=None)
    _check((1, 63, 64, 65, 300), 2, 64, torch.float32, (64, 64), tile=None, bwd=None)  # ieee dots


@pytest.mark.gpu
def test_gpu_entry_direct_launch_equals_the_op_and_trains():
    lengths = (1, 63, 64, 65, 129, 700)
    cu, L = cu_seqlens(lengths), max(lengths)
    q, k, v, do = _inputs(lengths, 12, 64, torch.bfloat16)
    with torch.no_grad():
        direct = OP.varlen_attention(q, k, v, cu, L, (64, 64))
    op = torch.ops.packedenc.triton_varlen_attention(q, k, v, cu, L, 64, 64, 64**-0.5, True)[0]
    assert torch.equal(direct, op)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = OP.varlen_attention(*leaves, cu, L, (64, 64))
    grads = torch.autograd.grad(out, leaves, do)
    want = _kernels(q, k, v, do, cu, L, (64, 64), tile=None, bwd=None)
    assert torch.equal(out, want[0]) and all(torch.equal(a, b) for a, b in zip(grads, want[1:]))
