"""The training examples run end to end on the CPU with a tiny model: the loss goes down (the
scripts exit non-zero otherwise) and the saved folder loads in transformers."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name, steps", [("finetune_contrastive", 30), ("mlm", 40), ("classify", 40)])
def test_example_trains_and_saves(tmp_path, name, steps):
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", f"examples.{name}", "--steps", str(steps), "--device", "cpu",
                        "--out", str(tmp_path / "out")], cwd=ROOT, capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "loss: first" in r.stdout and "transformers loads it" in r.stdout
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_contrastive_example_runs_under_torchrun(tmp_path):
    # the command from the example's docstring, as a file path: two gloo processes, DDP gradients
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    env.pop("PYTHONPATH", None)  # the example must find its `examples` package by itself
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        "examples/finetune_contrastive.py", "--steps", "10", "--device", "cpu",
                        "--out", str(tmp_path / "out")], cwd=ROOT, capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "data parallel over 2 processes (gloo)" in r.stdout
    assert r.stdout.count("loss: first") == 1 and r.stdout.count("transformers loads it") == 1  # rank 0 only
    assert (tmp_path / "out" / "model.safetensors").is_file()
