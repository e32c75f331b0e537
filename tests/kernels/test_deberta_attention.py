"""deberta_attention: the packed Triton disentangled-attention forward (32-row and wide tiles), the slot
lookup, the launch options and the registered op, against the reference.

Without a GPU the kernels run under TRITON_INTERPRET=1 on tiny ragged packs with 16-row tiles
(`SMALL`), so a 50-token sequence spans 4 x 4 tiles: banded tiles near the diagonal, rank-1
(one-slot) tiles beyond the small bucket ranges used here; `WIDE` routes the forward through the
wide kernel at (32, 16) tiles. The backward is in test_deberta_attention_bwd.py, the `gpu` tests
(the issue's lengths in fp16 / bf16, shipped tiles) in test_deberta_attention_gpu.py.
"""

import contextlib
import dataclasses

import pytest
import torch

from packedenc.errors import ConfigError, InputError
from packedenc.kernels import get_ops, reference
from packedenc.kernels.reference import deberta as RD
from packedenc.kernels.triton.deberta import TILES, DebertaTiles, deberta_attention
from packedenc.kernels.triton.deberta import forward as F, forward_wide as W, slots
from packedenc.packing import longest_first
from tests.kernels._assert import DEVICE, assert_close_to_ref, cu_seqlens, err, other_rows

hf = pytest.importorskip("transformers.models.deberta_v2.modeling_deberta_v2")

# A length-1 sequence, one of exactly one tile, one just past it, one of 4 tiles; all longer than
# the bucket ranges below, so the log buckets and both clamps are reached.
LENGTHS = (1, 50, 17, 16, 3)
H, K = 2, 32
SMALL = DebertaTiles(block_max=16)  # 16-row tiles: the interpreter runs them fast
WIDE = DebertaTiles(block_max=16, wide_m=32, wide_n=16)  # the wide kernel at (32, 16) tiles


@contextlib.contextmanager
def launches(kernel):
    """The constexpr arguments of every launch of `kernel` inside the block, one dict per launch."""
    seen = []

    def hook(*args, **kwargs):
        seen.append(kwargs)

    kernel.add_pre_run_hook(hook)
    try:
        yield seen
    finally:
        kernel.pre_run_hooks.remove(hook)


def _inputs(lengths, types, buckets, max_pos, dtype=torch.float32, same_table=False, device=DEVICE, heads=H, dim=K):
    T = sum(lengths)
    span = buckets if buckets > 0 else max_pos
    q, k, v = (torch.randn(T, heads, dim).to(device, dtype) for _ in range(3))
    pk = torch.randn(2 * span, heads, dim).to(device, dtype) if "c2p" in types else None
    pq = torch.randn(2 * span, heads, dim).to(device, dtype) if "p2c" in types else None
    if same_table and pk is not None and pq is not None:
        pq = pk  # one tensor read as both tables
    return q, k, v, cu_seqlens(lengths, device), pk, pq


def _f32(*ts):
    return [None if t is None else t.float() for t in ts]


def _ref(q, k, v, cu, L, pk, pq, types, buckets, max_pos, scale):
    return reference.deberta_attention(q, k, v, cu, L, pk, pq, pos_att_type=types, position_buckets=buckets,
                                       max_relative_positions=max_pos, scale=scale)


# ---- the slot lookup --------------------------------------------------------------------------


@pytest.mark.parametrize("buckets, max_pos", [
    (256, 512),  # DeBERTa-v3: the exact tie at |d| = 511 (slot 511 / 1), saturation at 506 / -512
    (256, 1024), (128, 512), (8, 16), (4, 10), (7, 40),  # odd buckets: asymmetric saturation
    (-1, 16), (-1, 512),  # no buckets: plain distances clamped at +-span
])
def test_slots_equal_hf_at_every_distance_up_to_8192(buckets, max_pos):
    """Through `_slot`, the lookup every kernel uses, vs HF's make_log_bucket_position (CPU)."""
    d = torch.arange(-8192, 8193)
    span = buckets if buckets > 0 else max_pos
    rel = hf.make_log_bucket_position(d, buckets, max_pos).long() if buckets > 0 else d
    want = torch.clamp(rel + span, 0, 2 * span - 1)
    assert torch.equal(slots.table_slots(d.to(DEVICE), buckets, max_pos, 2 * span).cpu().long(), want)


