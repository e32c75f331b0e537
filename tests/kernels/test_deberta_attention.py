"""deberta_attention: the packed Triton disentangled-attention kernels (forward and backward) vs the reference.

Without a GPU the kernels run under TRITON_INTERPRET=1 on tiny ragged packs with 16-row tiles
(`BLOCK_MAX` patched), so a 50-token sequence spans 4 x 4 tiles: banded tiles near the diagonal,
rank-1 (one-slot) tiles beyond the small bucket ranges used here. The `gpu` tests use the issue's
lengths in fp16 / bf16 with the 2x rule against an HF-style low-precision eager attention.
"""

import dataclasses

import pytest
import torch

from packedenc.errors import InputError
from packedenc.kernels import get_ops, reference
from packedenc.kernels.triton import deberta_attention as DA
from packedenc.kernels.triton import deberta_attention_bwd as DB
from packedenc.packing import longest_first
from tests.kernels._assert import DEVICE, assert_close_to_ref, cu_seqlens, err, other_rows

hf = pytest.importorskip("transformers.models.deberta_v2.modeling_deberta_v2")

# A length-1 sequence, one of exactly one tile, one just past it, one of 4 tiles; all longer than
# the bucket ranges below, so the log buckets and both clamps are reached.
LENGTHS = (1, 50, 17, 16, 3)
H, K = 2, 32


@pytest.fixture(autouse=True)
def _small_tiles(request, monkeypatch):
    if request.node.get_closest_marker("gpu") is None:  # gpu tests use the shipped tile sizes
        monkeypatch.setattr(DA, "BLOCK_MAX", 16)
        monkeypatch.setattr(DB, "BLOCK_MAX_BWD", 16)


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
    assert torch.equal(DA.table_slots(d.to(DEVICE), buckets, max_pos, 2 * span).cpu().long(), want)


@pytest.mark.parametrize("buckets, max_pos", [(256, 512), (8, 16), (256, 2048)])
def test_unclamped_buckets_through_the_kernel_lookup_equal_hf(buckets, max_pos):
    """With a table wider than any bucket the slot minus R/2 is the raw bucket: HF's exactly at every
    |d| <= 8192, including the float near-ties 511, 1471, 2650, 7464 of (256, 512)."""
    d = torch.arange(-8192, 8193)
    R = 4096
    got = DA.table_slots(d.to(DEVICE), buckets, max_pos, R).cpu().long() - R // 2
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
    o, lse = DA.deberta_attention_fwd(q, k, v, cu, max(LENGTHS), pk, pq, buckets, max_pos, 0.2)
    ref = _ref(q, k, v, cu, max(LENGTHS), pk, pq, types, buckets, max_pos, 0.2)
    assert o.is_contiguous() and o.shape == q.shape
    assert err(o, ref) <= 2e-6, err(o, ref)
    assert err(lse, DB.reference_lse(q, k, cu, max(LENGTHS), pk, pq, buckets, max_pos, 0.2)) <= 1e-5


@pytest.mark.parametrize("name", ["both_separate", "c2p_odd"])
def test_forward_fp16_two_x_rule(name):
    types, buckets, max_pos, same = FWD_CASES[name]
    q, k, v, cu, pk, pq = _inputs(LENGTHS, types, buckets, max_pos, torch.float16)
    o, _ = DA.deberta_attention_fwd(q, k, v, cu, max(LENGTHS), pk, pq, buckets, max_pos, 0.2)
    ref32 = _ref(*_f32(q, k, v), cu, max(LENGTHS), *_f32(pk, pq), types, buckets, max_pos, 0.2)
    ref16 = _ref(q, k, v, cu, max(LENGTHS), pk, pq, types, buckets, max_pos, 0.2)
    assert_close_to_ref(o, ref32, ref16, atol=2e-3, what=name)


