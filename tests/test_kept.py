"""`packedenc.kept`: values made from weights, handed back while the weights are the same tensors
at the same versions (DeBERTa's position tables, the fused norm + GEMM's column sums)."""

import gc

import torch

from packedenc.kept import Kept, keepable


def test_a_value_is_handed_back_only_for_the_same_tensors_versions_and_extra():
    a, b = torch.ones(3), torch.zeros(2)
    store = Kept(max_entries=4)
    assert store.get([a, b]) is None and store.get([a, b], default="miss") == "miss"
    v = object()
    assert store.put([a, b], "x", v) is v
    assert store.get([a, b], "x") is v and store.holds(a) and not store.holds(b)
    assert store.get([a, b], "y") is None  # another op table
    assert store.get([a, b.clone()], "x") is None  # an equal tensor is not the same one
    assert store.get([a], "x") is None
    b.add_(1)  # an in-place update: stale
    assert store.get([a, b], "x") is None
    w = object()
    store.put([a, b], "x", w)
    assert store.get([a, b], "x") is w and len(store) == 1  # replaced, not added


def test_entries_go_with_their_first_tensor_and_the_oldest_past_the_limit():
    store = Kept(max_entries=2)
    ts = [torch.ones(1) for _ in range(3)]
    for i in range(3):
        store.put([ts[i]], None, i)
    assert len(store) == 2 and store.get([ts[0]]) is None and store.get([ts[2]]) == 2
    del ts[2]
    gc.collect()
    assert len(store) == 1 and store.get([ts[1]]) == 1


def test_clear_drops_every_entry():
    store = Kept(max_entries=4)
    a, b = torch.ones(1), torch.ones(1)
    store.put([a], None, 1)
    store.put([b], None, 2)
    store.clear()
    assert len(store) == 0 and store.get([a]) is None and not store.holds(b)
    store.put([a], None, 3)  # usable again
    assert store.get([a]) == 3


def test_not_keepable_in_inference_tensors_or_without_leaves():
    assert keepable([torch.ones(2)]) and not keepable([])
    with torch.inference_mode():
        t = torch.ones(2)
        assert keepable([torch.ones(2)]) is False and not keepable([t])
    p = torch.ones(2)
    with torch.inference_mode():
        assert keepable([p])  # a tensor made outside keeps its version inside inference mode
