"""The DeBERTa reference ops (`deberta_attention`, `varlen_conv1d`, HF log buckets): the spec a
GPU kernel is tested against, checked here against transformers and a per-pair formula."""

import math

import pytest
import torch
import torch.nn.functional as F

from packedenc.kernels import reference as ref

hf = pytest.importorskip("transformers.models.deberta_v2.modeling_deberta_v2")


@pytest.mark.parametrize("buckets, max_pos", [(256, 512), (8, 16), (4, 10), (256, 1024), (7, 40)])
def test_log_buckets_equal_hf_up_to_8192(buckets, max_pos):
    d = torch.arange(-8192, 8193)
    ours = ref.log_bucket_position(d, buckets, max_pos)
    theirs = hf.make_log_bucket_position(d, buckets, max_pos)
    assert torch.equal(ours.long(), theirs.long())


def test_log_bucket_known_values_and_float_ties():
    # near-integers of the log formula (x / x * 127 at 511; 223.99983 at 1471, 277.99987 at 2650,
    # 373.00009 at 7464) land on the float64 side of the tie
    d = torch.tensor([128, 129, 200, 256, 383, 384, 505, 506, 511, 512, 1000, 1024, 1471, 2048, 2650, 4096, 7464, 8192])
    want = [128, 129, 169, 192, 229, 229, 254, 255, 255, 256, 317, 319, 224 + 128, 383, 278 + 128, 446, 374 + 128, 510]
    got = ref.log_bucket_position(d, 256, 512).long()
    assert got.tolist() == want
    assert torch.equal(ref.log_bucket_position(-d, 256, 512).long(), -got)  # odd symmetry


@pytest.mark.parametrize("L, buckets, max_pos", [(600, 256, 512), (50, 8, 16), (33, -1, 16)])
def test_relative_positions_equal_hf(L, buckets, max_pos):
    x = torch.zeros(1, L, 4)
    want = hf.build_relative_position(x, x, bucket_size=buckets, max_position=max_pos)[0]
    assert torch.equal(ref.relative_positions(L, buckets, max_pos), want)


def per_pair(q, k, v, cu, pk, pq, types, buckets, max_pos, scale):
    """logit[i, j] = scale * (q_i.k_j + q_i.PK[c(i, j)] + k_j.PQ[p(i, j)]) one pair at a time."""
    span = (pk if pk is not None else pq).shape[0] // 2 if types else 1
    out = torch.empty_like(q)
    r = (lambda d: ref.log_bucket_position(torch.tensor(d), buckets, max_pos).long().item()) if buckets > 0 else (lambda d: d)
    for s in range(cu.numel() - 1):
        a, b = int(cu[s]), int(cu[s + 1])
        for i in range(a, b):
            logits = torch.empty(b - a, q.shape[1])
            for j in range(a, b):
                x = (q[i] * k[j]).sum(-1)
                if "c2p" in types:
                    x = x + (q[i] * pk[min(max(r(i - j) + span, 0), 2 * span - 1)]).sum(-1)
                if "p2c" in types:
                    x = x + (k[j] * pq[min(max(-r(j - i) + span, 0), 2 * span - 1)]).sum(-1)
                logits[j - a] = x * scale
            out[i] = torch.einsum("jh,jhk->hk", logits.softmax(0), v[a:b])
    return out


@pytest.mark.parametrize("types, buckets, max_pos", [
    (("c2p", "p2c"), 4, 6),  # log buckets beyond |d| = 2, saturation beyond |d| = 5
    (("p2c",), -1, 3),  # raw distances clamped at +-3
    (("c2p",), 8, 16),
    ((), -1, 4),
])
def test_attention_matches_per_pair_formula(types, buckets, max_pos):
    g = torch.Generator().manual_seed(0)
    H, K = 2, 4
    cu = torch.tensor([0, 1, 9, 12, 25], dtype=torch.int32)
    T = int(cu[-1])
    q, k, v = (torch.randn(T, H, K, generator=g) for _ in range(3))
    span = buckets if buckets > 0 else max_pos
    pk = torch.randn(2 * span, H, K, generator=g) if "c2p" in types else None
    pq = torch.randn(2 * span, H, K, generator=g) if "p2c" in types else None
    scale = 1 / math.sqrt(K * 3)
    out = ref.deberta_attention(q, k, v, cu, 13, pk, pq, pos_att_type=types, position_buckets=buckets,
                                max_relative_positions=max_pos, scale=scale)
    want = per_pair(q, k, v, cu, pk, pq, types, buckets, max_pos, scale)
    assert (out - want).abs().max() <= 1e-5


def test_attention_isolation_and_determinism():
    """Changing another sequence's q/k/v leaves a sequence's output bit-identical."""
    g = torch.Generator().manual_seed(1)
    H, K, R = 2, 8, 16
    cu = torch.tensor([0, 5, 6, 30], dtype=torch.int32)
    q, k, v = (torch.randn(30, H, K, generator=g) for _ in range(3))
    pk, pq = torch.randn(R, H, K, generator=g), torch.randn(R, H, K, generator=g)
    kw = dict(pos_att_type=("c2p", "p2c"), position_buckets=8, max_relative_positions=12, scale=0.2)
    base = ref.deberta_attention(q, k, v, cu, 24, pk, pq, **kw)
    assert torch.equal(base, ref.deberta_attention(q, k, v, cu, 24, pk, pq, **kw))
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    for t in (q2, k2, v2):
        t[6:] *= 7.0
    other = ref.deberta_attention(q2, k2, v2, cu, 24, pk, pq, **kw)
    assert torch.equal(other[:6], base[:6]) and not torch.allclose(other[6:], base[6:])
    # a larger max_seqlen (more grid padding) changes nothing
    assert (ref.deberta_attention(q, k, v, cu, 40, pk, pq, **kw) - base).abs().max() <= 1e-6


def test_attention_gradients_flow():
    H, K, R = 2, 4, 8
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    q, k, v = (torch.randn(7, H, K, requires_grad=True) for _ in range(3))
    pk, pq = torch.randn(R, H, K, requires_grad=True), torch.randn(R, H, K, requires_grad=True)
    out = ref.deberta_attention(q, k, v, cu, 4, pk, pq, pos_att_type=("c2p", "p2c"), position_buckets=4,
                                max_relative_positions=8, scale=0.3)
    out.square().sum().backward()
    for t in (q, k, v, pk, pq):
        assert t.grad is not None and torch.isfinite(t.grad).all() and t.grad.abs().sum() > 0


@pytest.mark.parametrize("kernel, groups", [(3, 1), (5, 2), (1, 4)])
def test_varlen_conv1d_is_per_sequence_zero_padded(kernel, groups):
    g = torch.Generator().manual_seed(0)
    D = 8
    cu = torch.tensor([0, 1, 4, 11], dtype=torch.int32)
    x = torch.randn(11, D, generator=g)
    w, b = torch.randn(D, D // groups, kernel, generator=g), torch.randn(D, generator=g)
    out = ref.varlen_conv1d(x, w, b, cu, 7, groups)
    for s in range(3):
        a, e = int(cu[s]), int(cu[s + 1])
        want = F.conv1d(x[a:e].T[None], w, b, padding=(kernel - 1) // 2, groups=groups)[0].T
        assert (out[a:e] - want).abs().max() <= 1e-5
    x2 = x.clone()
    x2[4:] = 100.0  # the last sequence changes: the first two do not see it
    assert torch.equal(ref.varlen_conv1d(x2, w, b, cu, 7, groups)[:4], out[:4])
