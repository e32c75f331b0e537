"""The reference varlen attention (`kernels/reference/attention.py`) against a naive per-sequence
loop: the grouped CPU path, the single grid (compile, other devices) and the seeded dropout path."""

import pytest
import torch

from packedenc.kernels.reference import attention as A


def _naive(q, k, v, lengths, window, scale):
    """Each sequence alone, float64, an explicit band mask and softmax."""
    out, start = [], 0
    for n in lengths:
        qs, ks, vs = (t[start:start + n].double() for t in (q, k, v))
        i = torch.arange(n)
        keep = torch.ones(n, n, dtype=torch.bool)
        if window[0] >= 0:
            keep &= i[None, :] >= i[:, None] - window[0]
        if window[1] >= 0:
            keep &= i[None, :] <= i[:, None] + window[1]
        s = torch.einsum("ihk,jhk->hij", qs, ks) * scale
        p = torch.softmax(s.masked_fill(~keep, float("-inf")), -1)
        out.append(torch.einsum("hij,jhk->ihk", p, vs))
        start += n
    return torch.cat(out) if out else q.new_zeros(q.shape).double()


CASES = {
    "unsorted, empty and 1-token sequences": [5, 0, 17, 1, 3, 0, 9, 33, 2],
    "sorted longest first": [40, 31, 31, 12, 7, 7, 2, 1],
    "one sequence over a group": [A.GROUP_ROWS + 37],
    "many short": [3] * 700 + [1] * 40,
    "all empty": [0, 0, 0],
}


@pytest.mark.parametrize("window", [(-1, -1), (2, 3), (0, 0), (4, -1)])
@pytest.mark.parametrize("case", CASES)
def test_grouped_and_grid_match_a_naive_loop(case, window):
    lengths = CASES[case]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    T, H, K = int(cu[-1]), 2, 8
    g = torch.Generator().manual_seed(len(lengths))
    q, k, v = (torch.randn(T, H, K, generator=g) for _ in range(3))
    want = _naive(q, k, v, lengths, window, 0.4)
    L = max(lengths)
    got = A.varlen_attention(q, k, v, cu, L, window, 0.4)  # CPU, eager: grouped
    grid = A._grid(q, k, v, cu, L, window, 0.4)  # what compile and CUDA run
    assert got.shape == (T, H, K) and got.dtype == q.dtype
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grid, got, rtol=1e-6, atol=1e-6)


def test_gradients_and_low_precision():
    lengths = [6, 1, 11, 4]
    cu = torch.tensor([0, 6, 7, 18, 22], dtype=torch.int32)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(22, 3, 16, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    w = torch.randn(22, 3, 16, generator=g, dtype=torch.float64)
    got = torch.autograd.grad((A.varlen_attention(q, k, v, cu, 11, (2, 2), 0.3) * w).sum(), (q, k, v))
    want = torch.autograd.grad((_naive(q, k, v, lengths, (2, 2), 0.3) * w).sum(), (q, k, v))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)  # the reference computes in fp32
    for dt in (torch.bfloat16, torch.float16):
        out = A.varlen_attention(q.detach().to(dt), k.detach().to(dt), v.detach().to(dt), cu, 11)
        assert out.dtype == dt
        torch.testing.assert_close(out.double(), _naive(q.detach(), k.detach(), v.detach(), lengths, (-1, -1), 16**-0.5),
                                   rtol=2e-2, atol=2e-2)


def test_seeded_dropout_is_reproducible_and_scales():
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    q, k, v = (torch.randn(12, 2, 4, generator=torch.Generator().manual_seed(i)) for i in range(3))
    a = A.varlen_attention(q, k, v, cu, 7, dropout_p=0.5, dropout_seed=7)
    b = A.varlen_attention(q, k, v, cu, 7, dropout_p=0.5, dropout_seed=7)
    c = A.varlen_attention(q, k, v, cu, 7, dropout_p=0.5, dropout_seed=8)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not torch.equal(a, c)
    torch.testing.assert_close(A.varlen_attention(q, k, v, cu, 7, dropout_p=0.5), A.varlen_attention(q, k, v, cu, 7))


@pytest.mark.parametrize("buckets", [-1, 8])
def test_deberta_groups_match_one_grid(buckets):
    """DeBERTa's disentangled attention per length group (CPU) equals it on one padded grid."""
    from packedenc.kernels.reference import deberta as D

    lengths = [5, 0, 40, 1, 3, 9, 33, 2, 700]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    T, H, K, span = int(cu[-1]), 2, 8, 16
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(T, H, K, generator=g) for _ in range(3))
    R = 2 * (buckets if buckets > 0 else span)  # the tables' rows: 2 x att_span
    pk, pq = (torch.randn(R, H, K, generator=g) for _ in range(2))
    kw = dict(pos_att_type=("c2p", "p2c"), position_buckets=buckets, max_relative_positions=span, scale=0.2)
    got = D.deberta_attention(q, k, v, cu, max(lengths), pk, pq, **kw)
    want = D._grid_attention(q, k, v, cu, max(lengths), pk, pq, kw["pos_att_type"], buckets, span, 0.2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layer", ["full", "anchor"])
def test_graph_attention_groups_match_one_grid(layer):
    """The graph transformer's attention per key-length group (CPU) equals one grid, gradients too:
    full layers (a fused qkv buffer) and the anchor-only layer (one query per sequence)."""
    lengths = [5, 1, 40, 3, 700, 9, 33, 2, 17]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    T, H, K = int(cu[-1]), 2, 8
    g = torch.Generator().manual_seed(4)
    bias = torch.randn(T, H, generator=g, dtype=torch.float64, requires_grad=True)
    if layer == "full":
        qkv = torch.randn(T, 3, H, K, generator=g, dtype=torch.float64, requires_grad=True)
        leaves, args, cu_q, Lq = (qkv, bias), (qkv, None, None), cu, max(lengths)
    else:
        q = torch.randn(len(lengths), H, K, generator=g, dtype=torch.float64, requires_grad=True)
        k, v = (torch.randn(T, H, K, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
        leaves, args, cu_q, Lq = (q, k, v, bias), (q, k, v), torch.arange(len(lengths) + 1, dtype=torch.int32), 1
    got = A.graph_attention(*args, cu_q, cu, Lq, max(lengths), bias, 0.3)
    parts = args if layer == "anchor" else args[0].unbind(1)
    want = A._graph_grid(*parts, cu_q, cu, Lq, max(lengths), bias, 0.3)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    w = torch.randn(got.shape, generator=g, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad((got * w).sum(), leaves), torch.autograd.grad((want * w).sum(), leaves)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
