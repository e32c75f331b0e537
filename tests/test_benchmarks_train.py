"""benchmarks.train on the CPU: the tiny smoke run writes complete records, every system computes the
same first-step loss as the reference (fp32, so to 1e-4), steps really train, DisentangledFlash is
recorded as absent rather than failing, and the padded HF layout picks the same masked tokens."""

import json

import pytest
import torch

from benchmarks import train
from benchmarks import train_systems as ts

pytest.importorskip("transformers")

FIELDS = ("system", "model", "workload", "step_ms", "tokens_per_s", "peak_reserved_gb", "gpu", "commit")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("train")
    assert train.main(["--tiny", "--device", "cpu", "--reps", "1", "--out-dir", str(out)]) == 0
    return json.loads((out / "train_cpu_tiny.json").read_text())


def test_records_have_the_issue_fields_and_every_system(tiny_run):
    by = {(r["model"], r["system"], r["workload"]): r for r in tiny_run}
    ok = {k for k, r in by.items() if r["status"] == "ok"}
    assert ok == {
        ("modernbert-tiny", "packedenc", "doc"), ("modernbert-tiny", "packedenc", "doc-1k"),
        ("modernbert-tiny", "torch-packed", "doc"), ("modernbert-tiny", "torch-packed", "doc-1k"),
        ("modernbert-tiny", "hf-sdpa", "doc"),
        ("deberta-tiny", "packedenc", "doc1k"), ("deberta-tiny", "packedenc", "doc1k-1k"),
        ("deberta-tiny", "packedenc[bwd=pair]", "doc1k"), ("deberta-tiny", "packedenc[bwd=pair]", "doc1k-1k"),
        ("deberta-tiny", "hf-eager", "doc1k"),
    }
    assert by[("modernbert-tiny", "hf-sdpa", "doc-1k")]["status"] == "skipped"  # HF pads: no token-budget packs
    for k in ok:
        r = by[k]
        assert all(f in r for f in FIELDS), k
        assert r["step_ms"] > 0 and r["tokens_per_s"] > 0 and r["gpu"] == "cpu" and r["commit"]
        assert r["first_loss"] != r["last_loss"]  # the optimizer really stepped
    df = [r for r in tiny_run if r["system"].startswith("disentangled-flash")]
    assert len(df) == 4 and all(r["status"] == "absent" and "absent" in r["error"] for r in df)


def test_every_system_computes_the_reference_first_step_loss(tiny_run):
    """Same weights, same masks: each system's per-token losses equal the reference's (fp32 on the CPU)."""
    probed = [r for r in tiny_run if r["status"] == "ok"]
    for r in probed:
        assert r["probe_rel_diff"] is not None and r["probe_rel_diff"] <= 1e-4, (r["model"], r["system"])
    for model in ("modernbert-tiny", "deberta-tiny"):
        losses = {r["probe_loss"] for r in probed if r["model"] == model}
        assert max(losses) - min(losses) <= 1e-4 * max(losses)


def test_targets_are_printed_with_a_verdict(tiny_run):
    lines = train.target_lines(tiny_run, train.benches(True), train.TINY_BUDGET)
    assert len(lines) == 8
    assert all(line.split()[0] in ("ok", "MISSED", "n/a") for line in lines)
    assert lines[0].startswith(("ok", "MISSED"))  # packedenc vs torch-packed: both ran
    assert lines[4].startswith("n/a")  # DisentangledFlash absent here


def test_padded_rows_pick_the_same_masked_tokens():
    from benchmarks.common import Batch

    seqs = [torch.arange(10, 15), torch.arange(20, 21), torch.arange(30, 38)]
    cu = torch.tensor([0, 5, 6, 14], dtype=torch.int32)
    b = ts.mlm_batch(Batch(torch.cat(seqs), cu, 8), mask_id=99, vocab_size=50, prob=0.5, seed=3)
    ids_SL, mask_SL, rows_M = b.padded(0)
    assert ids_SL.shape == (3, 8) and int(mask_SL.sum()) == 14
    assert b.positions.numel() > 2
    assert torch.equal(ids_SL.reshape(-1)[rows_M], b.ids[b.positions])
    assert torch.equal(torch.cat(seqs)[b.positions], b.targets)


def test_systems_train_copies_and_leave_the_host_weights_alone():
    """Each system starts from the same host values: an optimizer step must not write through to them."""
    bench = train.benches(True)["modernbert-tiny"]
    host = bench.make_params()
    before = [t.clone() for t in torch.utils._pytree.tree_leaves(host)]
    w = train.workloads(bench, host.config.vocab_size, train.TINY_BUDGET)[0]
    system = ts.PackedencTrain("packedenc", host, torch.device("cpu"), None)
    system.setup()
    system.step(system.prepare(train._batch(bench, w, 0, host.config.vocab_size)))
    assert all(torch.equal(a, c) for a, c in zip(before, torch.utils._pytree.tree_leaves(host)))
    moved = [not torch.equal(a, c) for a, c in zip(before, torch.utils._pytree.tree_leaves(system.params))]
    assert sum(moved) > len(moved) // 2
