"""Data parallelism on CPU with gloo and 2 processes (torchrun): one DDP / FSDP2 step equals one
single-process step on the concatenated batch."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from packedenc.train.distributed import rank_range

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "distributed" / "dp_step.py"


def _run(args, nproc=None):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(SCRIPT), *args]
    if nproc:
        # --standalone picks a free port, so concurrent test runs never collide
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
               str(SCRIPT), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


def test_rank_range_covers_everything_once():
    for n in (0, 1, 7, 8, 9):
        parts = [list(rank_range(n, r, 3)) for r in range(3)]
        assert sum(parts, []) == list(range(n))
        assert max(map(len, parts)) - min(map(len, parts)) <= 1


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_data_parallel_step_equals_single_process(tmp_path, mode):
    _run([str(tmp_path / "single.pt"), "single"])
    _run([str(tmp_path / f"{mode}.pt"), mode], nproc=2)
    single, dp = torch.load(tmp_path / "single.pt"), torch.load(tmp_path / f"{mode}.pt")
    assert len(single) == len(dp)
    for a, b in zip(single, dp):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    # the step moved the params (so equality above is about the update, not the init)
    import packedenc as pe
    from tests.distributed.dp_step import CFG

    init = torch.utils._pytree.tree_leaves(pe.init(CFG, torch.Generator().manual_seed(0), heads=("classifier",)))
    assert any((a - i).abs().max() > 1e-4 for a, i in zip(single, init))
