"""DeBERTa-v2/v3 packed (reference backend, fp32, CPU) against transformers' padded eager output.

Together the configs cover every math-changing flag: log buckets with small position_buckets /
max_relative_positions (8 / 16, 4 / 10) and sequences up to 3x longer (buckets and clamps), plain
clamped distances without buckets, norm_rel_ebd, share_att_key true and false, pos_att_type
{c2p, p2c}, {c2p}, {p2c}, {} (with and without relative_attention), position_biased_input,
type_vocab_size with token type ids, embedding_size != hidden_size, attention_head_size, and the
conv layer (kernel 3 and 5, groups 1 and 2, gelu and tanh). Each batch has >= 8 sequences, one of
length 1.
"""

import json

import pytest
import torch

import packedenc as pe
from packedenc.models import deberta

transformers = pytest.importorskip("transformers")

# >= 8 sequences, a length-1 one, lengths around and up to 3x max_relative_positions (16)
LENGTHS = [1, 2, 7, 16, 17, 33, 48, 5, 24]

V3 = dict(relative_attention=True, position_buckets=8, max_relative_positions=16, norm_rel_ebd="layer_norm",
          share_att_key=True, pos_att_type="p2c|c2p", position_biased_input=False)

CONFIGS = {
    # DeBERTa-v3 layout with tiny buckets: log buckets for |d| > 4, saturation beyond |d| = 15
    "v3": V3,
    # separate c2p projection only, absolute positions, token types, no rel-emb norm, 4/10 buckets
    "c2p_separate_abs_types": dict(
        relative_attention=True, position_buckets=4, max_relative_positions=10, norm_rel_ebd="none",
        share_att_key=False, pos_att_type=["c2p"], position_biased_input=True, type_vocab_size=2,
    ),
    # p2c only through pos_query_proj, no buckets (raw distances clamped at +-16), embed_proj E != D
    "p2c_nobuckets_embproj": dict(
        relative_attention=True, max_relative_positions=16, share_att_key=False, pos_att_type="p2c",
        position_biased_input=False, embedding_size=24, type_vocab_size=3, hidden_act="gelu_new",
    ),
    # deberta-v2-xlarge: conv layer (k=3, gelu) after layer 0, explicit attention_head_size
    "conv_xlarge": dict(V3, conv_kernel_size=3, conv_act="gelu", attention_head_size=8),
    # conv with k=5, groups=2, default tanh act, both pos terms with separate projections
    "conv_k5_groups_separate": dict(V3, share_att_key=False, conv_kernel_size=5, conv_groups=2, pos_att_type="c2p|p2c"),
    # no relative attention, yet pos_att_type still sets the scale sqrt(3K); absolute positions only
    "norel_scale": dict(relative_attention=False, pos_att_type="p2c|c2p", position_biased_input=True),
    # relative embeddings present but no position term: content-only with scale sqrt(K)
    "rel_no_terms": dict(relative_attention=True, position_buckets=8, max_relative_positions=16,
                         norm_rel_ebd="layer_norm", pos_att_type=None, position_biased_input=False),
}


