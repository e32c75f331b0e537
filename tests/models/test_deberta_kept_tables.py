"""DeBERTa inference keeps each params tree's relative-position tables (`position_inputs`):
made once, reused while the weights they come from are unchanged, made again after an in-place
update, never kept for a forward with gradients, and dropped with the params."""

import dataclasses
import gc

import pytest
import torch

import packedenc as pe
from packedenc.models import deberta
from packedenc.models.deberta import model as M


def _params(share_att_key=True, seed=0):
    cfg = dataclasses.replace(deberta.PRESETS["v3-base"], vocab_size=128, hidden_size=64, num_attention_heads=2,
                              intermediate_size=96, num_hidden_layers=2, position_buckets=16,
                              max_relative_positions=64, share_att_key=share_att_key)
    return pe.init(cfg, torch.Generator().manual_seed(seed))


@pytest.fixture
def made(monkeypatch):
    """Counts the position tables made (`position_tables` calls)."""
    calls = [0]
    real = M.position_tables

    def counting(*a, **k):
        calls[0] += 1
        return real(*a, **k)

    monkeypatch.setattr(M, "position_tables", counting)
    return calls


BATCH = pe.pack([torch.arange(3, 3 + n) % 120 + 3 for n in (1, 5, 37, 70)])


def _encode(p):
    return pe.encode(p, BATCH.ids, BATCH.cu_seqlens, BATCH.max_seqlen)


@pytest.mark.parametrize("share_att_key", [True, False])
def test_inference_makes_the_tables_once_and_equals_a_forward_with_gradients(share_att_key, made):
    p = _params(share_att_key)
    with torch.no_grad():
        first, again = _encode(p), _encode(p)
    with torch.inference_mode():
        third = _encode(p)
    assert made[0] == 1
    fresh = _encode(p)  # gradients on: made again, never kept
    assert made[0] == 2
    assert torch.equal(first, again) and torch.equal(first, third) and torch.equal(first, fresh.detach())


def test_an_in_place_update_of_a_weight_makes_them_again(made):
    p = _params()
    with torch.no_grad():
        before = _encode(p)
        p.encoder.layer[1].attention.qkv.weight.add_(0.05)  # the shared key / query projection
        after = _encode(p)
    assert made[0] == 2 and not torch.equal(before, after)
    assert torch.equal(after, _encode(p).detach())
    with torch.no_grad():
        p.encoder.rel_embeddings.weight.mul_(1.5)
        moved = _encode(p)
    assert made[0] == 4 and torch.equal(moved, _encode(p).detach())


def test_other_params_or_another_op_table_are_not_served_from_them(made):
    from packedenc.kernels import get_ops

    a, b = _params(seed=0), _params(seed=1)
    with torch.no_grad():
        ea, eb = _encode(a), _encode(b)
        assert made[0] == 2 and not torch.equal(ea, eb)
        same = pe.encode(a, BATCH.ids, BATCH.cu_seqlens, BATCH.max_seqlen, backend=get_ops("reference"))
        assert made[0] == 2 and torch.equal(ea, same)  # the same implementations: the same tables
        other = dataclasses.replace(get_ops("reference"), chosen=(("linear", "another"),))
        pe.encode(a, BATCH.ids, BATCH.cu_seqlens, BATCH.max_seqlen, backend=other)
    assert made[0] == 3


def test_params_made_in_inference_mode_are_not_kept_and_entries_go_with_their_params(made):
    with torch.inference_mode():
        p = _params()
        out = [_encode(p), _encode(p)]
    assert made[0] == 2 and torch.equal(*out)  # inference tensors keep no version: made every time
    q = _params()
    with torch.no_grad():
        _encode(q)
    assert M._KEPT.holds(q.encoder.rel_embeddings.weight)
    n = len(M._KEPT)
    del q
    gc.collect()
    assert len(M._KEPT) == n - 1
