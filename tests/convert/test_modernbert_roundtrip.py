"""HF -> params -> HF for ModernBERT: bit-identical tensors, transformers loads the export, every
checkpoint layout loads (single, sharded, .bin, prefixes), and bad checkpoints fail clearly."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import packedenc as pe
from packedenc.convert import hf as convert_hf
from tests.models.test_modernbert_vs_hf import batch, save_tiny, tiny_config

transformers = pytest.importorskip("transformers")


def hf_hidden(model, ids, mask):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).last_hidden_state[mask.bool()]


@pytest.mark.parametrize("cls", ["ModernBertModel", "ModernBertForMaskedLM", "ModernBertForSequenceClassification"])
def test_round_trip_bit_identical_and_loads_in_transformers(tmp_path, cls):
    src, dst = tmp_path / "src", tmp_path / "dst"
    cfg = tiny_config(local_attention=8, attention_bias=True, norm_bias=True, num_labels=3)
    hf = save_tiny(src, getattr(transformers, cls), cfg)
    params = pe.load(src)
    pe.save(params, dst)

    original = load_file(src / "model.safetensors")
    exported = load_file(dst / "model.safetensors")
    original.pop("decoder.weight", None)  # tied copy; HF re-ties it on load
    assert sorted(original) == sorted(exported)
    for k, v in original.items():
        assert v.dtype == exported[k].dtype and torch.equal(v, exported[k]), k

    again = getattr(transformers, cls).from_pretrained(dst, attn_implementation="eager").eval()
    _, ids, mask = batch()
    with torch.no_grad():
        a, b = hf(input_ids=ids, attention_mask=mask), again(input_ids=ids, attention_mask=mask)
    key = "last_hidden_state" if cls == "ModernBertModel" else "logits"
    assert torch.equal(getattr(a, key), getattr(b, key))
    # and packedenc reads its own export back to the same tree
    back = pe.load(dst)
    for (n1, t1), (n2, t2) in zip(pe.pytree.named_leaves(params), pe.pytree.named_leaves(back)):
        assert n1 == n2 and torch.equal(t1, t2)


def test_automodel_loads_task_export(tmp_path):
    save_tiny(tmp_path / "src", transformers.ModernBertForMaskedLM, tiny_config())
    pe.save(pe.load(tmp_path / "src"), tmp_path / "dst")
    base = transformers.AutoModel.from_pretrained(tmp_path / "dst")
    assert type(base).__name__ == "ModernBertModel"
    assert json.loads((tmp_path / "dst" / "config.json").read_text())["architectures"] == ["ModernBertForMaskedLM"]


def _reference_out(folder):
    packed, _, _ = batch()
    return pe.encode(pe.load(folder), packed.ids, packed.cu_seqlens, packed.max_seqlen)


def test_prefixes_sharded_and_bin(tmp_path):
    hf = save_tiny(tmp_path / "plain", transformers.ModernBertModel, tiny_config(local_attention=8))
    want = _reference_out(tmp_path / "plain")
    sd = load_file(tmp_path / "plain" / "model.safetensors")
    config = (tmp_path / "plain" / "config.json").read_text()

    # nested sentence-transformers CrossEncoder style prefix
    nested = tmp_path / "nested"
    nested.mkdir()
    save_file({f"0.model.{k}": v for k, v in sd.items()}, nested / "model.safetensors")
    (nested / "config.json").write_text(config)
    assert torch.equal(_reference_out(nested), want)

    # sharded: transformers writes model.safetensors.index.json + shards
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    assert torch.equal(_reference_out(tmp_path / "sharded"), want)

    # pytorch_model.bin fallback (read with weights_only=True)
    binf = tmp_path / "bin"
    binf.mkdir()
    torch.save(sd, binf / "pytorch_model.bin")
    (binf / "config.json").write_text(config)
    assert torch.equal(_reference_out(binf), want)


def test_load_dtype(tmp_path):
    save_tiny(tmp_path, transformers.ModernBertModel, tiny_config())
    params = pe.load(tmp_path, dtype=torch.bfloat16)
    assert {t.dtype for t in pe.pytree.tree_leaves(params)} == {torch.bfloat16}


def _write(folder, sd, config):
    folder.mkdir()
    save_file(sd, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(config))


def test_bad_checkpoints_name_the_key(tmp_path):
    save_tiny(tmp_path / "ok", transformers.ModernBertModel, tiny_config())
    sd = load_file(tmp_path / "ok" / "model.safetensors")
    config = json.loads((tmp_path / "ok" / "config.json").read_text())

    missing = dict(sd)
    missing.pop("layers.1.mlp.Wo.weight")
    _write(tmp_path / "missing", missing, config)
    with pytest.raises(pe.CheckpointError, match=r"missing.*layers\.1\.mlp\.Wo\.weight"):
        pe.load(tmp_path / "missing")

    extra = dict(sd, **{"layers.1.mlp.extra.weight": torch.zeros(2)})
    _write(tmp_path / "extra", extra, config)
    with pytest.raises(pe.CheckpointError, match=r"unexpected.*layers\.1\.mlp\.extra\.weight"):
        pe.load(tmp_path / "extra")

    shaped = dict(sd, **{"layers.2.attn.Wo.weight": torch.zeros(32, 31)})
    _write(tmp_path / "shape", shaped, config)
    with pytest.raises(pe.CheckpointError, match=r"layers\.2\.attn\.Wo\.weight.*\(32, 31\).*\(32, 32\)"):
        pe.load(tmp_path / "shape")

    # config says biases, weights have none: named as missing keys with the likely cause
    _write(tmp_path / "flag", sd, dict(config, attention_bias=True))
    with pytest.raises(pe.CheckpointError, match=r"Wqkv\.bias.*config flag"):
        pe.load(tmp_path / "flag")


def test_bad_configs_and_folders(tmp_path):
    save_tiny(tmp_path / "ok", transformers.ModernBertModel, tiny_config())
    sd = load_file(tmp_path / "ok" / "model.safetensors")
    config = json.loads((tmp_path / "ok" / "config.json").read_text())

    _write(tmp_path / "type", sd, dict(config, model_type="gpt2"))
    with pytest.raises(pe.ConfigError, match="unsupported model_type 'gpt2'"):
        pe.load(tmp_path / "type")

    yarn = {"full_attention": {"rope_type": "yarn", "rope_theta": 1.0, "factor": 2.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1.0}}
    _write(tmp_path / "yarn", sd, dict(config, rope_parameters=yarn))
    with pytest.raises(pe.ConfigError, match="rope_type 'yarn'"):
        pe.load(tmp_path / "yarn")

    _write(tmp_path / "act", sd, dict(config, hidden_activation="mish2"))
    with pytest.raises(pe.ConfigError, match="activation 'mish2'"):
        pe.load(tmp_path / "act")

    (tmp_path / "empty").mkdir()
    with pytest.raises(pe.CheckpointError, match="no config.json"):
        pe.load(tmp_path / "empty")
    (tmp_path / "empty" / "config.json").write_text(json.dumps(config))
    with pytest.raises(pe.CheckpointError, match="no weights"):
        pe.load(tmp_path / "empty")
    with pytest.raises(pe.CheckpointError, match="does not exist"):
        pe.load(tmp_path / "nope")


def test_hub_id_offline_not_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    with pytest.raises(pe.CheckpointError, match=r"neither a local folder nor in the Hugging Face cache.*HF_HUB_OFFLINE"):
        pe.load("answerdotai/ModernBERT-base")


def test_save_failure_leaves_nothing_half_written(tmp_path, monkeypatch):
    save_tiny(tmp_path / "src", transformers.ModernBertModel, tiny_config())
    params = pe.load(tmp_path / "src")
    pe.save(params, tmp_path / "dst")
    before = (tmp_path / "dst" / "model.safetensors").read_bytes()

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(convert_hf.json, "dumps", boom)  # fails after the weights were written
    with pytest.raises(OSError, match="disk full"):
        pe.save(params, tmp_path / "dst")
    assert (tmp_path / "dst" / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst", "src"]  # no temp folder left
    with pytest.raises(OSError):
        pe.save(params, tmp_path / "new")
    assert not (tmp_path / "new").exists()


def test_convert_cli(tmp_path):
    save_tiny(tmp_path / "src", transformers.ModernBertModel, tiny_config())
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    r = subprocess.run([sys.executable, "-m", "packedenc.cli", "convert", str(tmp_path / "src"), str(tmp_path / "dst"),
                        "--dtype", "bf16"], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert "ModernBertParams" in r.stdout
    assert load_file(tmp_path / "dst" / "model.safetensors")["final_norm.weight"].dtype == torch.bfloat16
    r = subprocess.run([sys.executable, "-m", "packedenc.cli", "convert", str(tmp_path / "missing"), str(tmp_path / "x")],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 3 and "does not exist" in r.stderr  # a model problem: exit code 3, one line
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
