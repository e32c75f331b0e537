"""ModernBERT packed (reference backend, fp32, CPU) against transformers' padded eager output.

Each config flips flags that change the math; together they cover layer_types and
global_attn_every_n_layers, local_attention (windows crossed by long sequences), global/local RoPE
theta in both the 4.x and 5.x schemas, attention/mlp/norm biases, hidden activation and norm eps.
"""

import json

import pytest
import torch

import packedenc as pe
from packedenc.models import modernbert

transformers = pytest.importorskip("transformers")

# lengths: >= 8 sequences, a length-1 one, several longer than the local window (8 or 16 tokens)
LENGTHS = [1, 5, 40, 17, 9, 33, 2, 12, 64, 7]

CONFIGS = {
    # default schedule (global every 3), tiny window, no biases, exact GELU
    "default": dict(local_attention=8),
    # every bias on, SiLU MLP, global every 2nd layer, 5.x rope_parameters with unusual thetas
    "biases_silu": dict(
        attention_bias=True, mlp_bias=True, norm_bias=True, hidden_activation="silu",
        global_attn_every_n_layers=2, local_attention=16,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 160000.0}},
    ),
    # explicit irregular layer_types, tanh GELU, small eps
    "layer_types": dict(
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
        hidden_activation="gelu_pytorch_tanh", norm_eps=1e-6, local_attention=8,
    ),
    # 4.x schema: global_rope_theta / local_rope_theta keys in config.json
    "legacy_4x": dict(global_rope_theta=20000.0, local_rope_theta=500.0, local_attention=12, norm_bias=True),
}


def tiny_config(**overrides):
    kw = dict(vocab_size=101, hidden_size=32, intermediate_size=40, num_hidden_layers=4,
              num_attention_heads=4, pad_token_id=0, bos_token_id=1, eos_token_id=2,
              cls_token_id=1, sep_token_id=2, attn_implementation="eager")
    kw.update(overrides)
    return transformers.ModernBertConfig(**kw)