def tiny_config(**overrides):
    kw = dict(vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
              pad_token_id=0, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    kw.update(overrides)
    cfg = transformers.DebertaV2Config(**kw)
    cfg._attn_implementation = "eager"  # DeBERTa has only eager attention; pinned so it stays the oracle
    return cfg


def randomize(model):
    """HF init leaves norms at 1 and biases at 0; perturb everything so every param matters."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def save_tiny(path, cls, cfg):
    model = randomize(cls(cfg))
    model.save_pretrained(path)
    return model


def batch(lengths=LENGTHS, vocab=101, seed=0, type_vocab=0):
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(3, vocab, (n,), generator=g) for n in lengths]
    ids = torch.zeros(len(seqs), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    types = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], mask[i, : len(s)] = s, 1
        if type_vocab:
            types[i, : len(s)] = torch.randint(0, type_vocab, (len(s),), generator=g)
    return pe.pack(seqs), ids, mask, types


def hf_hidden(model, ids, mask, types):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, token_type_ids=types).last_hidden_state


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_encode_matches_hf(tmp_path, name):
    cfg = tiny_config(**CONFIGS[name])
    model = save_tiny(tmp_path, transformers.DebertaV2Model, cfg)
    params = pe.load(tmp_path)
    assert isinstance(params, deberta.DebertaParams)
    b, ids, mask, types = batch(type_vocab=cfg.type_vocab_size)
    tt = types[mask.bool()] if cfg.type_vocab_size else None
    out = pe.encode(params, b.ids, b.cu_seqlens, b.max_seqlen, token_type_ids=tt, backend="reference")
    ref = hf_hidden(model, ids, mask, types)[mask.bool()]
    err = (out - ref).abs().max().item()
    assert out.shape == ref.shape
    assert err <= 1e-4, f"{name}: max abs err {err:.3g}"
    print(f"{name}: max abs err {err:.3g}")


def test_token_types_change_the_output(tmp_path):
    """The token type table is really read: all-ones types differ from the default zeros (and match HF)."""
    cfg = tiny_config(**CONFIGS["c2p_separate_abs_types"])
    model = save_tiny(tmp_path, transformers.DebertaV2Model, cfg)
    params = pe.load(tmp_path)
    b, ids, mask, _ = batch()
    ones = torch.ones_like(ids)
    out0 = pe.encode(params, b.ids, b.cu_seqlens, backend="reference")
    out1 = pe.encode(params, b.ids, b.cu_seqlens, token_type_ids=torch.ones_like(b.ids), backend="reference")
    assert (out0 - out1).abs().max() > 1e-3
    assert (out1 - hf_hidden(model, ids, mask, ones)[mask.bool()]).abs().max() <= 1e-4


@pytest.mark.parametrize("name", ["v3", "conv_xlarge"])
def test_sequences_are_isolated(tmp_path, name):
    """Packing is invisible: each sequence encoded alone gives the same rows as in the pack."""
    save_tiny(tmp_path, transformers.DebertaV2Model, tiny_config(**CONFIGS[name]))
    params = pe.load(tmp_path)
    b, ids, mask, _ = batch()
    packed = pe.encode(params, b.ids, b.cu_seqlens, backend="reference")
    for s, n in zip(pe.unpack(b.ids, b.cu_seqlens), pe.unpack(packed, b.cu_seqlens)):
        alone = pe.encode(params, s, torch.tensor([0, s.numel()], dtype=torch.int32), backend="reference")
        assert (alone - n).abs().max() <= 1e-5


def test_classifier_logits_match_hf(tmp_path):
    cfg = tiny_config(**CONFIGS["conv_xlarge"], id2label={0: "a", 1: "b", 2: "c"}, pooler_hidden_act="tanh")
    model = save_tiny(tmp_path, transformers.DebertaV2ForSequenceClassification, cfg)
    params = pe.load(tmp_path)
    assert params.classifier.weight.shape == (3, 32)
    b, ids, mask, _ = batch()
    hidden = pe.encode(params, b.ids, b.cu_seqlens, backend="reference")
    logits = deberta.classify(params, hidden, b.cu_seqlens, backend="reference")
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).logits
    err = (logits - ref).abs().max().item()
    assert logits.shape == (len(LENGTHS), 3) and err <= 1e-4, err


@pytest.mark.parametrize("legacy,extra", [
    (False, {}),  # lm_predictions head (Microsoft's layout)
    (True, {}),  # cls.predictions head tied to the word embeddings (transformers' default)
    (True, dict(embedding_size=24, tie_word_embeddings=False)),  # legacy head, untied decoder, E != D
])
def test_mlm_logits_match_hf(tmp_path, legacy, extra):
    cfg = tiny_config(**{**CONFIGS["v3"], **extra}, legacy=legacy)
    model = save_tiny(tmp_path, transformers.DebertaV2ForMaskedLM, cfg)
    params = pe.load(tmp_path)
    assert (params.lm_predictions is None) == legacy and (params.cls is None) == (not legacy)
    b, ids, mask, _ = batch()
    hidden = pe.encode(params, b.ids, b.cu_seqlens, backend="reference")
    logits = deberta.mlm_logits(params, hidden, backend="reference")
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).logits[mask.bool()]
    err = (logits - ref).abs().max().item()
    assert logits.shape == (b.num_tokens, 101) and err <= 1e-4, err


def v3_base_checkpoint(folder):
    """A random DeBERTa-v3-base-shaped checkpoint in Microsoft's layout: raw config.json ("p2c|c2p",
    no legacy / architectures), fp16 weights under `deberta.`, plus the extras Microsoft ships
    (absolute position table, lm_predictions and mask_predictions heads)."""
    from safetensors.torch import save_file

    from packedenc.convert.hf import to_state_dict

    from packedenc.pytree import tree_map_specs

    cfg = deberta.PRESETS["v3-base"]
    g = torch.Generator().manual_seed(0)

    def make(_, s):  # drawn in fp16 straight away: 184M values, no fp32 copy
        t = torch.empty(s.shape, dtype=torch.float16)
        return t.normal_(1.0 if s.init == "ones" else 0.0, 0.02 if s.init == "normal" else 0.05, generator=g)

    params = tree_map_specs(make, deberta.params_spec(cfg, heads=("mlm",)))
    sd, _ = to_state_dict(params)
    D = cfg.hidden_size
    sd["deberta.embeddings.position_embeddings.weight"] = torch.randn(512, D, generator=g).half()
    for k, shape in {"dense.weight": (D, D), "dense.bias": (D,), "LayerNorm.weight": (D,),
                     "LayerNorm.bias": (D,), "classifier.weight": (1, D), "classifier.bias": (1,)}.items():
        sd[f"mask_predictions.{k}"] = (torch.randn(shape, generator=g) * 0.02).half()
    save_file({k: v.contiguous() for k, v in sd.items()}, str(folder / "model.safetensors"))
    raw = {"model_type": "deberta-v2", "attention_probs_dropout_prob": 0.1, "hidden_act": "gelu",
           "hidden_dropout_prob": 0.1, "hidden_size": 768, "initializer_range": 0.02, "intermediate_size": 3072,
           "max_position_embeddings": 512, "relative_attention": True, "position_buckets": 256,
           "norm_rel_ebd": "layer_norm", "share_att_key": True, "pos_att_type": "p2c|c2p",
           "layer_norm_eps": 1e-7, "max_relative_positions": -1, "position_biased_input": False,
           "num_attention_heads": 12, "num_hidden_layers": 12, "type_vocab_size": 0, "vocab_size": 128100}
    (folder / "config.json").write_text(json.dumps(raw))


def test_v3_base_shaped_checkpoint_loads_and_encodes(tmp_path):
    """Real v3-base sizes (768 wide, 12 layers, vocab 128100, 256 buckets) through load / encode on
    three short sequences; the 130-token one (|d| up to 129: into the log buckets) against
    transformers in fp32."""
    v3_base_checkpoint(tmp_path)
    params = pe.load(tmp_path, dtype=torch.float32)
    cfg = params.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size, cfg.position_buckets) == (768, 12, 128100, 256)
    assert cfg.pos_att_type == ("p2c", "c2p") and params.lm_predictions is not None
    assert params.encoder.rel_embeddings.weight.shape == (512, 768)
    b, _, _, _ = batch([130, 1, 6], vocab=128100, seed=1)
    out = pe.encode(params, b.ids, b.cu_seqlens, b.max_seqlen)
    assert out.shape == (137, 768) and out.dtype == torch.float32
    model = transformers.DebertaV2Model.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():  # the long sequence alone (each HF call re-projects 12 x 512 table rows)
        want = model(input_ids=b.ids[None, :130]).last_hidden_state[0]
    err = (out[:130] - want).abs().max().item()
    assert err <= 1e-4, err
    assert torch.isfinite(out).all()


def test_gradients_match_hf(tmp_path):
    """encode is a pure function of the params: torch.func.grad of a loss on real tokens equals
    HF's .grad for every tensor (fused qkv split back by the converter), conv and rel-emb LN included."""
    from packedenc.convert.hf import to_state_dict

    model = save_tiny(tmp_path, transformers.DebertaV2Model, tiny_config(**CONFIGS["conv_xlarge"]))
    params = pe.load(tmp_path)
    b, ids, mask, _ = batch()
    target = torch.randn(b.num_tokens, 32, generator=torch.Generator().manual_seed(3))

    def loss(p):
        return ((pe.encode(p, b.ids, b.cu_seqlens, b.max_seqlen, backend="reference") - target) ** 2).sum()

    grads, _ = to_state_dict(torch.func.grad(loss)(params))
    model.zero_grad()
    ((model(input_ids=ids, attention_mask=mask).last_hidden_state[mask.bool()] - target) ** 2).sum().backward()
    hf_grads = {n: p.grad for n, p in model.named_parameters()}
    assert sorted(grads) == sorted(hf_grads)
    for n, g in grads.items():
        scale = hf_grads[n].abs().max().item()
        assert scale > 0 and (g - hf_grads[n]).abs().max().item() <= 1e-4 * max(1.0, scale), n