def _wide_tiles(monkeypatch):
    """Route the forward through the wide kernel at (32, 16) tiles (16-row narrow tiles patched in);
    returns the list its launcher appends to, one entry per launch."""
    launch, calls = DA._launch_wide, []
    monkeypatch.setattr(DA, "WIDE_TILES", True)
    monkeypatch.setattr(DA, "WIDE_M", 32)
    monkeypatch.setattr(DA, "WIDE_N", 16)
    monkeypatch.setattr(DA, "_launch_wide", lambda *a: calls.append(1) or launch(*a))
    return calls


@pytest.mark.parametrize("wide", [False, True])
def test_forward_strided_qkv_views_head_dim_tail_loose_max_seqlen_and_chunked_grid(wide, monkeypatch):
    """q/k/v as slices of a fused (T, 3, H, K) qkv, a head dim (24) below its 32-wide block, a
    max_seqlen above the longest sequence (extra query blocks exit early), and the sequences
    launched two per grid (as packs of more than 65535 sequences are); 32-row and wide tiles."""
    calls = _wide_tiles(monkeypatch) if wide else []
    monkeypatch.setattr(DA, "MAX_GRID_Z", 2)
    lengths, types = (7, 1, 40), ("c2p", "p2c")
    T = sum(lengths)
    qkv = torch.randn(T, 3, 3, 24).to(DEVICE)
    pk, pq = torch.randn(16, 3, 24).to(DEVICE), torch.randn(16, 3, 24).to(DEVICE)
    cu = cu_seqlens(lengths)
    q, k, v = qkv.unbind(1)
    o, _ = DA.deberta_attention_fwd(q, k, v, cu, 64, pk, pq, 8, 16, 0.3)
    assert err(o, _ref(q, k, v, cu, 40, pk, pq, types, 8, 16, 0.3)) <= 2e-6
    assert len(calls) == wide


@pytest.mark.parametrize("wide", [False, True])
def test_isolation_and_determinism(wide, monkeypatch):
    calls = _wide_tiles(monkeypatch) if wide else []
    types, buckets, max_pos = ("c2p", "p2c"), 4, 6
    q, k, v, cu, pk, pq = _inputs(LENGTHS, types, buckets, max_pos)
    L = max(LENGTHS)
    o, _ = DA.deberta_attention_fwd(q, k, v, cu, L, pk, pq, buckets, max_pos, 0.2)
    assert torch.equal(o, DA.deberta_attention_fwd(q, k, v, cu, L, pk, pq, buckets, max_pos, 0.2)[0])
    other = other_rows(LENGTHS, 1)  # every token not in the 50-token sequence
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    k2[other] *= 7
    v2[other] += 3
    q2[other] *= 0.5
    o2, _ = DA.deberta_attention_fwd(q2, k2, v2, cu, L, pk, pq, buckets, max_pos, 0.2)
    assert torch.equal(o2[~other], o[~other]) and not torch.allclose(o2[other], o[other])
    assert len(calls) == 3 * wide


@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("chunked", [False, True])
def test_sequence_order_changes_nothing(wide, chunked, monkeypatch):
    """Programs taking the sequences longest first (or in any permutation) give the same bits; a
    pack launched in chunks (> MAX_GRID_Z sequences) ignores the order."""
    calls = _wide_tiles(monkeypatch) if wide else []
    if chunked:
        monkeypatch.setattr(DA, "MAX_GRID_Z", 2)
    types, buckets, max_pos = ("c2p", "p2c"), 4, 6
    q, k, v, cu, pk, pq = _inputs(LENGTHS, types, buckets, max_pos)
    L = max(LENGTHS)
    o, lse = DA.deberta_attention_fwd(q, k, v, cu, L, pk, pq, buckets, max_pos, 0.2)
    order = longest_first(cu)
    assert order.tolist() == [1, 2, 3, 4, 0]  # lengths (1, 50, 17, 16, 3)
    for perm in (order, torch.tensor([3, 0, 4, 2, 1], dtype=torch.int32)):
        o2, lse2 = DA.deberta_attention_fwd(q, k, v, cu, L, pk, pq, buckets, max_pos, 0.2, seq_order=perm.to(DEVICE))
        assert torch.equal(o2, o) and torch.equal(lse2, lse)
    assert len(calls) == 3 * wide


