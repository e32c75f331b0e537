"""BERT / RoBERTa / XLM-R packed (reference backend, fp32, CPU) against transformers' padded eager output.

Configs cover what changes the math: BERT with token types, RoBERTa's position offset past
padding_idx (with a pad id other than 1, so a wrong offset cannot pass by accident), XLM-R,
tanh-GELU and ReLU activations, a sequence that fills the whole position table, length-1
sequences and many sequences. Heads (pooler, MLM, sequence classification) and the converter
round trip are checked against the same HF classes.
"""

import dataclasses
import json

import pytest
import torch

import packedenc as pe
from packedenc.models import bert

transformers = pytest.importorskip("transformers")

LENGTHS = [1, 5, 40, 17, 9, 33, 2, 12, 64, 7]  # max 64 == the position table (BERT configs below)
VOCAB = 101

CONFIGS = {
    "bert": ("bert", dict(type_vocab_size=3)),
    "bert_tanh_gelu": ("bert", dict(hidden_act="gelu_new", layer_norm_eps=1e-7)),
    "roberta": ("roberta", dict(pad_token_id=1, max_position_embeddings=64 + 2)),
    "roberta_pad5": ("roberta", dict(pad_token_id=5, max_position_embeddings=64 + 6, type_vocab_size=1)),
    "xlm_roberta_relu": ("xlm-roberta", dict(pad_token_id=1, max_position_embeddings=64 + 2, hidden_act="relu")),
}
HF_CLASSES = {"bert": "Bert", "roberta": "Roberta", "xlm-roberta": "XLMRoberta"}


def hf_config(model_type, **overrides):
    kw = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=3, num_attention_heads=4,
              max_position_embeddings=64, attn_implementation="eager")
    kw.update(overrides)
    return getattr(transformers, HF_CLASSES[model_type] + "Config")(**kw)


def hf_class(model_type, suffix):
    return getattr(transformers, HF_CLASSES[model_type] + suffix)