@pytest.mark.parametrize("buckets, max_pos", [(256, 512), (8, 16), (256, 2048)])
def test_unclamped_buckets_through_the_kernel_lookup_equal_hf(buckets, max_pos):
    """With a table wider than any bucket the slot minus R/2 is the raw bucket: HF's exactly at every
    |d| <= 8192, including the float near-ties 511, 1471, 2650, 7464 of (256, 512)."""
    d = torch.arange(-8192, 8193)
    R = 4096
    got = slots.table_slots(d.to(DEVICE), buckets, max_pos, R).cpu().long() - R // 2
    assert torch.equal(got, hf.make_log_bucket_position(d, buckets, max_pos).long())
    if (buckets, max_pos) == (256, 512):
        assert got[8192 + torch.tensor([511, 1471, 2650, 7464])].tolist() == [255, 352, 406, 502]


# ---- forward ----------------------------------------------------------------------------------

FWD_CASES = {  # name: (pos_att_type, buckets, max_relative_positions, one tensor for both tables)
    "both_separate": (("c2p", "p2c"), 4, 6, False),  # log buckets beyond |d| = 2, saturated beyond 5
    "both_shared": (("c2p", "p2c"), 8, 16, True),
    "c2p_odd": (("c2p",), 7, 40, False),  # odd bucket count, saturates at +40 / -141
    "p2c_plain": (("p2c",), -1, 3, False),  # no log buckets: distances clamped at +-3
    "content_only": ((), -1, 4, False),
}


@pytest.mark.parametrize("name", sorted(FWD_CASES))
def test_forward_matches_reference(name):
    types, buckets, max_pos, same = FWD_CASES[name]
    q, k, v, cu, pk, pq = _inputs(LENGTHS, types, buckets, max_pos, same_table=same)
    o, lse = F.deberta_attention_fwd(q, k, v, cu, max(LENGTHS), pk, pq, buckets, max_pos, 0.2, tiles=SMALL)
    ref = _ref(q, k, v, cu, max(LENGTHS), pk, pq, types, buckets, max_pos, 0.2)
    assert o.is_contiguous() and o.shape == q.shape
    assert err(o, ref) <= 2e-6, err(o, ref)
    assert err(lse, RD.deberta_attention_lse(q, k, cu, max(LENGTHS), pk, pq, buckets, max_pos, 0.2)) <= 1e-5


@pytest.mark.parametrize("name", ["both_separate", "c2p_odd"])
def test_forward_fp16_two_x_rule(name):
    types, buckets, max_pos, same = FWD_CASES[name]
    q, k, v, cu, pk, pq = _inputs(LENGTHS, types, buckets, max_pos, torch.float16)
    o, _ = F.deberta_attention_fwd(q, k, v, cu, max(LENGTHS), pk, pq, buckets, max_pos, 0.2, tiles=SMALL)
    ref32 = _ref(*_f32(q, k, v), cu, max(LENGTHS), *_f32(pk, pq), types, buckets, max_pos, 0.2)
    ref16 = _ref(q, k, v, cu, max(LENGTHS), pk, pq, types, buckets, max_pos, 0.2)
    assert_close_to_ref(o, ref32, ref16, atol=2e-3, what=name)


@contextlib.contextmanager
def _kernels(wide: bool, n: int):
    """Assert that the block launches the wide (or the 32-row) forward kernel n times, the other never."""
    with launches(F._fwd_kernel) as narrow_seen, launches(W._fwd_wide_kernel) as wide_seen:
        yield
    assert (len(wide_seen), len(narrow_seen)) == ((n, 0) if wide else (0, n))


@pytest.mark.parametrize("wide", [False, True])
def test_forward_strided_qkv_views_head_dim_tail_loose_max_seqlen_and_chunked_grid(wide):
    """q/k/v as slices of a fused (T, 3, H, K) qkv, a head dim (24) below its 32-wide block, a
    max_seqlen above the longest sequence (extra query blocks exit early), and the sequences
    launched two per grid (`max_grid_z`, as packs of more than 65535 sequences are); 32-row and
    wide tiles."""
    tiles = dataclasses.replace(WIDE if wide else SMALL, max_grid_z=2)
    lengths, types = (7, 1, 40), ("c2p", "p2c")
    T = sum(lengths)
    qkv = torch.randn(T, 3, 3, 24).to(DEVICE)
    pk, pq = torch.randn(16, 3, 24).to(DEVICE), torch.randn(16, 3, 24).to(DEVICE)
    cu = cu_seqlens(lengths)
    q, k, v = qkv.unbind(1)
    with _kernels(wide, 2):  # 3 sequences, 2 per launch
        o, _ = F.deberta_attention_fwd(q, k, v, cu, 64, pk, pq, 8, 16, 0.3, tiles=tiles)
    assert err(o, _ref(q, k, v, cu, 40, pk, pq, types, 8, 16, 0.3)) <= 2e-6


