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
