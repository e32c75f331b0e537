"""The DeBERTa reference ops (`deberta_attention`, `varlen_conv1d`, HF log buckets) and the attention's
written-out gradient and log-sum-exp (`reference.deberta`): the spec a GPU kernel is tested against,
checked here against transformers, a per-pair formula and autograd."""

import math

import pytest
import torch
import torch.nn.functional as F

from packedenc.kernels import reference as ref
from packedenc.kernels.reference import deberta as RD

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


def pair_logit(q, k, pk, pq, types, buckets, max_pos, i, j):
    """(H,) q_i.k_j + q_i.PK[c(i, j)] + k_j.PQ[p(i, j)] for one pair of tokens of a sequence."""
    span = (pk if pk is not None else pq).shape[0] // 2 if types else 1
    r = (lambda d: ref.log_bucket_position(torch.tensor(d), buckets, max_pos).long().item()) if buckets > 0 else (lambda d: d)
    x = (q[i] * k[j]).sum(-1)
    if "c2p" in types:
        x = x + (q[i] * pk[min(max(r(i - j) + span, 0), 2 * span - 1)]).sum(-1)
    if "p2c" in types:
        x = x + (k[j] * pq[min(max(-r(j - i) + span, 0), 2 * span - 1)]).sum(-1)
    return x


def per_pair(q, k, v, cu, pk, pq, types, buckets, max_pos, scale):
    """logit[i, j] = scale * (q_i.k_j + q_i.PK[c(i, j)] + k_j.PQ[p(i, j)]) one pair at a time."""
    out = torch.empty_like(q)
    for s in range(cu.numel() - 1):
        a, b = int(cu[s]), int(cu[s + 1])
        for i in range(a, b):
            logits = torch.stack([pair_logit(q, k, pk, pq, types, buckets, max_pos, i, j) for j in range(a, b)])
            out[i] = torch.einsum("jh,jhk->hk", (logits * scale).softmax(0), v[a:b])
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


def _attention_inputs(types, buckets, max_pos, lengths=(1, 50, 17, 16, 3), H=2, K=32):
    g = torch.Generator().manual_seed(2)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    q, k, v = (torch.randn(int(cu[-1]), H, K, generator=g) for _ in range(3))
    span = buckets if buckets > 0 else max_pos
    pk = torch.randn(2 * span, H, K, generator=g) if "c2p" in types else None
    pq = torch.randn(2 * span, H, K, generator=g) if "p2c" in types else None
    return q, k, v, cu, pk, pq


@pytest.mark.parametrize("types, buckets, max_pos", [
    (("c2p", "p2c"), 4, 6), (("c2p",), 7, 40), (("p2c",), -1, 3), ((), -1, 4),
])
def test_attention_bwd_equals_autograd_of_the_reference(types, buckets, max_pos):
    """`deberta_attention_bwd` (explicit formulas: the CPU backward op) against autograd through
    `deberta_attention`, every position-term subset, log buckets and plain clamped distances."""
    q, k, v, cu, pk, pq = _attention_inputs(types, buckets, max_pos)
    leaves = [t.requires_grad_() for t in (q, k, v, pk, pq) if t is not None]
    out = ref.deberta_attention(q, k, v, cu, 50, pk, pq, pos_att_type=types, position_buckets=buckets,
                                max_relative_positions=max_pos, scale=0.2)
    do = torch.randn_like(out)
    want = torch.autograd.grad(out, leaves, do)
    got = RD.deberta_attention_bwd(do, *(t.detach() for t in (q, k, v)), cu, 50,
                                   *(None if t is None else t.detach() for t in (pk, pq)), buckets, max_pos, 0.2)
    assert [g is None for g in got[3:]] == [pk is None, pq is None]
    got = [g for g in got if g is not None]
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert (a - b).abs().max() <= 1e-5 * max(1.0, b.abs().max().item())


def test_attention_lse_is_the_log_sum_exp_of_the_scaled_scores_in_log2_units():
    """`deberta_attention_lse` (the forward kernel's second output, what the backward
    re-exponentiates): log2(sum_j exp(scale * logit_ij)) per query row and head, the logits one pair
    at a time; a larger max_seqlen (more grid padding) changes nothing."""
    types, buckets, max_pos = ("c2p", "p2c"), 4, 6
    q, k, v, cu, pk, pq = _attention_inputs(types, buckets, max_pos, lengths=(1, 9, 4), K=8)
    lse = RD.deberta_attention_lse(q, k, cu, 9, pk, pq, buckets, max_pos, 0.3)
    assert lse.shape == q.shape[:2] and lse.dtype == torch.float32
    for s in range(3):
        a, e = int(cu[s]), int(cu[s + 1])
        for i in range(a, e):
            logits = torch.stack([pair_logit(q, k, pk, pq, types, buckets, max_pos, i, j) for j in range(a, e)])
            want = torch.logsumexp(logits * 0.3, 0) / math.log(2)
            assert (lse[i] - want).abs().max() <= 1e-5
    assert (RD.deberta_attention_lse(q, k, cu, 20, pk, pq, buckets, max_pos, 0.3) - lse).abs().max() <= 1e-6


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
