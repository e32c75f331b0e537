"""deberta_attention's backward (the one-pass Triton kernel) against the written-out reference gradient,
the deterministic-mode alert, and an ahead-of-time sm_90 compile of every shipped DeBERTa kernel.

Without a GPU the kernel runs under TRITON_INTERPRET=1 on the tiny ragged packs and 16-row tiles of
test_deberta_attention.py; the `gpu` tests are in test_deberta_attention_gpu.py.
"""

import dataclasses
import warnings

import pytest
import torch

from packedenc.kernels.reference import deberta as RD
from packedenc.kernels.triton.deberta import backward as B, forward as F
from tests.kernels._assert import assert_close_to_ref, err
from tests.kernels.test_deberta_attention import FWD_CASES, LENGTHS, SMALL, _f32, _inputs, launches


@pytest.mark.parametrize("name", ["both_separate", "both_shared", "c2p_odd", "p2c_plain", "content_only",
                                  "v3_all_band"])
def test_backward_kernel_matches_reference(name):
    # v3_all_band: DeBERTa-v3's buckets, so every tile of the 50-token sequence is a band tile and
    # the dPK / dPQ half-window carry runs over 4 consecutive tiles each way.
    types, buckets, max_pos, same = FWD_CASES.get(name) or (("c2p", "p2c"), 256, 512, False)
    q, k, v, cu, pk, pq = _inputs(LENGTHS, types, buckets, max_pos, same_table=same)
    L = max(LENGTHS)
    o, lse = F.deberta_attention_fwd(q, k, v, cu, L, pk, pq, buckets, max_pos, 0.2, tiles=SMALL)
    do = torch.randn_like(o)
    with launches(B._bwd_onepass_kernel) as seen:
        got = B.deberta_attention_bwd(do, q, k, v, o, lse, cu, L, pk, pq, buckets, max_pos, 0.2, tiles=SMALL)
    assert [s["BLOCK"] for s in seen] == [16]
    want = RD.deberta_attention_bwd(do, q, k, v, cu, L, pk, pq, buckets, max_pos, 0.2)
    for what, a, b in zip(("dq", "dk", "dv", "dpk", "dpq"), got, want):
        assert (a is None) == (b is None), what
        if a is not None:
            assert err(a, b) <= 1e-5 * max(1.0, b.abs().max().item()), (what, err(a, b))
    # dk, dv are atomics-free: bitwise reproducible (dq and the tables are fp32 atomic sums)
    again = B.deberta_attention_bwd(do, q, k, v, o, lse, cu, L, pk, pq, buckets, max_pos, 0.2, tiles=SMALL)
    assert torch.equal(got[1], again[1]) and torch.equal(got[2], again[2])


def test_backward_fp16_two_x_rule_in_chunked_launches():
    types, buckets, max_pos = ("c2p", "p2c"), 4, 6
    tiles = dataclasses.replace(SMALL, max_grid_z=2)  # 5 sequences in 3 launches
    q, k, v, cu, pk, pq = _inputs(LENGTHS, types, buckets, max_pos, torch.float16)
    L = max(LENGTHS)
    o, lse = F.deberta_attention_fwd(q, k, v, cu, L, pk, pq, buckets, max_pos, 0.2, tiles=tiles)
    do = torch.randn_like(o)
    with launches(B._bwd_onepass_kernel) as seen:
        got = B.deberta_attention_bwd(do, q, k, v, o, lse, cu, L, pk, pq, buckets, max_pos, 0.2, tiles=tiles)
    assert len(seen) == 3
    want32 = RD.deberta_attention_bwd(*_f32(do, q, k, v), cu, L, *_f32(pk, pq), buckets, max_pos, 0.2)
    want16 = RD.deberta_attention_bwd(do, q, k, v, cu, L, pk, pq, buckets, max_pos, 0.2)
    for what, a, b, c in zip(("dq", "dk", "dv", "dpk", "dpq"), got, want32, want16):
        assert_close_to_ref(a, b, c, atol=5e-3, what=what)