@pytest.mark.parametrize("wide", [False, True])
def test_isolation_and_determinism(wide):
    tiles = WIDE if wide else SMALL
    types, buckets, max_pos = ("c2p", "p2c"), 4, 6
    q, k, v, cu, pk, pq = _inputs(LENGTHS, types, buckets, max_pos)
    L = max(LENGTHS)
    with _kernels(wide, 3):
        o, _ = F.deberta_attention_fwd(q, k, v, cu, L, pk, pq, buckets, max_pos, 0.2, tiles=tiles)
        assert torch.equal(o, F.deberta_attention_fwd(q, k, v, cu, L, pk, pq, buckets, max_pos, 0.2, tiles=tiles)[0])
        other = other_rows(LENGTHS, 1)  # every token not in the 50-token sequence
        q2, k2, v2 = q.clone(), k.clone(), v.clone()
        k2[other] *= 7
        v2[other] += 3
        q2[other] *= 0.5
        o2, _ = F.deberta_attention_fwd(q2, k2, v2, cu, L, pk, pq, buckets, max_pos, 0.2, tiles=tiles)
    assert torch.equal(o2[~other], o[~other]) and not torch.allclose(o2[other], o[other])


@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("chunked", [False, True])
def test_sequence_order_changes_nothing(wide, chunked):
    """Programs taking the sequences longest first (or in any permutation) give the same bits; a
    pack launched in chunks (more sequences than `max_grid_z`) ignores the order."""
    tiles = dataclasses.replace(WIDE if wide else SMALL, max_grid_z=2 if chunked else TILES.max_grid_z)
    types, buckets, max_pos = ("c2p", "p2c"), 4, 6
    q, k, v, cu, pk, pq = _inputs(LENGTHS, types, buckets, max_pos)
    L = max(LENGTHS)
    o, lse = F.deberta_attention_fwd(q, k, v, cu, L, pk, pq, buckets, max_pos, 0.2, tiles=tiles)
    order = longest_first(cu)
    assert order.tolist() == [1, 2, 3, 4, 0]  # lengths (1, 50, 17, 16, 3)
    for perm in (order, torch.tensor([3, 0, 4, 2, 1], dtype=torch.int32)):
        with launches(W._fwd_wide_kernel if wide else F._fwd_kernel) as seen:
            o2, lse2 = F.deberta_attention_fwd(q, k, v, cu, L, pk, pq, buckets, max_pos, 0.2,
                                               seq_order=perm.to(DEVICE), tiles=tiles)
        assert [s["HAS_ORDER"] for s in seen] == ([False] * 3 if chunked else [True])
        assert torch.equal(o2, o) and torch.equal(lse2, lse)


def test_sequence_order_is_checked():
    """A seq_order of the wrong dtype, shape or device, or (on the CPU) not a permutation, is an
    InputError naming the fix, in the kernel's Ops entry and in the reference."""
    types, buckets, max_pos = ("c2p", "p2c"), 4, 6
    q, k, v, cu, pk, pq = _inputs(LENGTHS, types, buckets, max_pos, device="cpu")
    kw = dict(pos_att_type=types, position_buckets=buckets, max_relative_positions=max_pos, scale=0.2)
    want = reference.deberta_attention(q, k, v, cu, 50, pk, pq, **kw)
    for fn in (deberta_attention, reference.deberta_attention):
        got = fn(q, k, v, cu, 50, pk, pq, seq_order=longest_first(cu), **kw)
        assert torch.equal(got, want)
        for bad, msg in ((longest_first(cu).long(), "int32"), (torch.arange(4, dtype=torch.int32), r"\(5,\)"),
                         (torch.tensor([0, 0, 1, 2, 3], dtype=torch.int32), "exactly once"),
                         ([1, 2, 3, 4, 0], "int32")):
            with pytest.raises(InputError, match=msg):
                fn(q, k, v, cu, 50, pk, pq, seq_order=bad, **kw)


