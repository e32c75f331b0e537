"""DeBERTa disentangled attention on the GPU (`-m gpu`): the kernels against the reference at the
issue's lengths (1 .. 8192), every position-term subset, the backward (two-kernel and one-pass) in
fp16 / bf16 against the fp32 reference and HF-style eager low precision, the op in a CUDA graph, and
the whole encoder. The CPU tests (interpreter) are in test_deberta_attention.py.
"""

import dataclasses
import math

import pytest
import torch

from packedenc.kernels import get_ops, reference
from packedenc.kernels.triton import deberta_attention as DA
from packedenc.kernels.triton import deberta_attention_bwd as DB
from tests.kernels._assert import assert_close_to_ref, other_rows
from tests.kernels.test_deberta_attention import FWD_CASES, _f32, _inputs, _ref


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
    o = DA.deberta_attention(q, k, v, cu, L, pk, pq, **kw)
    ref32 = _ref_per_seq(*_f32(q, k, v), cu, *_f32(pk, pq), types, 256, 512, scale)
    assert_close_to_ref(o, ref32, _eager_lowp(q, k, v, cu, pk, pq, 256, 512, scale), atol=1e-3,
                        what=f"{dtype} K={dim}")
    assert torch.equal(o, DA.deberta_attention(q, k, v, cu, L, pk, pq, **kw))  # deterministic
    other = other_rows(GPU_LENGTHS, 11)  # everything but the 2048-token sequence
    k2, v2 = k.clone(), v.clone()
    k2[other] *= 5
    v2[other] += 1
    o2 = DA.deberta_attention(q, k2, v2, cu, L, pk, pq, **kw)
    assert torch.equal(o[~other], o2[~other]) and not torch.equal(o[other], o2[other])


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(FWD_CASES))
# 16: short batches; 32: the shipped tile. 64-row tiles do not compile with Triton 3.6 on sm_90
# (TritonGPUPipeline fails; seen on an H200, 2026-11-29), so BLOCK_MAX stays at 32.
@pytest.mark.parametrize("block_max", [16, 32])
def test_gpu_forward_every_term_subset(name, block_max, monkeypatch):
    monkeypatch.setattr(DA, "BLOCK_MAX", block_max)
    types, buckets, max_pos, same = FWD_CASES[name]
    lengths = (1, 2, 63, 64, 65, 300, 1000)
    q, k, v, cu, pk, pq = _inputs(lengths, types, buckets, max_pos, torch.bfloat16, same, "cuda", 4, 64)
    o = DA.deberta_attention_fwd(q, k, v, cu, max(lengths), pk, pq, buckets, max_pos, 0.07)[0]
    ref32 = _ref_per_seq(*_f32(q, k, v), cu, *_f32(pk, pq), types, buckets, max_pos, 0.07)
    assert_close_to_ref(o, ref32, _eager_lowp(q, k, v, cu, pk, pq, buckets, max_pos, 0.07), atol=1e-3, what=name)


@pytest.mark.gpu
@pytest.mark.parametrize("one_pass", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 128])
def test_gpu_backward(dtype, dim, one_pass, monkeypatch):
    monkeypatch.setattr(DB, "ONE_PASS", one_pass)
    types, lengths, scale = ("c2p", "p2c"), (1, 63, 64, 65, 129, 700), 1 / math.sqrt(dim * 3)
    q, k, v, cu, pk, pq = _inputs(lengths, types, 256, 512, dtype, device="cuda", heads=4, dim=dim)
    L = max(lengths)
    do = torch.randn_like(q)

    def grads(f, cast):
        leaves = [t.detach().to(cast).requires_grad_() for t in (q, k, v, pk, pq)]
        return torch.autograd.grad(f(*leaves), leaves, do.to(cast))

    kw = dict(pos_att_type=types, position_buckets=256, max_relative_positions=512, scale=scale)
    got = grads(lambda q, k, v, pk, pq: DA.deberta_attention(q, k, v, cu, L, pk, pq, **kw), dtype)
    lowp = grads(lambda q, k, v, pk, pq: _eager_lowp(q, k, v, cu, pk, pq, 256, 512, scale), dtype)
    f32 = grads(lambda q, k, v, pk, pq: reference.deberta_attention(q, k, v, cu, L, pk, pq, **kw), torch.float32)
    for what, a, b, c in zip(("dq", "dk", "dv", "dpk", "dpq"), got, lowp, f32):
        assert_close_to_ref(a, c, b, atol=1e-3, what=f"{what} {dtype} K={dim} one_pass={one_pass}")


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