def randomize(model):
    """HF init leaves norms at 1 and biases at 0; perturb everything so every param matters."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def make_batch(lengths=LENGTHS, pad_id=0, types=0, seed=0):
    """Packed batch + the same tokens right-padded for HF (ids avoid the pad id: RoBERTa
    counts positions over non-pad tokens)."""
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(pad_id + 1, VOCAB, (n,), generator=g) for n in lengths]
    tts = [torch.randint(0, max(types, 1), (n,), generator=g) for n in lengths]
    ids = torch.full((len(seqs), max(lengths)), pad_id, dtype=torch.long)
    tt = torch.zeros_like(ids)
    mask = torch.zeros_like(ids)
    for i, (s, t) in enumerate(zip(seqs, tts)):
        ids[i, : len(s)], tt[i, : len(s)], mask[i, : len(s)] = s, t, 1
    return pe.pack(seqs), torch.cat(tts), ids, tt, mask


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_encode_matches_hf(tmp_path, name):
    model_type, overrides = CONFIGS[name]
    cfg = hf_config(model_type, **overrides)
    hf = randomize(hf_class(model_type, "Model")(cfg))
    hf.save_pretrained(tmp_path)
    params = pe.load(tmp_path)
    assert isinstance(params, bert.BertParams) and params.config.model_type == model_type
    packed, tt_packed, ids, tt, mask = make_batch(pad_id=cfg.pad_token_id or 0, types=cfg.type_vocab_size)
    use_tt = model_type == "bert"
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask, token_type_ids=tt if use_tt else None)
    out = pe.encode(params, packed.ids, packed.cu_seqlens, packed.max_seqlen,
                    token_type_ids=tt_packed if use_tt else None, backend="reference")
    torch.testing.assert_close(out, ref.last_hidden_state[mask.bool()], atol=2e-5, rtol=1e-5)
    pooled = bert.pooler(params, out, packed.cu_seqlens, backend="reference")
    torch.testing.assert_close(pooled, ref.pooler_output, atol=2e-5, rtol=1e-5)


def test_token_types_change_the_output(tmp_path):
    """Token types must reach the embeddings: all-ones types differ from the default all-zeros."""
    hf = randomize(transformers.BertModel(hf_config("bert")))
    hf.save_pretrained(tmp_path)
    params = pe.load(tmp_path)
    b = pe.pack([[5, 6, 7, 8]])
    zeros = pe.encode(params, b.ids, b.cu_seqlens, backend="reference")
    same = pe.encode(params, b.ids, b.cu_seqlens, token_type_ids=torch.zeros(4, dtype=torch.long), backend="reference")
    ones = pe.encode(params, b.ids, b.cu_seqlens, token_type_ids=torch.ones(4, dtype=torch.long), backend="reference")
    torch.testing.assert_close(zeros, same, atol=0, rtol=0)
    assert (zeros - ones).abs().max() > 1e-3


@pytest.mark.parametrize("model_type", ["bert", "roberta"])
def test_sequences_do_not_interact(tmp_path, model_type):
    """Packing a sequence next to others leaves its output unchanged (positions restart, no leakage)."""
    hf = randomize(hf_class(model_type, "Model")(hf_config(model_type, pad_token_id=1, max_position_embeddings=70)))
    hf.save_pretrained(tmp_path)
    params = pe.load(tmp_path)
    alone = pe.pack([[7, 8, 9, 10, 11]])
    many = pe.pack([[20, 21, 22], [7, 8, 9, 10, 11], [30] * 9])
    a = pe.encode(params, alone.ids, alone.cu_seqlens, backend="reference")
    m = pe.encode(params, many.ids, many.cu_seqlens, backend="reference")
    torch.testing.assert_close(m[3:8], a, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("model_type", ["bert", "roberta", "xlm-roberta"])
def test_mlm_logits_match_hf(tmp_path, model_type):
    cfg = hf_config(model_type, pad_token_id=1, max_position_embeddings=70)
    hf = randomize(hf_class(model_type, "ForMaskedLM")(cfg))
    hf.save_pretrained(tmp_path)
    params = pe.load(tmp_path)
    assert params.mlm is not None and params.pooler is None  # ForMaskedLM has no pooler
    packed, _, ids, _, mask = make_batch([3, 11, 6], pad_id=1)
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask).logits[mask.bool()]
    hidden = pe.encode(params, packed.ids, packed.cu_seqlens, backend="reference")
    torch.testing.assert_close(bert.mlm_logits(params, hidden, backend="reference"), ref, atol=3e-5, rtol=1e-5)
    # the MLM loss takes the fused cross-entropy through `mlm_head` (never an (M, V) fp32 logits tensor)
    from packedenc.train import losses

    pos, tgt = torch.tensor([0, 4, 9, 13]), torch.tensor([5, -100, 17, 2])
    got = losses.mlm_token_losses(params, hidden, pos, tgt, backend="reference")
    want = torch.nn.functional.cross_entropy(ref[pos].float(), tgt, reduction="none")
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("model_type", ["bert", "roberta", "xlm-roberta"])
def test_classifier_matches_hf(tmp_path, model_type):
    cfg = hf_config(model_type, pad_token_id=1, max_position_embeddings=70, num_labels=3)
    hf = randomize(hf_class(model_type, "ForSequenceClassification")(cfg))
    hf.save_pretrained(tmp_path)
    params = pe.load(tmp_path)
    packed, _, ids, _, mask = make_batch([3, 11, 6, 1], pad_id=1)
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask).logits
    hidden = pe.encode(params, packed.ids, packed.cu_seqlens, backend="reference")
    out = bert.classify(params, hidden, packed.cu_seqlens, backend="reference")
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("cls_suffix", ["Model", "ForMaskedLM", "ForSequenceClassification"])
@pytest.mark.parametrize("model_type", ["bert", "roberta"])
def test_save_round_trip(tmp_path, model_type, cls_suffix):
    """HF -> params -> HF keeps every tensor bit-identical, and transformers loads the export."""
    cfg = hf_config(model_type, pad_token_id=1, max_position_embeddings=70, num_labels=2)
    hf = randomize(hf_class(model_type, cls_suffix)(cfg))
    hf.save_pretrained(tmp_path / "src")
    params = pe.load(tmp_path / "src")
    pe.save(params, tmp_path / "dst")
    again = hf_class(model_type, cls_suffix).from_pretrained(tmp_path / "dst", attn_implementation="eager").eval()
    sd_a, sd_b = hf.state_dict(), again.state_dict()
    assert sd_a.keys() == sd_b.keys()
    for k in sd_a:
        assert torch.equal(sd_a[k], sd_b[k]), k
    assert json.loads((tmp_path / "dst" / "config.json").read_text())["architectures"] == [
        HF_CLASSES[model_type] + cls_suffix]


def test_init_and_presets():
    params = pe.init(bert.PRESETS["tiny"], torch.Generator().manual_seed(0))
    b = pe.pack([[1, 2, 3], [4]])
    out = pe.encode(params, b.ids, b.cu_seqlens, backend="reference")
    assert out.shape == (4, 32) and torch.isfinite(out).all()
    cfg = bert.BertConfig(model_type="roberta", pad_token_id=1, max_position_embeddings=514,
                          architectures=("RobertaModel",))
    assert cfg.position_offset == 2 and cfg.max_positions == 512
    assert bert.BertConfig.from_hf(cfg.to_hf()) == cfg


# ---- bad input ---------------------------------------------------------------------------------


def test_too_long_sequence_is_an_input_error(tmp_path):
    hf = randomize(transformers.RobertaModel(hf_config("roberta", pad_token_id=1, max_position_embeddings=10)))
    hf.save_pretrained(tmp_path)
    params = pe.load(tmp_path)
    b = pe.pack([list(range(3, 12))])  # 9 tokens, 8 positions after the offset of 2
    # the bound stated is the one that holds: 10 rows less RoBERTa's offset of pad_token_id + 1 = 2
    with pytest.raises(pe.InputError, match=r"max_seqlen=9, but .*max_position_embeddings=10, less pad_token_id "
                                            r"\+ 1 = 2\) allows sequences of at most 8 tokens"):
        pe.encode(params, b.ids, b.cu_seqlens, backend="reference")
    b8 = pe.pack([list(range(3, 11))])  # exactly 8 tokens: fits
    assert pe.encode(params, b8.ids, b8.cu_seqlens, backend="reference").shape == (8, params.config.hidden_size)


def test_bad_token_types(tmp_path):
    params = pe.init(bert.PRESETS["tiny"])
    b = pe.pack([[1, 2, 3]])
    with pytest.raises(pe.InputError, match="outside"):
        pe.encode(params, b.ids, b.cu_seqlens, token_type_ids=torch.tensor([0, 2, 0]), backend="reference")
    with pytest.raises(pe.InputError, match="shaped like ids"):
        pe.encode(params, b.ids, b.cu_seqlens, token_type_ids=torch.tensor([0, 1]), backend="reference")


@pytest.mark.parametrize("flag,value,match", [
    ("position_embedding_type", "relative_key", "absolute positions only"),
    ("is_decoder", True, "bidirectional"),
    ("hidden_act", "swishy", "not supported"),
])
def test_unsupported_config(flag, value, match):
    d = hf_config("bert").to_dict()
    d[flag] = value
    with pytest.raises(pe.ConfigError, match=match):
        bert.BertConfig.from_hf(d)


def test_missing_head_errors():
    params = pe.init(bert.PRESETS["tiny"], heads=())
    h = torch.zeros(3, 32)
    with pytest.raises(pe.ConfigError, match="no MLM head"):
        bert.mlm_logits(params, h)
    with pytest.raises(pe.ConfigError, match="no pooler"):
        bert.pooler(params, h, torch.tensor([0, 3], dtype=torch.int32))


# ---- training switches (as ModernBERT's): compute dtype, seeded dropout, layer checkpointing ------


def test_compute_dtype_dropout_and_checkpoint():
    params = pe.init(bert.PRESETS["tiny"], torch.Generator().manual_seed(0))
    b = pe.pack([[5, 6, 7, 8, 9], [10, 11]])
    enc = lambda **k: pe.encode(params, b.ids, b.cu_seqlens, backend="reference", **k)  # noqa: E731
    plain = enc()
    half = enc(compute_dtype=torch.bfloat16)
    assert half.dtype == torch.bfloat16 and params.layers[0].attention.qkv.weight.dtype == torch.float32
    assert torch.nn.functional.cosine_similarity(half.float(), plain).min() > 0.99
    a, a2, other = enc(dropout_seed=1), enc(dropout_seed=1), enc(dropout_seed=2)
    assert torch.equal(a, a2) and not torch.allclose(a, other) and not torch.allclose(a, plain)

    def grads(checkpoint):
        leaves = [params.layers[0].attention.qkv.weight.detach().requires_grad_()]
        p = dataclasses.replace(params, layers=(dataclasses.replace(params.layers[0], attention=dataclasses.replace(
            params.layers[0].attention, qkv=pe.pytree.Linear(leaves[0], params.layers[0].attention.qkv.bias))),
            *params.layers[1:]))
        out = pe.encode(p, b.ids, b.cu_seqlens, backend="reference", dropout_seed=3, checkpoint=checkpoint)
        out.square().sum().backward()
        return leaves[0].grad

    torch.testing.assert_close(grads(True), grads(False), atol=0, rtol=0)


def test_attention_dropout_needs_the_reference_attention():
    params = pe.init(bert.PRESETS["tiny"])
    ops = pe.get_ops("reference")
    fake_flash = dataclasses.replace(ops, chosen=tuple((o, "flash" if o == "varlen_attention" else b)
                                                       for o, b in ops.chosen))
    b = pe.pack([[5, 6, 7]])
    with pytest.raises(pe.ConfigError, match="attention_probs_dropout_prob"):
        pe.encode(params, b.ids, b.cu_seqlens, backend=fake_flash, dropout_seed=0)