@pytest.mark.parametrize("types", [("c2p", "p2c"), ("c2p",), ("p2c",)])
@pytest.mark.parametrize("block, dim", [(16, 32), (32, 80)])  # K = 80: the 32-row kernel (wide tiles need K <= 64)
def test_band_runs_match_reference(types, block, dim):
    """The 32-row forward's band loop, whose c2p is computed over BLOCK fresh slot rows per key tile
    with the other BLOCK carried from the previous tile: sequences of 1, 17, 100 and 40 tokens with
    8 buckets up to 64 give runs of band tiles (carries), single band tiles, and rank-1 / saturated
    tiles around them; fp32 and fp16, output and lse (tolerances grow with the head dim)."""
    buckets, max_pos, lengths = 8, 64, [1, 17, 100, 40]
    for dtype, tol in ((torch.float32, 2e-6 * dim / 32), (torch.float16, 2e-3 * dim / 32)):
        q, k, v, cu, pk, pq = _inputs(lengths, types, buckets, max_pos, dtype=dtype, dim=dim)
        with launches(F._fwd_kernel) as seen:
            o, lse = F.deberta_attention_fwd(q, k, v, cu, max(lengths), pk, pq, buckets, max_pos, 0.2,
                                             tiles=DebertaTiles(block_max=block))
        assert [s["BLOCK"] for s in seen] == [block]
        ref = _ref(*_f32(q, k, v), cu, max(lengths), *_f32(pk, pq), types, buckets, max_pos, 0.2)
        assert err(o.float(), ref) <= tol, (dtype, err(o.float(), ref))
        want_lse = RD.deberta_attention_lse(*_f32(q, k), cu, max(lengths), *_f32(pk, pq), buckets, max_pos, 0.2)
        assert err(lse, want_lse) <= 50 * tol, (dtype, err(lse, want_lse))


@pytest.mark.parametrize("types", [("c2p", "p2c"), ("c2p",), ("p2c",)])
def test_wide_tiles_match_reference(types):
    """The wide forward (`forward_wide.py`: 2N query rows per N-key band tile, c2p in three N-wide
    chunks of which two are carried, p2c in two 2N-row chunks) at (32, 16) tiles: sequences of 1, 17,
    100 and 40 tokens with 8 buckets up to 64 give runs of band tiles, single ones and saturated
    ranges around them; then the shipped (64, 32) tiles with DeBERTa-v3's buckets on sequences of
    70 and 130 tokens (all band). fp32 and fp16, output and lse; fp16 sums c2p + p2c in fp16 before
    they join q @ k^T (as HF's eager sums them): twice the fp16 tolerance."""
    for tiles, lengths, buckets, max_pos in ((WIDE, [1, 17, 100, 40], 8, 64), (TILES, [70, 130], 256, 512)):
        for dtype, tol in ((torch.float32, 2e-6), (torch.float16, 4e-3)):
            q, k, v, cu, pk, pq = _inputs(lengths, types, buckets, max_pos, dtype=dtype)
            with _kernels(True, 1):
                o, lse = F.deberta_attention_fwd(q, k, v, cu, max(lengths), pk, pq, buckets, max_pos, 0.2,
                                                 tiles=tiles)
            ref = _ref(*_f32(q, k, v), cu, max(lengths), *_f32(pk, pq), types, buckets, max_pos, 0.2)
            assert err(o.float(), ref) <= tol, (tiles.wide_n, dtype, err(o.float(), ref))
            want_lse = RD.deberta_attention_lse(*_f32(q, k), cu, max(lengths), *_f32(pk, pq), buckets, max_pos, 0.2)
            assert err(lse, want_lse) <= 50 * tol, (tiles.wide_n, dtype, err(lse, want_lse))


# ---- launch options ---------------------------------------------------------------------------


def test_shipped_launch_options():
    """The options the launchers pass (`DebertaTiles` defaults: the H200 measurements in
    benchmarks/NOTES.md): 32-row forward 4 warps, 2 stages, 168 registers (4-warp launches with
    K <= 64 only); wide forward 4 warps, 1 stage, 168; one-pass backward 4 warps, 1 stage, no cap;
    K > 64 takes 8 warps, uncapped; 16-row tiles 4 warps. A set field reaches its option."""
    assert TILES.fwd_options(32, 64) == dict(num_warps=4, num_stages=2, maxnreg=168)
    assert TILES.fwd_options(32, 128) == dict(num_warps=8, num_stages=2)
    assert TILES.fwd_options(16, 128) == dict(num_warps=4, num_stages=2)
    assert TILES.wide_options() == dict(num_warps=4, num_stages=1, maxnreg=168)
    assert TILES.bwd_options(32, 64) == dict(num_warps=4, num_stages=1)
    assert TILES.bwd_options(32, 128) == dict(num_warps=8, num_stages=1)
    assert (TILES.block(1), TILES.block(17), TILES.block(5000), SMALL.block(5000)) == (16, 32, 32, 16)
    assert (TILES.saturated_rows(32, 2048), TILES.saturated_rows(32, 2049)) == (64, 128)
    assert TILES.takes_wide(32, 33, 64) and not TILES.takes_wide(32, 32, 64) and not TILES.takes_wide(32, 99, 128)
    assert DebertaTiles(fwd_maxnreg=None).fwd_options(32, 64) == dict(num_warps=4, num_stages=2)
    assert DebertaTiles(fwd_maxnreg=128, fwd_stages=3).fwd_options(32, 64) == dict(num_warps=4, num_stages=3,
                                                                                   maxnreg=128)
    assert DebertaTiles(wide_maxnreg=None, wide_stages=2).wide_options() == dict(num_warps=4, num_stages=2)
    assert DebertaTiles(bwd_maxnreg=168, bwd_warps=8).bwd_options(32, 64) == dict(num_warps=8, num_stages=1,
                                                                                  maxnreg=168)


