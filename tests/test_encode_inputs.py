"""Every bad input to `encode` gets an InputError that names the problem (issue 2, item 6)."""

import pytest
import torch

import packedenc as pe
from packedenc.models import modernbert

CFG = modernbert.ModernBertConfig(vocab_size=50, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                                  num_attention_heads=2, local_attention=4)
PARAMS = pe.init(CFG, torch.Generator().manual_seed(0))
IDS = torch.tensor([1, 2, 3, 4, 5])
CU = torch.tensor([0, 2, 5], dtype=torch.int32)


def test_good_input_runs_and_int64_cu_is_accepted():
    a = pe.encode(PARAMS, IDS, CU)
    b = pe.encode(PARAMS, IDS, CU.long(), 3)
    assert a.shape == (5, 16) and torch.equal(a, b)


@pytest.mark.parametrize("ids, cu, match", [
    (IDS, CU.float(), "1-D int32"),
    (IDS, CU.view(1, -1), "1-D int32"),
    (IDS, torch.tensor([1, 2, 5], dtype=torch.int32), "must start at 0"),
    (IDS, torch.tensor([0, 3, 2, 5], dtype=torch.int32), "non-decreasing"),
    (IDS, torch.tensor([0, 2, 4], dtype=torch.int32), "end at the number of packed tokens"),
    (IDS, torch.tensor([0, 2, 2, 5], dtype=torch.int32), "sequence 1 is empty"),
    (IDS, torch.tensor([0], dtype=torch.int32), "empty batch"),
    (IDS.float(), CU, "int64 or int32 tensor"),
    (IDS.view(1, -1), CU, "must be 1-D"),
    (torch.tensor([1, 2, 3, 4, 50]), CU, "token id 50 is outside the vocabulary"),
    (torch.tensor([1, -2, 3, 4, 5]), CU, "token id -2 is outside"),
    (torch.tensor([], dtype=torch.long), torch.tensor([0, 0], dtype=torch.int32), "empty batch"),
])
def test_bad_input(ids, cu, match):
    with pytest.raises(pe.InputError, match=match):
        pe.encode(PARAMS, ids, cu)


def test_bad_max_seqlen_positions_and_params():
    with pytest.raises(pe.InputError, match="max_seqlen=2 is smaller"):
        pe.encode(PARAMS, IDS, CU, 2)
    with pytest.raises(pe.InputError, match="positions shape"):
        pe.encode(PARAMS, IDS, CU, 3, torch.arange(4))
    with pytest.raises(pe.ConfigError, match="not a packedenc params tree"):
        pe.encode({"w": torch.ones(1)}, IDS, CU)
    with pytest.raises(pe.ConfigError, match="unknown backend"):
        pe.encode(PARAMS, IDS, CU, backend="magic")


def test_unsupported_config_flags():
    with pytest.raises(pe.ConfigError, match="classifier_pooling"):
        modernbert.ModernBertConfig(classifier_pooling="max")
    with pytest.raises(pe.ConfigError, match="not divisible"):
        modernbert.ModernBertConfig(hidden_size=10, num_attention_heads=3)
    with pytest.raises(pe.ConfigError, match="rope_scaling"):
        modernbert.ModernBertConfig.from_hf({"model_type": "modernbert", "rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    with pytest.raises(pe.ConfigError, match="layer_types"):
        modernbert.ModernBertConfig.from_hf({"model_type": "modernbert", "num_hidden_layers": 2,
                                             "layer_types": ["full_attention", "chunked_attention"]})