def randomize(model):
    """HF init leaves norms at 1 and biases at 0; perturb everything so every param matters."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def save_tiny(tmp_path, cls, cfg, legacy_keys=None):
    model = randomize(cls(cfg))
    model.save_pretrained(tmp_path)
    if legacy_keys:  # rewrite config.json the way transformers 4.x wrote it
        d = json.loads((tmp_path / "config.json").read_text())
        d.pop("rope_parameters", None)
        d.update(legacy_keys)
        (tmp_path / "config.json").write_text(json.dumps(d))
        model = cls.from_pretrained(tmp_path, attn_implementation="eager").eval()  # HF reads them too
    return model


def batch(lengths=LENGTHS, vocab=101, seed=0):
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(3, vocab, (n,), generator=g) for n in lengths]
    ids = torch.zeros(len(seqs), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], mask[i, : len(s)] = s, 1
    return pe.pack(seqs), ids, mask


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_encode_matches_hf(tmp_path, name):
    overrides = dict(CONFIGS[name])
    legacy = None
    if name == "legacy_4x":
        legacy = {"global_rope_theta": overrides.pop("global_rope_theta"),
                  "local_rope_theta": overrides.pop("local_rope_theta")}
    hf = save_tiny(tmp_path, transformers.ModernBertModel, tiny_config(**overrides), legacy)
    params = pe.load(tmp_path)
    if legacy:
        assert (params.config.global_rope_theta, params.config.local_rope_theta) == (20000.0, 500.0)
        assert hf.config.rope_parameters["sliding_attention"]["rope_theta"] == 500.0
    packed, ids, mask = batch()
    out = pe.encode(params, packed.ids, packed.cu_seqlens, packed.max_seqlen, backend="reference")
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask).last_hidden_state[mask.bool()]
        # without autograd the output projections add the residual in their GEMM (`linear_add`)
        folded = pe.encode(params, packed.ids, packed.cu_seqlens, packed.max_seqlen, backend="reference")
    assert out.shape == ref.shape == folded.shape
    err = (out - ref).abs().max().item()
    assert err <= 1e-4, err
    err = (folded - ref).abs().max().item()
    assert err <= 1e-4, err


def test_inference_adds_the_residual_in_the_gemm_within_bf16_noise(tmp_path):
    """bf16: the folded sum (rounded once) stays within bf16 noise of HF's rounding (the carried
    path: projection rounded, then the sum), measured against the fp32 model (here 0.049 vs 0.036)."""
    save_tiny(tmp_path, transformers.ModernBertModel, tiny_config(**CONFIGS["biases_silu"]))
    params = pe.load(tmp_path)
    packed, _, _ = batch()
    args = (packed.ids, packed.cu_seqlens, packed.max_seqlen)
    ref = pe.encode(params, *args, backend="reference").detach()
    low = pe.tree_cast(params, torch.bfloat16)
    carried = pe.encode(low, *args, backend="reference").detach().float()
    with torch.no_grad():
        folded = pe.encode(low, *args, backend="reference").float()
    e_carried, e_folded = ((t - ref).abs().max().item() for t in (carried, folded))
    assert 0 < e_folded <= 1.5 * e_carried, (e_folded, e_carried)
    assert not torch.equal(carried, folded)  # the two paths did run


def test_window_and_isolation_matter(tmp_path):
    """Guards the comparison itself: a wrong window or a leak across sequences is caught."""
    import dataclasses

    save_tiny(tmp_path, transformers.ModernBertModel, tiny_config(local_attention=8))
    params = pe.load(tmp_path)
    packed, _, _ = batch()
    out = pe.encode(params, packed.ids, packed.cu_seqlens, packed.max_seqlen)
    wrong = dataclasses.replace(params, config=dataclasses.replace(params.config, local_attention=10))
    assert (pe.encode(wrong, packed.ids, packed.cu_seqlens) - out).abs().max() > 1e-3
    # one sequence alone == the same sequence inside the pack
    cu = packed.cu_seqlens
    s = 2
    alone = pe.encode(params, packed.ids[cu[s]:cu[s + 1]], torch.tensor([0, int(cu[s + 1] - cu[s])], dtype=torch.int32))
    assert torch.allclose(alone, out[cu[s]:cu[s + 1]], atol=1e-6)


def test_mlm_logits_match_hf(tmp_path):
    hf = save_tiny(tmp_path, transformers.ModernBertForMaskedLM, tiny_config(local_attention=8, classifier_bias=True))
    params = pe.load(tmp_path)
    assert params.decoder is not None and params.decoder.weight is None  # tied, re-tied at use
    packed, ids, mask = batch()
    hidden = pe.encode(params, packed.ids, packed.cu_seqlens, packed.max_seqlen)
    logits = modernbert.mlm_logits(params, hidden)
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask).logits[mask.bool()]
    assert (logits - ref).abs().max().item() <= 1e-4
    # scoring only masked positions equals slicing the full logits
    pos = torch.tensor([0, 7, 30])
    assert torch.allclose(modernbert.mlm_logits(params, hidden[pos]), logits[pos], atol=1e-6)


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_classifier_logits_match_hf(tmp_path, pooling):
    cfg = tiny_config(local_attention=8, classifier_pooling=pooling, num_labels=3, classifier_bias=True,
                      classifier_activation="silu")
    hf = save_tiny(tmp_path, transformers.ModernBertForSequenceClassification, cfg)
    params = pe.load(tmp_path)
    assert params.config.num_labels == 3
    packed, ids, mask = batch()
    hidden = pe.encode(params, packed.ids, packed.cu_seqlens, packed.max_seqlen)
    logits = modernbert.classify(params, hidden, packed.cu_seqlens)
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask).logits
    assert logits.shape == (len(LENGTHS), 3)
    assert (logits - ref).abs().max().item() <= 1e-4


def test_heads_missing_raise(tmp_path):
    save_tiny(tmp_path, transformers.ModernBertModel, tiny_config())
    params = pe.load(tmp_path)
    h = torch.zeros(3, 32)
    with pytest.raises(pe.ConfigError, match="MLM decoder"):
        modernbert.mlm_logits(params, h)
    with pytest.raises(pe.ConfigError, match="classifier"):
        modernbert.classify(params, h, torch.tensor([0, 3], dtype=torch.int32))


def test_config_round_trip():
    for name, overrides in CONFIGS.items():
        overrides = {k: v for k, v in overrides.items() if k not in ("global_rope_theta", "local_rope_theta")}
        cfg = modernbert.ModernBertConfig.from_hf(tiny_config(**overrides).to_dict())
        assert modernbert.ModernBertConfig.from_hf(cfg.to_hf()) == cfg, name
        hash(cfg)  # static metadata must be hashable for torch.compile