@pytest.mark.parametrize("field, value, msg", [
    ("block_max", 24, "power of two"), ("block_max", 8, "power of two"), ("wide_m", 48, "2 \\* wide_n = 64"),
    ("wide_ns", 48, "power of two"), ("max_grid_z", 0, ">= 1"), ("fwd_warps", 3, "one of"),
    ("bwd_stages", 0, ">= 1"), ("wide_maxnreg", 300, "register count"), ("saturated_blocks", 3, "power of two"),
    ("fwd_stages", True, "an int"), ("block_max", 32.0, "power of two"),
])
def test_bad_tiles_are_a_config_error(field, value, msg):
    with pytest.raises(ConfigError, match=f"DebertaTiles\\({field}={value!r}\\): must be .*{msg}"):
        DebertaTiles(**{field: value})


def test_tiles_are_frozen_and_hashable():
    with pytest.raises(dataclasses.FrozenInstanceError):
        TILES.block_max = 16
    assert hash(DebertaTiles()) == hash(TILES) and DebertaTiles() == TILES != SMALL


# ---- the registered op, compile, and the model through the kernel -----------------------------


def test_registered_op_opcheck_autograd_and_compile():
    """CPU: the custom op runs the reference (and the explicit-formula backward)."""
    cu = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
    q, k, v = (torch.randn(9, 2, 8, requires_grad=True) for _ in range(3))
    pk, pq = torch.randn(8, 2, 8, requires_grad=True), torch.randn(8, 2, 8, requires_grad=True)
    op = torch.ops.packedenc.deberta_attention.default
    torch.library.opcheck(op, (q, k, v, cu, 5, pk, pq, 4, 6, 0.3))
    torch.library.opcheck(op, (q, k, v, cu, 5, None, pq, 4, 6, 0.3))
    kw = dict(pos_att_type=("c2p", "p2c"), position_buckets=4, max_relative_positions=6, scale=0.3)
    w = torch.randn(9, 2, 8)
    leaves = (q, k, v, pk, pq)
    got = torch.autograd.grad((deberta_attention(q, k, v, cu, 5, pk, pq, **kw) * w).sum(), leaves)
    want = torch.autograd.grad((reference.deberta_attention(q, k, v, cu, 5, pk, pq, **kw) * w).sum(), leaves)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    f = lambda q, k, v: deberta_attention(q, k, v, cu, 5, pk, pq, **kw)  # noqa: E731
    q, k, v = q.detach(), k.detach(), v.detach()
    torch.testing.assert_close(torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v), f(q, k, v))


def _kernel_ops():
    """The reference table with deberta_attention bound to the (interpreted) Triton launcher."""

    def attn(q, k, v, cu, L, pk=None, pq=None, *, pos_att_type=(), position_buckets=-1,
             max_relative_positions=-1, scale, seq_order=None):
        return F.deberta_attention_fwd(q, k, v, cu, L, pk, pq, position_buckets, max_relative_positions, scale,
                                       seq_order=seq_order, tiles=SMALL)[0]

    return dataclasses.replace(get_ops("reference", "cpu"), deberta_attention=attn)


@pytest.mark.parametrize("share_att_key", [True, False])
def test_encode_through_the_kernel_matches_the_reference(share_att_key):
    """The whole tiny DeBERTa-v3 (buckets 8 / 16) with the kernel in place of the reference op."""
    import packedenc as pe
    from packedenc.models import deberta

    cfg = dataclasses.replace(deberta.PRESETS["tiny"], share_att_key=share_att_key, hidden_size=64)
    params = deberta.init(cfg, torch.Generator().manual_seed(0))
    params = torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t + 0.1 * torch.randn_like(t), params)
    b = pe.pack([torch.randint(3, 1000, (n,)) for n in (1, 33, 2, 17)])
    want = pe.encode(params, b.ids, b.cu_seqlens, b.max_seqlen, backend="reference")
    got = pe.encode(params, b.ids, b.cu_seqlens, b.max_seqlen, backend=_kernel_ops())
    assert err(got, want) <= 1e-4, err(got, want)
