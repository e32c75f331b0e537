"""DeBERTa disentangled attention on the GPU (`-m gpu`): the kernels against the reference at the
issue's lengths (1 .. 8192), every position-term subset, the one-pass backward in fp16 / bf16 against
the fp32 reference and HF-style eager low precision, chunked launches, the shipped launch options,
the op in a CUDA graph, and the whole encoder. The CPU tests (interpreter) are in
test_deberta_attention.py and test_deberta_attention_bwd.py.
"""

import dataclasses
import math

import pytest
import torch

from packedenc.kernels import get_ops, reference
from packedenc.kernels.triton.deberta import TILES, DebertaTiles, deberta_attention
from packedenc.kernels.triton.deberta import backward as B, forward as F, forward_wide as W
from tests.kernels._assert import assert_close_to_ref, other_rows
from tests.kernels.test_deberta_attention import FWD_CASES, _f32, _inputs, _ref, launches


GPU_LENGTHS = (1, 2, 127, 128, 129, 255, 256, 257, 511, 512, 513, 2048, 8192)
V3 = dict(buckets=256, max_pos=512)


def _eager_lowp(q, k, v, cu, pk, pq, buckets, max_pos, scale):
    """HF eager in low precision, one sequence at a time: the three score terms as half GEMM outputs
    (scaled in half), summed in half, fp32 softmax rounded to half, half P @ V."""
    out = torch.empty_like(q)
    for s in range(cu.numel() - 1):
        a, e = int(cu[s]), int(cu[s + 1])
        qs, ks, vs = (t[a:e].transpose(0, 1) for t in (q, k, v))  # (H, L, K)
        sc = qs @ (ks.transpose(-1, -2) * scale)
        if pk is not None or pq is not None:
            R = (pk if pk is not None else pq).shape[0]
            slot = torch.clamp(reference.relative_positions(e - a, buckets, max_pos, q.device) + R // 2, 0, R - 1)
            idx = slot.expand(qs.shape[0], -1, -1)
            if pk is not None:
                sc = sc + torch.gather(qs @ pk.permute(1, 2, 0), -1, idx) * scale
            if pq is not None:
                sc = sc + torch.gather(ks @ pq.permute(1, 2, 0), -1, idx.transpose(-1, -2)).transpose(-1, -2) * scale
        out[a:e] = (torch.softmax(sc.float(), -1).to(q.dtype) @ vs).transpose(0, 1)
    return out


def _ref_per_seq(q, k, v, cu, pk, pq, types, buckets, max_pos, scale):
    """The fp32 reference one sequence at a time (its padded grid would be S x L^2)."""
    out = torch.empty_like(q)
    for s in range(cu.numel() - 1):
        a, e = int(cu[s]), int(cu[s + 1])
        one = torch.tensor([0, e - a], dtype=torch.int32, device=q.device)
        out[a:e] = _ref(q[a:e], k[a:e], v[a:e], one, e - a, pk, pq, types, buckets, max_pos, scale)
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dim", [32, 64, 128])
def test_gpu_forward_issue_lengths(dtype, dim):
    types, scale = ("c2p", "p2c"), 1 / math.sqrt(dim * 3)
    q, k, v, cu, pk, pq = _inputs(GPU_LENGTHS, types, V3["buckets"], V3["max_pos"], dtype, device="cuda", heads=4,
                                  dim=dim)
    L = max(GPU_LENGTHS)
    kw = dict(pos_att_type=types, position_buckets=256, max_relative_positions=512, scale=scale)
    o = deberta_attention(q, k, v, cu, L, pk, pq, **kw)
    ref32 = _ref_per_seq(*_f32(q, k, v), cu, *_f32(pk, pq), types, 256, 512, scale)
    assert_close_to_ref(o, ref32, _eager_lowp(q, k, v, cu, pk, pq, 256, 512, scale), atol=1e-3,
                        what=f"{dtype} K={dim}")
    assert torch.equal(o, deberta_attention(q, k, v, cu, L, pk, pq, **kw))  # deterministic
    other = other_rows(GPU_LENGTHS, 11)  # everything but the 2048-token sequence
    k2, v2 = k.clone(), v.clone()
    k2[other] *= 5
    v2[other] += 1
    o2 = deberta_attention(q, k2, v2, cu, L, pk, pq, **kw)
    assert torch.equal(o[~other], o2[~other]) and not torch.equal(o[other], o2[other])


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(FWD_CASES))
# 16: 32-row kernel on 16-row tiles; 32: the shipped tiles (the wide kernel at K = 64). 64-row tiles
# do not compile with Triton 3.6 on sm_90 (TritonGPUPipeline fails), so block_max stays at 32.
@pytest.mark.parametrize("block_max", [16, 32])
def test_gpu_forward_every_term_subset(name, block_max):
    types, buckets, max_pos, same = FWD_CASES[name]
    lengths = (1, 2, 63, 64, 65, 300, 1000)
    q, k, v, cu, pk, pq = _inputs(lengths, types, buckets, max_pos, torch.bfloat16, same, "cuda", 4, 64)
    o = F.deberta_attention_fwd(q, k, v, cu, max(lengths), pk, pq, buckets, max_pos, 0.07,
                                tiles=DebertaTiles(block_max=block_max))[0]
    ref32 = _ref_per_seq(*_f32(q, k, v), cu, *_f32(pk, pq), types, buckets, max_pos, 0.07)
    assert_close_to_ref(o, ref32, _eager_lowp(q, k, v, cu, pk, pq, buckets, max_pos, 0.07), atol=1e-3, what=name)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 128])
