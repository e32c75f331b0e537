"""DeBERTa bad inputs and unsupported configs: a clear InputError / ConfigError naming the problem."""

import dataclasses

import pytest
import torch

import packedenc as pe
from packedenc.models import deberta

V3 = dict(relative_attention=True, position_buckets=8, max_relative_positions=16, norm_rel_ebd="layer_norm",
          share_att_key=True, pos_att_type=("p2c", "c2p"), position_biased_input=False)
CFG = deberta.DebertaConfig(vocab_size=50, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                            num_attention_heads=2, **V3)
PARAMS = pe.init(CFG, torch.Generator().manual_seed(0))
# absolute positions (max 8) and 2 token types
ABS = pe.init(dataclasses.replace(CFG, position_biased_input=True, max_position_embeddings=8, type_vocab_size=2),
              torch.Generator().manual_seed(0))
IDS = torch.tensor([1, 2, 3, 4, 5])
CU = torch.tensor([0, 2, 5], dtype=torch.int32)


def test_good_input_runs():
    a = pe.encode(PARAMS, IDS, CU)
    b = pe.encode(ABS, IDS, CU.long(), 3, token_type_ids=torch.tensor([0, 1, 0, 0, 1]))
    assert a.shape == b.shape == (5, 16) and torch.isfinite(a).all() and torch.isfinite(b).all()


def test_positions_are_derived_only_for_absolute_position_embeddings(monkeypatch):
    """A v3 model (relative positions only) never builds the (T,) position buffer (~8 small kernels
    of host and device time per batch); a model with absolute positions still does."""
    from packedenc.models import common

    calls = []
    real = common.positions_from_cu_seqlens
    monkeypatch.setattr(common, "positions_from_cu_seqlens", lambda *a: calls.append(1) or real(*a))
    pe.encode(PARAMS, IDS, CU)
    assert calls == []
    pe.encode(ABS, IDS, CU)
    assert calls == [1]


@pytest.mark.parametrize("ids, cu, match", [
    (IDS, CU.float(), "1-D int32"),
    (IDS, torch.tensor([1, 2, 5], dtype=torch.int32), "must start at 0"),
    (IDS, torch.tensor([0, 3, 2, 5], dtype=torch.int32), "non-decreasing"),
    (IDS, torch.tensor([0, 2, 4], dtype=torch.int32), "end at the number of packed tokens"),
    (IDS, torch.tensor([0, 2, 2, 5], dtype=torch.int32), "sequence 1 is empty"),
    (IDS.float(), CU, "int64 or int32 tensor"),
    (IDS.view(1, -1), CU, "must be 1-D"),
    (torch.tensor([1, 2, 3, 4, 50]), CU, "token id 50 is outside the vocabulary"),
])
def test_bad_ids_and_cu_seqlens(ids, cu, match):
    with pytest.raises(pe.InputError, match=match):
        pe.encode(PARAMS, ids, cu)


@pytest.mark.parametrize("tt, match", [
    (torch.tensor([0, 1, 0]), r"token_type_ids must be a \(T,\) tensor"),
    (torch.tensor([[0, 1, 0, 0, 1]]), r"token_type_ids must be a \(T,\) tensor"),
    (torch.tensor([0.0, 1, 0, 0, 1]), "integer tensor"),
    (torch.tensor([0, 1, 2, 0, 1]), r"token type id 2 is outside \[0, 2\)"),
    (torch.tensor([0, -1, 0, 0, 1]), r"token type id -1 is outside"),
    ([0, 1, 0, 0, 1], r"token_type_ids must be a \(T,\) tensor"),
])
def test_bad_token_type_ids(tt, match):
    with pytest.raises(pe.InputError, match=match):
        pe.encode(ABS, IDS, CU, token_type_ids=tt)


def test_token_types_without_a_table_are_ignored_like_hf():
    assert torch.equal(pe.encode(PARAMS, IDS, CU), pe.encode(PARAMS, IDS, CU, token_type_ids=torch.ones(5, dtype=torch.long)))


def test_sequence_longer_than_absolute_positions():
    ids = torch.arange(1, 11)
    with pytest.raises(pe.InputError, match=r"max_seqlen=10, but .*max_position_embeddings=8\) allows sequences "
                                            r"of at most 8 tokens"):
        pe.encode(ABS, ids, torch.tensor([0, 10], dtype=torch.int32))
    # relative-only models have no such limit: buckets saturate
    assert pe.encode(PARAMS, torch.arange(1, 41), torch.tensor([0, 40], dtype=torch.int32)).shape == (40, 16)


def test_heads_missing():
    h = pe.encode(PARAMS, IDS, CU)
    with pytest.raises(pe.ConfigError, match="no classifier"):
        deberta.classify(PARAMS, h, CU)
    with pytest.raises(pe.ConfigError, match="no MLM head"):
        deberta.mlm_logits(PARAMS, h)
    with pytest.raises(pe.ConfigError, match="unknown DeBERTa head"):
        deberta.init(CFG, heads=("qa",))


@pytest.mark.parametrize("kw, match", [
    (dict(hidden_size=10, num_attention_heads=3), "not divisible"),
    (dict(hidden_size=16, num_attention_heads=2, attention_head_size=4), r"attention_head_size 4 x 2 heads"),
    (dict(pos_att_type=("c2p", "p2p")), r"'p2p'.*only 'c2p' and 'p2c'"),
    (dict(pos_att_type=("c2p", "c2p")), "repeats"),
    (dict(norm_rel_ebd="batch_norm"), "norm_rel_ebd"),
    (dict(V3, max_relative_positions=5), r"position_buckets=8 with max_relative_positions=5.*positive"),
    (dict(V3, position_buckets=1), "position_buckets >= 2"),
    (dict(conv_kernel_size=4), "conv_kernel_size 4 must be 0"),
    (dict(hidden_size=16, num_attention_heads=2, conv_kernel_size=3, conv_groups=3), "conv_groups 3 must divide"),
    (dict(conv_kernel_size=3, conv_act="swishy"), "activation 'swishy'"),
    (dict(hidden_act="mish2"), "activation 'mish2'"),
    (dict(type_vocab_size=-1), "type_vocab_size"),
])
def test_unsupported_configs(kw, match):
    with pytest.raises(pe.ConfigError, match=match):
        deberta.DebertaConfig(**kw)


def test_unsupported_hf_configs():
    with pytest.raises(pe.ConfigError, match="not a DeBERTa-v2/v3 config"):
        deberta.DebertaConfig.from_hf({"model_type": "deberta"})
    with pytest.raises(pe.ConfigError, match="pooler_hidden_size 8 != hidden_size 16"):
        deberta.DebertaConfig.from_hf({"model_type": "deberta-v2", "hidden_size": 16, "num_attention_heads": 2,
                                       "pooler_hidden_size": 8})
    with pytest.raises(pe.ConfigError, match=r"'p2p'"):
        deberta.DebertaConfig.from_hf({"model_type": "deberta-v2", "pos_att_type": "c2p|p2p"})
    with pytest.raises(pe.ConfigError, match="needs embedding_size == hidden_size"):
        deberta.params_spec(dataclasses.replace(CFG, embedding_size=8), heads=("mlm",))
    # the raw Microsoft spelling is accepted and normalised
    cfg = deberta.DebertaConfig.from_hf({"model_type": "deberta-v2", "pos_att_type": "P2C | c2p",
                                         "relative_attention": True, "position_buckets": 256})
    assert cfg.pos_att_type == ("p2c", "c2p") and cfg.att_span == 256 and cfg.max_relative == 512
