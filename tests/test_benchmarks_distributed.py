"""benchmarks/distributed.py on the CPU: the tiny smoke run launches 1 and 2 gloo processes per
system and writes the records the issue asks for; failed launches are recorded, not raised."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

from benchmarks import distributed as bd

ROOT = Path(__file__).resolve().parents[1]
FIELDS = {"system", "workload", "gpus", "tokens_per_s", "scaling", "gpu", "commit"}


def _bench(*args):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "benchmarks.distributed", "--device", "cpu", "--tiny", *args],
                          cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)


def test_tiny_cpu_run_writes_scaling_records(tmp_path):
    r = _bench("--out-dir", str(tmp_path), "--reps", "2")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    recs = json.loads((tmp_path / "distributed_cpu_tiny.json").read_text())
    assert [(x["system"], x["gpus"]) for x in recs] == [("embed", 1), ("embed", 2), ("train", 1), ("train", 2)]
    for x in recs:
        assert FIELDS <= set(x) and x["status"] == "ok" and x["gpu"] == "cpu"
        assert x["tokens_per_s"] > 0 and len(x["seconds"]) == 2
        assert x["scaling"] == (1.0 if x["gpus"] == 1 else x["tokens_per_s"] / recs[recs.index(x) - 1]["tokens_per_s"])
    embed1, embed2, train1, train2 = recs
    assert embed1["tokens"] == embed2["tokens"] > 0  # the same corpus on 1 and 2 processes, each token once
    assert embed1["sequences"] == embed2["sequences"] == 8 * 16  # doc x8 (tiny doc: 16 sequences)
    # every process takes one pack of at most budget tokens per step, so a repetition on 2 processes
    # covers about twice the tokens of one (packs hold whole sequences: a little under budget each)
    for t in (train1, train2):
        assert 0 < t["tokens"] <= t["gpus"] * t["steps_per_rep"] * t["budget_tokens"], t
    assert 1.5 < train2["tokens"] / train1["tokens"] < 2.5
    for t in (train1, train2):
        assert t["params_in_sync"] is True and math.isfinite(t["last_loss"])
    assert "scaling" in r.stdout and "embed   doc-x8-tiny" in r.stdout  # the table


def test_a_failing_launch_is_recorded_and_the_run_goes_on(tmp_path):
    r = _bench("--out-dir", str(tmp_path), "--systems", "embed", "--embed-budget", "-1", "--reps", "1")
    assert r.returncode == 1
    recs = json.loads((tmp_path / "distributed_cpu_tiny.json").read_text())
    assert [(x["gpus"], x["status"]) for x in recs] == [(1, "failed"), (2, "failed")]  # both launches ran
    assert all(x["tokens_per_s"] is None and x["scaling"] is None and x["error"] for x in recs)
    assert "FAILED embed x2" in r.stdout


def test_records_and_table():
    results = [
        {"system": "embed", "workload": "doc-x8", "gpus": 1, "tokens_per_s": 1000.0, "status": "ok"},
        {"system": "embed", "workload": "doc-x8", "gpus": 2, "tokens_per_s": 1950.0, "status": "ok"},
        {"system": "train", "workload": "mlm", "gpus": 1, "tokens_per_s": 500.0, "status": "ok"},
        {"system": "train", "workload": "mlm", "gpus": 2, "tokens_per_s": 850.0, "status": "ok"},
        {"system": "train", "workload": None, "gpus": 4, "tokens_per_s": None, "status": "failed", "error": "OOM"},
    ]
    recs = bd.make_records(results, {"gpu": "NVIDIA H200", "commit": "abc"})
    assert [x["scaling"] for x in recs] == [1.0, 1.95, 1.0, 1.7, None]
    assert [x["meets_target"] for x in recs] == [None, True, None, False, None]
    assert recs[4]["workload"] == "mlm"  # named after the system's other runs
    table = bd.format_table(recs)
    assert ">= 1.9x ok" in table and ">= 1.8x MISSED" in table and "FAILED train x4: OOM" in table