def test_gpu_backward(dtype, dim):
    types, lengths, scale = ("c2p", "p2c"), (1, 63, 64, 65, 129, 700), 1 / math.sqrt(dim * 3)
    q, k, v, cu, pk, pq = _inputs(lengths, types, 256, 512, dtype, device="cuda", heads=4, dim=dim)
    L = max(lengths)
    do = torch.randn_like(q)

    def grads(f, cast):
        leaves = [t.detach().to(cast).requires_grad_() for t in (q, k, v, pk, pq)]
        return torch.autograd.grad(f(*leaves), leaves, do.to(cast))

    kw = dict(pos_att_type=types, position_buckets=256, max_relative_positions=512, scale=scale)
    got = grads(lambda q, k, v, pk, pq: deberta_attention(q, k, v, cu, L, pk, pq, **kw), dtype)
    lowp = grads(lambda q, k, v, pk, pq: _eager_lowp(q, k, v, cu, pk, pq, 256, 512, scale), dtype)
    f32 = grads(lambda q, k, v, pk, pq: reference.deberta_attention(q, k, v, cu, L, pk, pq, **kw), torch.float32)
    for what, a, b, c in zip(("dq", "dk", "dv", "dpk", "dpq"), got, lowp, f32):
        assert_close_to_ref(a, c, b, atol=1e-3, what=f"{what} {dtype} K={dim}")


@pytest.mark.gpu
def test_gpu_chunked_launches_equal_one_launch():
    """A pack launched a few sequences at a time (`max_grid_z`, as packs of more than 65535 sequences
    are) gives the one-launch forward's bits on the 32-row and the wide kernel, and its backward."""
    types, lengths = ("c2p", "p2c"), (1, 700, 5, 64, 33, 2)
    q, k, v, cu, pk, pq = _inputs(lengths, types, 256, 512, torch.bfloat16, device="cuda", heads=4, dim=64)
    for block_max in (16, 32):  # 16: the 32-row kernel; 32: the wide one
        one, chunked = DebertaTiles(block_max=block_max), DebertaTiles(block_max=block_max, max_grid_z=4)
        o, lse = F.deberta_attention_fwd(q, k, v, cu, 700, pk, pq, 256, 512, 0.07, tiles=one)
        o2, lse2 = F.deberta_attention_fwd(q, k, v, cu, 700, pk, pq, 256, 512, 0.07, tiles=chunked)
        assert torch.equal(o, o2) and torch.equal(lse, lse2), block_max
    do = torch.randn_like(q)
    g = B.deberta_attention_bwd(do, q, k, v, o, lse, cu, 700, pk, pq, 256, 512, 0.07)
    g2 = B.deberta_attention_bwd(do, q, k, v, o, lse, cu, 700, pk, pq, 256, 512, 0.07,
                                 tiles=DebertaTiles(max_grid_z=4))
    assert torch.equal(g[1], g2[1]) and torch.equal(g[2], g2[2])  # dk, dv: no atomics
    for a, b in zip(g, g2):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)  # dq, dpk, dpq: atomic sums, any order


