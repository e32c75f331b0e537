"""The CuteDSL compile cache (`kernels/cute/compile_cache.py`): compiled kernels on disk.

CPU, with fake export / load (no cutlass needed): a miss compiles and writes one entry, the next
process loads it without compiling; a bad entry is recompiled and replaced; a new kernel source,
tool version or architecture is a new folder; `off` writes nothing; a crash while exporting
leaves no partial entry; an unwritable folder costs a warning, not the call. Where nvidia-cutlass-dsl
is installed (no GPU needed): the real GeGLU GEMM compiled for sm_90a in one process is loaded by
the next. GPU (`gpu` + `cute`): a loaded kernel computes what a compiled one does.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from packedenc.kernels.cute import compile_cache as CC
from tests.kernels._assert import HAS_CUTLASS, skip_without_cute

ROOT = Path(__file__).resolve().parents[2]


class FakeCute:
    """export writes the kernel's name into the object file; load reads it back (or fails)."""

    def __init__(self):
        self.compiled = self.loaded = 0

    def compile(self, name="k1"):
        def run():
            self.compiled += 1
            return name

        return run

    def export(self, fn, folder: Path, stem: str) -> Path:
        (folder / f"{stem}.h").write_text("header")
        (folder / f"{stem}.o").write_text(fn)
        (folder / f"{stem}.h").unlink()
        return folder / f"{stem}.o"

    def load(self, path: Path):
        text = path.read_text()
        if not text.startswith("k"):
            raise RuntimeError("not an object file")
        self.loaded += 1
        return text


@pytest.fixture
def src(tmp_path):
    f = tmp_path / "kernel.py"
    f.write_text("the kernel's source")
    return f


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv(CC.ENV, str(root))
    CC.fingerprint.cache_clear()
    yield root
    CC.fingerprint.cache_clear()


def _get(fake, src, key=("bf16", 768, 1152), name="k1", versions=("cutlass=4.8.1",), arch="sm_90a"):
    return CC.load_or_compile(key, (src,), fake.compile(name), versions=versions, arch=arch,
                              export=fake.export, load=fake.load)