def test_sequence_order_is_checked():
    """A seq_order of the wrong dtype, shape or device, or (on the CPU) not a permutation, is an
    InputError naming the fix, in the kernel's Ops entry and in the reference."""
    types, buckets, max_pos = ("c2p", "p2c"), 4, 6
    q, k, v, cu, pk, pq = _inputs(LENGTHS, types, buckets, max_pos, device="cpu")
    kw = dict(pos_att_type=types, position_buckets=buckets, max_relative_positions=max_pos, scale=0.2)
    want = reference.deberta_attention(q, k, v, cu, 50, pk, pq, **kw)
    for fn in (DA.deberta_attention, reference.deberta_attention):
        got = fn(q, k, v, cu, 50, pk, pq, seq_order=longest_first(cu), **kw)
        assert torch.equal(got, want)
        for bad, msg in ((longest_first(cu).long(), "int32"), (torch.arange(4, dtype=torch.int32), r"\(5,\)"),
                         (torch.tensor([0, 0, 1, 2, 3], dtype=torch.int32), "exactly once"),
                         ([1, 2, 3, 4, 0], "int32")):
            with pytest.raises(InputError, match=msg):
                fn(q, k, v, cu, 50, pk, pq, seq_order=bad, **kw)


# ---- backward ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["both_separate", "c2p_odd", "p2c_plain", "content_only"])
def test_reference_bwd_equals_autograd_of_the_reference(name):
    types, buckets, max_pos, _ = FWD_CASES[name]
    q, k, v, cu, pk, pq = _inputs(LENGTHS, types, buckets, max_pos, device="cpu")
    leaves = [t.requires_grad_() for t in (q, k, v, pk, pq) if t is not None]
    out = _ref(q, k, v, cu, max(LENGTHS), pk, pq, types, buckets, max_pos, 0.2)
    do = torch.randn_like(out)
    want = torch.autograd.grad(out, leaves, do)
    got = [g for g in DB.reference_bwd(do, *(t.detach() for t in (q, k, v)), cu, max(LENGTHS),
                                       *(None if t is None else t.detach() for t in (pk, pq)),
                                       buckets, max_pos, 0.2) if g is not None]
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert err(a, b) <= 1e-5 * max(1.0, b.abs().max().item())


@pytest.mark.parametrize("one_pass", [False, True])
@pytest.mark.parametrize("name", ["both_separate", "both_shared", "c2p_odd", "p2c_plain", "v3_all_band"])
def test_backward_kernels_match_reference(name, one_pass, monkeypatch):
    monkeypatch.setattr(DB, "ONE_PASS", one_pass)
    # v3_all_band: DeBERTa-v3's buckets, so every tile of the 50-token sequence is a band tile and
    # the dPK / dPQ half-window carry runs over 4 consecutive tiles each way.
    types, buckets, max_pos, same = FWD_CASES.get(name) or (("c2p", "p2c"), 256, 512, False)
    q, k, v, cu, pk, pq = _inputs(LENGTHS, types, buckets, max_pos, same_table=same)
    L = max(LENGTHS)
    o, lse = DA.deberta_attention_fwd(q, k, v, cu, L, pk, pq, buckets, max_pos, 0.2)
    do = torch.randn_like(o)
    got = DB.deberta_attention_bwd(do, q, k, v, o, lse, cu, L, pk, pq, buckets, max_pos, 0.2)
    want = DB.reference_bwd(do, q, k, v, cu, L, pk, pq, buckets, max_pos, 0.2)
    for what, a, b in zip(("dq", "dk", "dv", "dpk", "dpq"), got, want):
        assert (a is None) == (b is None), what
        if a is not None:
            assert err(a, b) <= 1e-5 * max(1.0, b.abs().max().item()), (what, err(a, b))
    # dk, dv are atomics-free: bitwise reproducible (dq too, except in the one-pass kernel)
    again = DB.deberta_attention_bwd(do, q, k, v, o, lse, cu, L, pk, pq, buckets, max_pos, 0.2)
    assert all(torch.equal(a, b) for a, b in zip(got[1 if one_pass else 0:3], again[1 if one_pass else 0:3]))