@pytest.mark.gpu
def test_gpu_launchers_pass_the_shipped_options():
    """The compiled launches get `TILES`' warps, stages and register caps: the 32-row forward (a
    batch of <= 32 tokens), the wide forward and the one-pass backward (bf16, K = 64)."""
    types = ("c2p", "p2c")
    for L, kernel, want in ((20, F._fwd_kernel, TILES.fwd_options(32, 64)),
                            (300, W._fwd_wide_kernel, TILES.wide_options())):
        q, k, v, cu, pk, pq = _inputs((L, 3), types, 256, 512, torch.bfloat16, device="cuda", heads=4, dim=64)
        with launches(kernel) as seen:
            o, lse = F.deberta_attention_fwd(q, k, v, cu, L, pk, pq, 256, 512, 0.07)
        assert len(seen) == 1 and {x: seen[0].get(x) for x in ("num_warps", "num_stages", "maxnreg")} == \
            {"num_warps": want["num_warps"], "num_stages": want["num_stages"], "maxnreg": want.get("maxnreg")}, L
    with launches(B._bwd_onepass_kernel) as seen:
        B.deberta_attention_bwd(torch.ones_like(q), q, k, v, o, lse, cu, 300, pk, pq, 256, 512, 0.07)
    want = TILES.bwd_options(32, 64)
    assert len(seen) == 1 and (seen[0].get("num_warps"), seen[0].get("num_stages"), seen[0].get("maxnreg")) == \
        (want["num_warps"], want["num_stages"], want.get("maxnreg"))


@pytest.mark.gpu
def test_gpu_auto_picks_the_kernel_and_replays_in_a_cuda_graph():
    ops = get_ops("auto", "cuda")
    assert dict(ops.chosen)["deberta_attention"] == "triton"
    types = ("c2p", "p2c")
    q, k, v, cu, pk, pq = _inputs((5, 300, 1), types, 256, 512, torch.bfloat16, device="cuda", heads=4, dim=64)
    kw = dict(pos_att_type=types, position_buckets=256, max_relative_positions=512, scale=0.07)
    eager = ops.deberta_attention(q, k, v, cu, 300, pk, pq, **kw)  # warm-up: compiles, caches the table
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.deberta_attention(q, k, v, cu, 300, pk, pq, **kw)
    graph.replay()
    assert torch.equal(out, eager)
    f = lambda q: ops.deberta_attention(q, k, v, cu, 300, pk, pq, **kw)  # noqa: E731
    # compiled: the registered op (same kernel with the LSE output switched on)
    torch.testing.assert_close(torch.compile(f, fullgraph=True)(q), eager, rtol=1e-3, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_encode_matches_the_fp32_reference(dtype):
    """DeBERTa-v3-shaped layers (K = 64, buckets 256 / 512) on the auto backend vs fp32 reference."""
    import packedenc as pe
    from packedenc.models import deberta

    cfg = dataclasses.replace(deberta.PRESETS["v3-base"], num_hidden_layers=2, hidden_size=256,
                              num_attention_heads=4, intermediate_size=512, vocab_size=1000)
    params = deberta.init(cfg, torch.Generator().manual_seed(0))
    params = torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t + 0.05 * torch.randn_like(t), params)
    lengths = (1, 2, 37, 128, 129, 600, 1500)
    b = pe.pack([torch.randint(3, 1000, (n,)) for n in lengths], device="cuda")
    want = pe.encode(pe.tree_to(params, "cuda"), b.ids, b.cu_seqlens, b.max_seqlen, backend="reference")
    low = pe.tree_to(pe.tree_cast(params, dtype), "cuda")
    got = pe.encode(low, b.ids, b.cu_seqlens, b.max_seqlen, backend="auto")
    cos = torch.nn.functional.cosine_similarity(got.float(), want, dim=-1)
    assert cos.min() >= 0.999, cos.min()