def _entries(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def test_a_miss_compiles_and_writes_one_entry_the_next_process_loads_it(cache, src):
    fake = FakeCute()
    assert _get(fake, src) == ("k1", "compiled")
    (entry,) = _entries(cache)
    assert entry.suffix == ".o" and entry.read_text() == "k1"
    assert _get(fake, src) == ("k1", "loaded") and (fake.compiled, fake.loaded) == (1, 1)
    assert _get(fake, src, key=("bf16", 1024, 2624), name="k2") == ("k2", "compiled")  # another key
    assert len(_entries(cache)) == 2 and fake.compiled == 2


def test_a_bad_entry_is_a_miss_and_is_replaced(cache, src):
    fake = FakeCute()
    _get(fake, src)
    (entry,) = _entries(cache)
    entry.write_text("")  # truncated by a full disk
    assert _get(fake, src) == ("k1", "compiled")
    assert entry.read_text() == "k1" and _get(fake, src)[1] == "loaded"


@pytest.mark.parametrize("change", ["source", "versions", "arch"])
def test_a_new_source_version_or_architecture_is_a_new_folder(cache, src, change):
    fake = FakeCute()
    _get(fake, src)
    if change == "source":
        src.write_text("an edited kernel")
        CC.fingerprint.cache_clear()  # once per process in real use
        again = _get(fake, src)
    elif change == "versions":
        again = _get(fake, src, versions=("cutlass=4.9.0",))
    else:
        again = _get(fake, src, arch="sm_100a")
    assert again == ("k1", "compiled")
    assert len({p.parent for p in _entries(cache)}) == 2


def test_off_compiles_every_time_and_writes_nothing(tmp_path, src, monkeypatch):
    for value in ("off", "0", "false"):
        monkeypatch.setenv(CC.ENV, value)
        assert CC.cache_dir() is None
        fake = FakeCute()
        assert _get(fake, src) == ("k1", "compiled, cache off")
    assert not any(tmp_path.rglob("*.o"))


def test_the_default_folder_is_the_user_cache(monkeypatch, tmp_path):
    monkeypatch.delenv(CC.ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert CC.cache_dir() == tmp_path / "packedenc" / "cute"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert CC.cache_dir() == Path.home() / ".cache" / "packedenc" / "cute"


def test_a_crash_while_exporting_leaves_no_partial_entry(cache, src):
    fake = FakeCute()

    def dying_export(fn, folder, stem):
        (folder / f"{stem}.o").write_text("k1-half")  # killed mid-write
        raise OSError("No space left on device")

    with pytest.warns(RuntimeWarning, match="cannot be written"):
        fn, how = CC.load_or_compile(("k",), (src,), fake.compile(), versions=("v",), arch="a",
                                     export=dying_export, load=fake.load)
    assert fn == "k1" and how.startswith("compiled, not cached: OSError")
    assert _entries(cache) == []  # neither the temporary file nor an entry


def test_an_existing_entry_is_only_ever_replaced_whole(cache, src):
    fake = FakeCute()
    _get(fake, src)
    (entry,) = _entries(cache)
    entry.write_text("corrupt")
    seen = []

    def watching_export(fn, folder, stem):  # the old entry is still there while the new one is written
        seen.append(entry.read_text())
        return fake.export(fn, folder, stem)

    CC.load_or_compile(("bf16", 768, 1152), (src,), fake.compile(), versions=("cutlass=4.8.1",), arch="sm_90a",
                       export=watching_export, load=fake.load)
    assert seen == ["corrupt"] and entry.read_text() == "k1"


def test_two_threads_exporting_one_key_leave_a_whole_entry(cache, src):
    import threading
    import time

    fake, barrier = FakeCute(), threading.Barrier(2)

    def slow_export(fn, folder, stem):  # both threads write at once, in two halves
        path = folder / f"{stem}.o"
        with open(path, "w") as f:
            barrier.wait()
            f.write(fn[:1])
            f.flush()
            time.sleep(0.05)
            f.write(fn[1:])
        return path

    hows = []

    def get():
        hows.append(CC.load_or_compile(("k",), (src,), fake.compile("k" + "x" * 4096), versions=("v",), arch="a",
                                       export=slow_export, load=fake.load)[1])

    threads = [threading.Thread(target=get) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    (entry,) = _entries(cache)
    assert entry.read_text() == "k" + "x" * 4096
    assert hows == ["compiled", "compiled"]  # each wrote its own temporary file and renamed it: no clash


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes anywhere")
def test_an_unwritable_folder_warns_and_still_returns_the_kernel(tmp_path, src, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    monkeypatch.setenv(CC.ENV, str(ro / "cache"))
    with pytest.warns(RuntimeWarning, match="cannot be written"):
        assert _get(FakeCute(), src)[0] == "k1"


def test_a_cache_path_that_is_a_file_warns_and_still_returns_the_kernel(tmp_path, src, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not ours")
    monkeypatch.setenv(CC.ENV, str(blocker))
    with pytest.warns(RuntimeWarning, match="cannot be written"):
        assert _get(FakeCute(), src)[0] == "k1"
    assert blocker.read_text() == "not ours"  # nothing that is not ours is touched


# ---- the real GeGLU GEMM: compiled for sm_90a in one process, loaded by the next (no GPU) -----------

_PROCESS = """
import time, torch
t0 = time.perf_counter()
from packedenc.kernels.cute import geglu_gemm as G
key = (torch.bfloat16, 768, 1152, G.DEFAULT_TILE)
fn = G.compiled(*key[:3])
print("HOW", G.HOW[key], type(fn).__name__)
"""


@pytest.mark.skipif(not HAS_CUTLASS, reason="nvidia-cutlass-dsl is not installed")
def test_the_geglu_gemm_compiled_in_one_process_is_loaded_by_the_next(tmp_path):
    env = {**os.environ, "CUTE_DSL_ARCH": "sm_90a", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), CC.ENV: str(tmp_path / "c")}
    outs = [subprocess.run([sys.executable, "-c", _PROCESS], env=env, capture_output=True, text=True, timeout=300)
            for _ in range(2)]
    for r in outs:
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "HOW compiled" in outs[0].stdout and "HOW loaded" in outs[1].stdout, (outs[0].stdout, outs[1].stdout)
    assert len(list((tmp_path / "c").rglob("*.o"))) == 1


# ---- GPU: the loaded kernel is the compiled one -------------------------------------------------------

_GPU_PROCESS = """
import sys, time, torch
from packedenc.kernels.cute import geglu_gemm as G
torch.manual_seed(0)
x = torch.randn(1000, 768, device="cuda", dtype=torch.bfloat16)
w = torch.randn(2304, 768, device="cuda", dtype=torch.bfloat16) * 768 ** -0.5
t0 = time.perf_counter()
G.compiled(torch.bfloat16, 768, 1152)
ready = time.perf_counter() - t0
out = G.geglu(x, w)
torch.cuda.synchronize()
torch.save(out.cpu(), sys.argv[1])
print("HOW", G.HOW[(torch.bfloat16, 768, 1152, G.DEFAULT_TILE)], f"{ready:.3f}")
"""


@pytest.mark.gpu
@pytest.mark.cute
def test_gpu_a_loaded_geglu_gemm_computes_what_the_compiled_one_does(tmp_path):
    skip_without_cute(lambda cap: cap[0] == 9, "the GeGLU GEMM is sm90a (Hopper) only")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           CC.ENV: str(tmp_path / "c")}
    runs = []
    for i in range(2):
        out = tmp_path / f"out{i}.pt"
        r = subprocess.run([sys.executable, "-c", _GPU_PROCESS, str(out)], env=env, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
        how, seconds = r.stdout.split("HOW ", 1)[1].split()
        runs.append((how, float(seconds), torch.load(out)))
    assert [h for h, _, _ in runs] == ["compiled", "loaded"]
    assert torch.equal(runs[0][2], runs[1][2])  # the same binary: bit for bit
    assert runs[1][1] < runs[0][1]  # loading is faster than compiling
    print(f"geglu_gemm ready in {runs[0][1]:.3f} s compiled, {runs[1][1]:.3f} s loaded")


def test_the_warm_command_refuses_a_width_the_kernel_does_not_take(capsys):
    from packedenc.kernels.cute.__main__ import main

    for bad in ("7:9", "768", "768:x", "0:1152"):
        with pytest.raises(SystemExit) as e:
            main(["--geglu", bad])
        assert e.value.code == 2 and "two positive multiples of 8" in capsys.readouterr().err