@pytest.mark.parametrize("one_pass", [False, True])
def test_backward_fp16_two_x_rule(one_pass, monkeypatch):
    monkeypatch.setattr(DB, "ONE_PASS", one_pass)
    monkeypatch.setattr(DA, "MAX_GRID_Z", 2)  # 5 sequences in 3 launches
    types, buckets, max_pos = ("c2p", "p2c"), 4, 6
    q, k, v, cu, pk, pq = _inputs(LENGTHS, types, buckets, max_pos, torch.float16)
    L = max(LENGTHS)
    o, lse = DA.deberta_attention_fwd(q, k, v, cu, L, pk, pq, buckets, max_pos, 0.2)
    do = torch.randn_like(o)
    got = DB.deberta_attention_bwd(do, q, k, v, o, lse, cu, L, pk, pq, buckets, max_pos, 0.2)
    want32 = DB.reference_bwd(*_f32(do, q, k, v), cu, L, *_f32(pk, pq), buckets, max_pos, 0.2)
    want16 = DB.reference_bwd(do, q, k, v, cu, L, pk, pq, buckets, max_pos, 0.2)
    for what, a, b, c in zip(("dq", "dk", "dv", "dpk", "dpq"), got, want32, want16):
        assert_close_to_ref(a, b, c, atol=5e-3, what=what)


# ---- the registered op, autograd, compile, and the model through the kernel -------------------


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
    got = torch.autograd.grad((DA.deberta_attention(q, k, v, cu, 5, pk, pq, **kw) * w).sum(), leaves)
    want = torch.autograd.grad((reference.deberta_attention(q, k, v, cu, 5, pk, pq, **kw) * w).sum(), leaves)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    f = lambda q, k, v: DA.deberta_attention(q, k, v, cu, 5, pk, pq, **kw)  # noqa: E731
    q, k, v = q.detach(), k.detach(), v.detach()
    torch.testing.assert_close(torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v), f(q, k, v))


def _kernel_ops():
    """The reference table with deberta_attention bound to the (interpreted) Triton launcher."""

    def attn(q, k, v, cu, L, pk=None, pq=None, *, pos_att_type=(), position_buckets=-1,
             max_relative_positions=-1, scale, seq_order=None):
        return DA.deberta_attention_fwd(q, k, v, cu, L, pk, pq, position_buckets, max_relative_positions, scale,
                                        seq_order=seq_order)[0]

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


