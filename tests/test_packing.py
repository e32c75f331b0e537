"""Packing, padding and pooling against straightforward per-sequence loops."""

import pytest
import torch

import packedenc as pe
from packedenc.packing import pool_last, segment_ids, token_budget_batches


def test_pack_fields():
    b = pe.pack([[5, 6, 7], [8], torch.tensor([9, 10])])
    assert b.ids.tolist() == [5, 6, 7, 8, 9, 10]
    assert b.cu_seqlens.dtype == torch.int32 and b.cu_seqlens.tolist() == [0, 3, 4, 6]
    assert b.positions.tolist() == [0, 1, 2, 0, 0, 1]
    assert b.max_seqlen == 3 and isinstance(b.max_seqlen, int) and b.num_seqs == 3
    assert segment_ids(b.cu_seqlens, 6).tolist() == [0, 0, 0, 1, 2, 2]


def test_pack_padded_any_side_and_unpack_pad():
    ids = torch.tensor([[1, 2, 3, 0], [0, 0, 4, 5]])
    mask = torch.tensor([[1, 1, 1, 0], [0, 0, 1, 1]])
    b = pe.pack_padded(ids, mask)
    assert b.ids.tolist() == [1, 2, 3, 4, 5] and b.cu_seqlens.tolist() == [0, 3, 5]
    parts = pe.unpack(b.ids, b.cu_seqlens)
    assert [p.tolist() for p in parts] == [[1, 2, 3], [4, 5]]
    padded, m = pe.pad(b.ids.float().unsqueeze(-1), b.cu_seqlens, b.max_seqlen, value=-1)
    assert padded[..., 0].tolist() == [[1, 2, 3], [4, 5, -1]] and m.tolist() == [[1, 1, 1], [1, 1, 0]]


def test_pooling_matches_loops():
    b = pe.pack([[1] * n for n in (1, 4, 7, 2)])
    x = torch.randn(b.num_tokens, 5)
    parts = pe.unpack(x, b.cu_seqlens)
    torch.testing.assert_close(pe.pool_mean(x, b.cu_seqlens), torch.stack([p.mean(0) for p in parts]))
    torch.testing.assert_close(pe.pool_max(x, b.cu_seqlens), torch.stack([p.max(0).values for p in parts]))
    torch.testing.assert_close(pe.pool_first(x, b.cu_seqlens), torch.stack([p[0] for p in parts]))
    torch.testing.assert_close(pool_last(x, b.cu_seqlens), torch.stack([p[-1] for p in parts]))
    w = torch.rand(b.num_tokens)
    want = torch.stack([(p * q[:, None]).sum(0) / q.sum() for p, q in zip(parts, pe.unpack(w, b.cu_seqlens))])
    torch.testing.assert_close(pe.pool_mean(x, b.cu_seqlens, weights=w), want)
    with pytest.raises(pe.InputError, match="unknown pooling"):
        pe.pool(x, b.cu_seqlens, "median")


def test_token_budget_batches():
    lengths = [5, 5, 5, 20, 1, 1]
    batches = token_budget_batches(lengths, max_tokens=10)
    assert batches == [[0, 1], [2], [3], [4, 5]]
    assert sorted(i for bb in batches for i in bb) == list(range(6))
    assert token_budget_batches(lengths, 100, max_seqs=4) == [[0, 1, 2, 3], [4, 5]]


@pytest.mark.parametrize("bad, match", [
    ([], "empty batch"),
    ([[1, 2], []], "sequence 1 is empty"),
    ([[1.5, 2.0]], "integer token ids"),  # never silently truncated to [1, 2]
    ([torch.tensor([1.0, 2.0])], "integer token ids"),
    ([[[1, 2]]], "must be 1-D"),
    ([["a", "b"]], "not a list of integer token ids"),
])
def test_pack_bad_input(bad, match):
    with pytest.raises(pe.InputError, match=match):
        pe.pack(bad)


def test_pack_padded_bad_input():
    with pytest.raises(pe.InputError, match="no real token"):
        pe.pack_padded(torch.ones(2, 3, dtype=torch.long), torch.tensor([[1, 1, 0], [0, 0, 0]]))
    with pytest.raises(pe.InputError, match="pack_padded"):
        pe.pack(torch.ones(2, 3, dtype=torch.long))


def test_longest_first_orders_sequences_by_length_ties_by_index():
    from packedenc.packing import longest_first

    cu = torch.tensor([0, 3, 10, 13, 14, 21], dtype=torch.int32)  # lengths 3, 7, 3, 1, 7
    order = longest_first(cu)
    assert order.dtype == torch.int32 and order.tolist() == [1, 4, 0, 2, 3]
    assert longest_first(torch.tensor([0], dtype=torch.int32)).numel() == 0