@pytest.mark.parametrize("types", [("c2p", "p2c"), ()])
def test_backward_is_flagged_under_deterministic_mode(types):
    """The backward sums dq (and the table gradients) with atomics: it raises under
    torch.use_deterministic_algorithms(True) and warns with warn_only, as torch's own atomic kernels
    do, with or without position tables; outside deterministic mode it runs without a warning."""
    q, k, v, cu, pk, pq = _inputs([5, 3], types, 4, 6)
    o, lse = F.deberta_attention_fwd(q, k, v, cu, 5, pk, pq, 4, 6, 0.2, tiles=SMALL)

    def run():
        return B.deberta_attention_bwd(torch.ones_like(o), q, k, v, o, lse, cu, 5, pk, pq, 4, 6, 0.2, tiles=SMALL)

    was = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        with pytest.raises(RuntimeError, match="packedenc DeBERTa attention backward .* not deterministic"):
            run()
        torch.use_deterministic_algorithms(True, warn_only=True)
        with pytest.warns(UserWarning, match="not deterministic"):
            run()
        torch.use_deterministic_algorithms(False)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            run()
    finally:
        torch.use_deterministic_algorithms(was)


_SM90_COMPILE = r'''
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from packedenc.kernels.triton.deberta import TILES, backward as B, forward as F, forward_wide as W
p = "*bf16"
ptrs = dict(Q=p, K=p, V=p, PK=p, PQ=p, SLOT="*i32", CU="*i32", ORDER="*i32", O=p, LSE="*fp32", DO=p, DELTA="*fp32",
            DQ="*fp32", DPK="*fp32", DK=p, DV=p, DPQ="*fp32")  # the one-pass kernel's dq is an fp32 sum
block = TILES.block_max
common = dict(HEAD_DIM=64, BLOCK_K=64, C2P=True, P2C=True, PREC="tf32", LOWP=True)
launches = (  # (kernel, constexprs, options) as the launchers pass them for DeBERTa-v3 in bf16
    (F._fwd_kernel, dict(common, BLOCK=block, NS=TILES.saturated_rows(block, 512), STORE_LSE=True),
     TILES.fwd_options(block, 64)),
    (W._fwd_wide_kernel, dict(common, BLOCK_M=TILES.wide_m, BLOCK_N=TILES.wide_n, NS=TILES.wide_ns,
                              STORE_LSE=True), TILES.wide_options()),
    (W._fwd_wide_kernel, dict(common, BLOCK_M=TILES.wide_m, BLOCK_N=TILES.wide_n, NS=TILES.wide_ns,
                              STORE_LSE=False, HAS_ORDER=True), TILES.wide_options()),
    (B._bwd_onepass_kernel, dict(common, BLOCK=block), TILES.bwd_options(block, 64)),
)
for fn, consts, options in launches:
    sig = {a: "constexpr" if a in consts else ptrs.get(a, "fp32" if a in ("qk_scale", "scale") else "i32")
           for a in fn.arg_names}
    for i, a in enumerate(fn.arg_names):
        if a not in consts and fn.params[i].is_constexpr:  # a defaulted constexpr
            sig[a], consts[a] = "constexpr", fn.params[i].default
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
             if sig[a].startswith("*") or (a.startswith("s_") and a != "s_lse_t")}
    k = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32), options=options)
    assert "cubin" in k.asm, fn.__name__
    assert fn is not W._fwd_wide_kernel or "wgmma" in k.asm["ptx"], "the wide tiles' GEMMs must be wgmma"
    assert k.metadata.num_warps == options["num_warps"] and k.metadata.num_stages == options["num_stages"]
    assert k.metadata.maxnreg == options.get("maxnreg"), (fn.__name__, k.metadata.maxnreg)
print("compiled")
'''


@pytest.mark.skipif(torch.cuda.is_available(), reason="the gpu tests compile the kernels for real")
def test_kernels_compile_for_sm90_without_a_gpu():
    """The interpreter never lowers tl.gather / tl.dot layouts: compile the shipped kernels (the
    32-row forward, the wide forward, whose GEMMs must lower to wgmma, and the one-pass backward) for
    an H100/H200 (bf16, K = 64, the shipped tiles and launch options) ahead of time, no driver needed."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    r = subprocess.run([sys.executable, "-c", _SM90_COMPILE], capture_output=True, text=True, env=env, timeout=600)
    if r.returncode and ("ptxas" in r.stderr and "not found" in r.stderr.lower()):
        pytest.skip("this Triton wheel ships no ptxas")
    assert r.returncode == 0 and "compiled" in r.stdout, r.stderr[-3000:]