_SM90_COMPILE = r'''
import os, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from packedenc.kernels.triton import deberta_attention as DA, deberta_attention_bwd as DB
p = "*bf16"
ptrs = dict(Q=p, K=p, V=p, PK=p, PQ=p, SLOT="*i32", CU="*i32", ORDER="*i32", O=p, LSE="*fp32", DO=p, DELTA="*fp32",
            DQ=p, DPK="*fp32", DK=p, DV=p, DPQ="*fp32")
from packedenc.kernels.triton import deberta_bwd_onepass as OP
fwd = dict(STORE_LSE=True, NS=2 * DA.BLOCK_MAX, C2P_REUSE=False)
for fn, extra in ((DA._fwd_kernel, dict(fwd, COMPACT_W=0)), (DA._fwd_kernel, dict(fwd, COMPACT_W=DA.BLOCK_MAX // 2)),
                  (DA._fwd_kernel, dict(fwd, COMPACT_W=0) | dict(C2P_REUSE=True)),
                  (DB._bwd_dq_kernel, {}), (DB._bwd_dkdv_kernel, {}), (OP._bwd_onepass_kernel, {})):
    consts = dict(HEAD_DIM=64, BLOCK_K=64, BLOCK=DA.BLOCK_MAX, C2P=True, P2C=True, PREC="tf32",
                  LOWP=DA.LOWP_GATHER, **extra)
    kinds = dict(ptrs, DQ="*fp32") if fn is OP._bwd_onepass_kernel else ptrs  # its dq is an fp32 sum
    sig = {a: "constexpr" if a in consts else kinds.get(a, "fp32" if a in ("qk_scale", "scale") else "i32")
           for a in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
             if sig[a].startswith("*") or (a.startswith("s_") and a != "s_lse_t")}
    k = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                       options=DA.launch_config(DA.BLOCK_MAX))
    assert "cubin" in k.asm, fn.__name__
from packedenc.kernels.triton import deberta_fwd_wide as W
fn = W._fwd_wide_kernel
for p2c_wide, pos_lowp, order in ((True, False, False), (False, False, False), (True, True, True)):  # as `_launch_wide`
    consts = dict(HEAD_DIM=64, BLOCK_K=64, BLOCK_M=DA.WIDE_M, BLOCK_N=DA.WIDE_N, NS=DA.WIDE_NS, C2P=True,
                  P2C=True, STORE_LSE=True, PREC="tf32", LOWP=DA.LOWP_GATHER, P2C_WIDE=p2c_wide, POS_LOWP=pos_lowp,
                  HAS_ORDER=order)
    sig = {a: "constexpr" if a in consts else ptrs.get(a, "fp32" if a == "qk_scale" else "i32") for a in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
             if sig[a].startswith("*") or (a.startswith("s_") and a != "s_lse_t")}
    k = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=DA.WIDE_WARPS, num_stages=DA.WIDE_STAGES, maxnreg=DA.WIDE_MAXNREG))
    assert "cubin" in k.asm and "wgmma" in k.asm["ptx"], fn.__name__
print("compiled")
'''


