"""HF -> params -> HF for DeBERTa-v2/v3: bit-identical tensors (the fused q|k|v leaf splits back
exactly), transformers loads the export to the same outputs, mDeBERTa-sized vocabularies, fp16
weights, Microsoft's extra tensors skipped and anything else named."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import packedenc as pe
from packedenc.models import deberta
from packedenc.pytree import named_leaves
from tests.models.test_deberta_vs_hf import CONFIGS, batch, save_tiny, tiny_config

transformers = pytest.importorskip("transformers")

CASES = {
    # bare backbone, v3 layout (keys without the deberta. prefix)
    "model_v3": ("DebertaV2Model", CONFIGS["v3"]),
    # classifier over the conv (v2-xlarge) layout, 3 labels
    "seqcls_conv": ("DebertaV2ForSequenceClassification", dict(CONFIGS["conv_xlarge"], num_labels=3)),
    # Microsoft's MLM head, separate position projections, absolute positions and token types
    "mlm_lm_predictions": ("DebertaV2ForMaskedLM", dict(CONFIGS["c2p_separate_abs_types"], legacy=False)),
    # transformers' default (legacy) MLM head, untied decoder, embed_proj
    "mlm_legacy_untied": ("DebertaV2ForMaskedLM", dict(CONFIGS["p2c_nobuckets_embproj"], tie_word_embeddings=False)),
    # mDeBERTa-v3 vocabulary size (251000 rows)
    "mdeberta_vocab": ("DebertaV2Model", dict(CONFIGS["v3"], vocab_size=251000)),
}


def _outputs(model, ids, mask):
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask)
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out.logits


@pytest.mark.parametrize("case", sorted(CASES))
def test_round_trip_bit_identical_and_loads_in_transformers(tmp_path, case):
    cls_name, overrides = CASES[case]
    cls = getattr(transformers, cls_name)
    src, dst = tmp_path / "src", tmp_path / "dst"
    hf = save_tiny(src, cls, tiny_config(**overrides))
    params = pe.load(src)
    pe.save(params, dst)

    original, exported = load_file(src / "model.safetensors"), load_file(dst / "model.safetensors")
    assert sorted(original) == sorted(exported)
    for k, v in original.items():
        assert v.dtype == exported[k].dtype and torch.equal(v, exported[k]), k
    saved_cfg = json.loads((dst / "config.json").read_text())
    assert saved_cfg["architectures"] == [cls_name]
    assert deberta.DebertaConfig.from_hf(params.config.to_hf()) == params.config

    again = cls.from_pretrained(dst).eval()
    _, ids, mask, _ = batch(vocab=overrides.get("vocab_size", 101))
    assert torch.equal(_outputs(hf.eval(), ids, mask), _outputs(again, ids, mask))
    back = pe.load(dst)  # and packedenc reads its own export back to the same tree
    for (n1, t1), (n2, t2) in zip(named_leaves(params), named_leaves(back)):
        assert n1 == n2 and torch.equal(t1, t2)


def test_fp16_weights_stay_fp16_bit_for_bit(tmp_path):
    hf = save_tiny(tmp_path / "src", transformers.DebertaV2Model, tiny_config(**CONFIGS["v3"]))
    hf.half().save_pretrained(tmp_path / "half")
    params = pe.load(tmp_path / "half")
    assert {t.dtype for t in pe.pytree.tree_leaves(params)} == {torch.float16}
    pe.save(params, tmp_path / "dst")
    a, b = load_file(tmp_path / "half" / "model.safetensors"), load_file(tmp_path / "dst" / "model.safetensors")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) and b[k].dtype == torch.float16 for k in a)


def _write(folder, sd, config):
    folder.mkdir()
    save_file(sd, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(config))


def test_microsoft_extras_are_skipped_and_others_named(tmp_path):
    """A checkpoint laid out like microsoft/deberta-v3-*: `deberta.` prefix, raw "p2c|c2p" config
    without legacy / architectures, an unused absolute position table, the RTD head, old buffers."""
    save_tiny(tmp_path / "ok", transformers.DebertaV2ForMaskedLM, tiny_config(**CONFIGS["v3"], legacy=False))
    sd = load_file(tmp_path / "ok" / "model.safetensors")
    config = json.loads((tmp_path / "ok" / "config.json").read_text())
    for k in ("legacy", "architectures", "dtype", "transformers_version"):
        config.pop(k)
    config["pos_att_type"] = "p2c|c2p"
    extras = {
        "deberta.embeddings.position_embeddings.weight": torch.randn(512, 32),
        "deberta.embeddings.position_ids": torch.arange(512)[None],
        "mask_predictions.dense.weight": torch.randn(32, 32),
        "mask_predictions.LayerNorm.bias": torch.randn(32),
        "mask_predictions.classifier.weight": torch.randn(1, 32),
    }
    _write(tmp_path / "ms", dict(sd, **extras), config)
    params = pe.load(tmp_path / "ms")
    assert params.config.pos_att_type == ("p2c", "c2p") and params.lm_predictions is not None
    assert params.embeddings.position_embeddings is None  # position_biased_input=false: not read
    b, _, _, _ = batch()
    want = pe.encode(pe.load(tmp_path / "ok"), b.ids, b.cu_seqlens)
    assert torch.equal(pe.encode(params, b.ids, b.cu_seqlens), want)

    # the export drops the extras and sets legacy=False so DebertaV2ForMaskedLM builds lm_predictions
    pe.save(params, tmp_path / "dst")
    saved = json.loads((tmp_path / "dst" / "config.json").read_text())
    assert saved["legacy"] is False and saved["architectures"] == ["DebertaV2ForMaskedLM"]
    assert sorted(load_file(tmp_path / "dst" / "model.safetensors")) == sorted(sd)

    _write(tmp_path / "unknown", dict(sd, **extras, **{"deberta.encoder.layer.1.attention.self.foo": torch.zeros(2)}),
           config)
    with pytest.raises(pe.CheckpointError, match=r"unexpected.*deberta\.encoder\.layer\.1\.attention\.self\.foo"):
        pe.load(tmp_path / "unknown")


def test_bad_checkpoints_name_the_key(tmp_path):
    save_tiny(tmp_path / "ok", transformers.DebertaV2Model, tiny_config(**CONFIGS["conv_k5_groups_separate"]))
    sd = load_file(tmp_path / "ok" / "model.safetensors")
    config = json.loads((tmp_path / "ok" / "config.json").read_text())

    missing = dict(sd)
    missing.pop("encoder.layer.2.attention.self.value_proj.bias")
    _write(tmp_path / "missing", missing, config)
    with pytest.raises(pe.CheckpointError, match=r"missing.*encoder\.layer\.2\.attention\.self\.value_proj\.bias"):
        pe.load(tmp_path / "missing")

    shaped = dict(sd, **{"encoder.conv.conv.weight": torch.zeros(32, 16, 3)})
    _write(tmp_path / "shape", shaped, config)
    with pytest.raises(pe.CheckpointError, match=r"encoder\.conv\.conv\.weight.*\(32, 16, 3\).*\(32, 16, 5\)"):
        pe.load(tmp_path / "shape")

    # config says shared position projections, weights carry separate ones: named as unexpected
    _write(tmp_path / "flag", sd, dict(config, share_att_key=True))
    with pytest.raises(pe.CheckpointError, match=r"unexpected.*pos_key_proj"):
        pe.load(tmp_path / "flag")

    # the other way round: separate projections expected, absent from the weights
    save_tiny(tmp_path / "shared", transformers.DebertaV2Model, tiny_config(**CONFIGS["v3"]))
    shared = load_file(tmp_path / "shared" / "model.safetensors")
    cfg2 = json.loads((tmp_path / "shared" / "config.json").read_text())
    _write(tmp_path / "flag2", shared, dict(cfg2, share_att_key=False))
    with pytest.raises(pe.CheckpointError, match=r"missing.*pos_(key|query)_proj"):
        pe.load(tmp_path / "flag2")