@pytest.mark.skipif(torch.cuda.is_available(), reason="the gpu tests compile the kernels for real")
def test_kernels_compile_for_sm90_without_a_gpu():
    """The interpreter never lowers tl.gather / tl.dot layouts: compile the forward (32-row tiles as
    shipped, with the compact band, with the c2p reuse; the wide tiles, whose GEMMs must lower to
    wgmma) and the backward kernels for an H100/H200 (bf16, K = 64, the shipped tile)
    ahead of time, no driver needed."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    r = subprocess.run([sys.executable, "-c", _SM90_COMPILE], capture_output=True, text=True, env=env, timeout=600)
    if r.returncode and ("ptxas" in r.stderr and "not found" in r.stderr.lower()):
        pytest.skip("this Triton wheel ships no ptxas")
    assert r.returncode == 0 and "compiled" in r.stdout, r.stderr[-3000:]


@pytest.mark.parametrize("one_pass, types, alerts", [(True, ("c2p", "p2c"), True), (True, (), True),
                                                      (False, ("c2p",), True), (False, (), False)])
def test_backward_is_flagged_under_deterministic_mode(one_pass, types, alerts, monkeypatch):
    """Paths that sum with atomics (the table gradients; dq in the one-pass kernel) raise under
    torch.use_deterministic_algorithms(True) and warn with warn_only, as torch's own atomic kernels
    do; the atomics-free path (pair, no tables) runs."""
    monkeypatch.setattr(DB, "ONE_PASS", one_pass)
    q, k, v, cu, pk, pq = _inputs([5, 3], types, 4, 6)
    o, lse = DA.deberta_attention_fwd(q, k, v, cu, 5, pk, pq, 4, 6, 0.2)
    run = lambda: DB.deberta_attention_bwd(torch.ones_like(o), q, k, v, o, lse, cu, 5, pk, pq, 4, 6, 0.2)  # noqa: E731
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        if alerts:
            with pytest.raises(RuntimeError, match="packedenc DeBERTa attention backward"):
                run()
            torch.use_deterministic_algorithms(True, warn_only=True)
            with pytest.warns(UserWarning, match="not deterministic"):
                run()
        else:
            run()
    finally:
        torch.use_deterministic_algorithms(was)


def test_register_caps_reach_the_launches(monkeypatch):
    """`MAXNREG` / `MAXNREG_ONEPASS` / `MAXNREG_BWD` become Triton's `maxnreg` launch option (the
    interpreter ignores it, so results equal the reference); unset, no option is passed. The forward's
    cap applies to the timed shape only: 4 warps, head_dim <= 64."""
    monkeypatch.setattr(DA, "MAXNREG", None)
    assert "maxnreg" not in DA.launch_config(32)
    monkeypatch.setattr(DA, "MAXNREG", 128)
    assert DA.launch_config(32)["maxnreg"] == 128
    assert "maxnreg" not in DA.launch_config(32, head_dim=128)  # 8 warps
    for one_pass in (True, False):
        monkeypatch.setattr(DB, "ONE_PASS", one_pass)
        monkeypatch.setattr(DB, "MAXNREG_ONEPASS" if one_pass else "MAXNREG_BWD", 168)
        q, k, v, cu, pk, pq = _inputs([5, 3], ("c2p", "p2c"), 4, 6)
        o, lse = DA.deberta_attention_fwd(q, k, v, cu, 5, pk, pq, 4, 6, 0.2)
        got = DB.deberta_attention_bwd(torch.ones_like(o), q, k, v, o, lse, cu, 5, pk, pq, 4, 6, 0.2)
        want = DB.reference_bwd(torch.ones_like(o), q, k, v, cu, 5, pk, pq, 4, 6, 0.2)
        for a, b in zip(got, want):
            assert err(a, b) <= 1e-5 * max(1.0, b.abs().max().item())


@pytest.mark.parametrize("types", [("c2p", "p2c"), ("c2p",), ("p2c",)])
def test_compact_band_matches_reference(types, monkeypatch):
    """`COMPACT_BAND`: far tiles whose distances share < 16 slots take `_compact_scores` (band GEMMs
    over those slots, gathered by slot). 32-row tiles and wide log buckets (8 buckets up to 64), so
    a 100-token sequence has such tiles next to full band and saturated ones."""
    from packedenc.kernels.reference.deberta import log_bucket_position

    monkeypatch.setattr(DA, "BLOCK_MAX", 32)
    monkeypatch.setattr(DA, "COMPACT_BAND", True)
    monkeypatch.setattr(DA, "C2P_REUSE", False)  # else c2p takes the carried half band, not the compact one
    buckets, max_pos, lengths = 8, 64, [100, 40]
    d0 = torch.arange(-3, 4)[:, None] * 32 - 31  # every tile's smallest distance
    span = log_bucket_position(d0 + 62, buckets, max_pos) - log_bucket_position(d0, buckets, max_pos)
    assert ((span > 0) & (span < DA.compact_width(32))).any()  # the compact path is taken
    q, k, v, cu, pk, pq = _inputs(lengths, types, buckets, max_pos)
    o, lse = DA.deberta_attention_fwd(q, k, v, cu, max(lengths), pk, pq, buckets, max_pos, 0.2)
    ref = _ref(q, k, v, cu, max(lengths), pk, pq, types, buckets, max_pos, 0.2)
    assert err(o, ref) <= 2e-6, err(o, ref)
    assert err(lse, DB.reference_lse(q, k, cu, max(lengths), pk, pq, buckets, max_pos, 0.2)) <= 1e-5


@pytest.mark.parametrize("types", [("c2p", "p2c"), ("c2p",), ("p2c",)])
@pytest.mark.parametrize("block", [16, 32])
@pytest.mark.parametrize("reuse", [True, False])
def test_c2p_reuse_matches_reference(types, block, reuse, monkeypatch):
    """`C2P_REUSE` (ships on): each band tile computes c2p over BLOCK fresh slot rows and carries the
    other BLOCK from the previous key tile; off, it computes the whole band per tile. Sequences of
    1, 17, 100 and 40 tokens with a bucket range (8 buckets up to 64) that gives band tiles in runs
    of several (carries), single band tiles, and rank-1 / saturated tiles around them; fp32, fp16."""
    monkeypatch.setattr(DA, "BLOCK_MAX", block)
    monkeypatch.setattr(DA, "C2P_REUSE", reuse)
    buckets, max_pos, lengths = 8, 64, [1, 17, 100, 40]
    for dtype, tol in ((torch.float32, 2e-6), (torch.float16, 2e-3)):
        q, k, v, cu, pk, pq = _inputs(lengths, types, buckets, max_pos, dtype=dtype)
        o, lse = DA.deberta_attention_fwd(q, k, v, cu, max(lengths), pk, pq, buckets, max_pos, 0.2)
        ref = _ref(*_f32(q, k, v), cu, max(lengths), *_f32(pk, pq), types, buckets, max_pos, 0.2)
        assert err(o.float(), ref) <= tol, (dtype, err(o.float(), ref))
        want_lse = DB.reference_lse(*_f32(q, k), cu, max(lengths), *_f32(pk, pq), buckets, max_pos, 0.2)
        assert err(lse, want_lse) <= 50 * tol, (dtype, err(lse, want_lse))


@pytest.mark.parametrize("types", [("c2p", "p2c"), ("c2p",), ("p2c",)])
@pytest.mark.parametrize("p2c_wide, pos_lowp", [(True, False), (False, False), (True, True)])
def test_wide_tiles_match_reference(types, p2c_wide, pos_lowp, monkeypatch):
    """The wide forward (`deberta_fwd_wide.py`: 2N query rows per N-key band tile, c2p in three N-wide
    chunks of which two are carried, p2c in two 2N-row or three N-row chunks) at (32, 16) tiles:
    sequences of 1, 17, 100 and 40 tokens with 8 buckets up to 64 give runs of band tiles, single
    ones and saturated ranges around them; then the shipped (64, 32) tiles with DeBERTa-v3's buckets
    on sequences of 70 and 130 tokens (all band). fp32 and fp16, output and lse. `WIDE_POS_LOWP`
    rounds c2p + p2c to fp16 once more before they join q @ k^T (fp16 inputs only; HF's eager sums
    them in fp16 as well): twice the fp16 tolerance."""
    calls = _wide_tiles(monkeypatch)
    monkeypatch.setattr(DA, "WIDE_P2C", p2c_wide)
    monkeypatch.setattr(DA, "WIDE_POS_LOWP", pos_lowp)
    for block, (wm, wn), lengths, buckets, max_pos in ((16, (32, 16), [1, 17, 100, 40], 8, 64),
                                                       (32, (64, 32), [70, 130], 256, 512)):
        monkeypatch.setattr(DA, "BLOCK_MAX", block)
        monkeypatch.setattr(DA, "WIDE_M", wm)
        monkeypatch.setattr(DA, "WIDE_N", wn)
        calls.clear()
        for dtype, tol in ((torch.float32, 2e-6), (torch.float16, 4e-3 if pos_lowp else 2e-3)):
            q, k, v, cu, pk, pq = _inputs(lengths, types, buckets, max_pos, dtype=dtype)
            o, lse = DA.deberta_attention_fwd(q, k, v, cu, max(lengths), pk, pq, buckets, max_pos, 0.2)
            ref = _ref(*_f32(q, k, v), cu, max(lengths), *_f32(pk, pq), types, buckets, max_pos, 0.2)
            assert err(o.float(), ref) <= tol, (block, dtype, err(o.float(), ref))
            want_lse = DB.reference_lse(*_f32(q, k), cu, max(lengths), *_f32(pk, pq), buckets, max_pos, 0.2)
            assert err(lse, want_lse) <= 50 * tol, (block, dtype, err(lse, want_lse))
        assert len(calls) == 2  # both dtypes took the wide kernel
