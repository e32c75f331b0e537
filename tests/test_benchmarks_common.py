"""The benchmark harness on the CPU: seeded workloads that match the issue specs, token-budget
packing, rotation, records and table, failure handling, and a tiny end-to-end run."""

import json
import statistics
import sys

import pytest
import torch

from benchmarks import common
from benchmarks.common import DEBERTA_WORKLOADS, MODERNBERT_WORKLOADS, System

ALL_SPECS = list(MODERNBERT_WORKLOADS.values()) + list(DEBERTA_WORKLOADS.values())


@pytest.mark.parametrize("spec", ALL_SPECS, ids=lambda s: s.name + str(s.num_seqs))
def test_lengths_match_the_spec(spec):
    a = common.sample_lengths(spec, seed=0)
    assert a.shape == (spec.num_seqs,) and a.dtype == torch.int64
    assert int(a.min()) >= spec.lo and int(a.max()) <= spec.hi
    # clipping only touches the tails, so the sample median is the spec's (to sampling noise)
    med = statistics.median(a.tolist())
    assert abs(med - spec.median) <= 0.05 * spec.median, (med, spec.median)
    assert torch.equal(a, common.sample_lengths(spec, seed=0))  # seeded
    if spec.sigma > 0:
        assert not torch.equal(a, common.sample_lengths(spec, seed=1))
        # log-normal spread: the sample sigma of log-lengths (inside the clip) is near the spec's
        inside = a[(a > spec.lo) & (a < spec.hi)].double().log()
        assert abs(float(inside.std()) - spec.sigma) <= 0.25 * spec.sigma


def test_workload_names_are_independent():
    # a workload's data depends on its own name and the seed, not on which other workloads exist
    q = MODERNBERT_WORKLOADS["query"]
    assert not torch.equal(common.sample_lengths(q)[:64], common.sample_lengths(MODERNBERT_WORKLOADS["doc"])[:64])


def test_batched_workload():
    spec = MODERNBERT_WORKLOADS["doc"]
    w = common.make_workload(spec, vocab_size=50368)
    assert [len(b) for b in w.batches] == [spec.batch_size] * (spec.num_seqs // spec.batch_size)
    assert [i for b in w.batches for i in b] == list(range(spec.num_seqs))
    assert int(w.ids.min()) >= 0 and int(w.ids.max()) < 50368 and w.ids.numel() == w.num_tokens
    w2 = common.make_workload(spec, vocab_size=50368)
    assert torch.equal(w.ids, w2.ids)
    b = w.batch(3)
    lengths = [w.lengths[i] for i in w.batches[3]]
    assert b.cu_seqlens.tolist() == [0] + list(torch.tensor(lengths).cumsum(0).tolist())
    assert b.max_seqlen == max(lengths) and b.num_tokens == sum(lengths) == w.batch_tokens(3)
    start = sum(w.lengths[: w.batches[3][0]])
    assert torch.equal(b.ids, w.ids[start: start + sum(lengths)])  # batch 3 is the next slice of the stream
    ids_SL, mask_SL = b.padded(pad_id=7)
    assert ids_SL.shape == (len(lengths), max(lengths))
    assert torch.equal(ids_SL[mask_SL.bool()], b.ids) and bool((ids_SL[~mask_SL.bool()] == 7).all())


@pytest.mark.parametrize("name", ["query", "doc", "long"])
def test_budget_packs_cover_every_sequence_once(name):
    spec = MODERNBERT_WORKLOADS[name]
    w = common.make_workload(spec, vocab_size=100, budget_tokens=common.BUDGET_TOKENS)
    assert w.name == f"{name}-64k" and w.budget
    assert [i for b in w.batches for i in b] == list(range(spec.num_seqs))  # each once, in order
    sizes = [w.batch_tokens(i) for i in range(len(w.batches))]
    assert all(s <= common.BUDGET_TOKENS for s in sizes)  # no sequence is longer than the budget here
    # packs are full: each one (but the last) could not take the next sequence
    for i, s in enumerate(sizes[:-1]):
        assert s + w.lengths[w.batches[i + 1][0]] > common.BUDGET_TOKENS


def test_rotation():
    w = common.make_workload(MODERNBERT_WORKLOADS["query"], vocab_size=100)
    reps = common.rotation(w, reps=5, target_tokens=10_000)
    k = len(reps[0])
    assert all(len(r) == k for r in reps) and k * w.num_tokens / len(w.batches) >= 10_000
    assert reps[1][0] == (reps[0][-1] + 1) % len(w.batches)  # rotating, not repeating
    assert common.rotation(w, reps=2, target_tokens=10**9)[0] == list(range(len(w.batches)))  # capped


# ---- runner, records ----------------------------------------------------------------------------


class FakeSystem(System):
    def __init__(self, name, fail_on=None, fail_setup=False, skip=None):
        self.name, self.fail_on, self.fail_setup, self.skip = name, fail_on, fail_setup, skip
        self.closed = False

    def setup(self):
        if self.fail_setup:
            raise RuntimeError("no weights")

    def skip_reason(self, w):
        return "not for this one" if w.name == self.skip else None

    def prepare(self, batch):
        return batch

    def run(self, batch):
        if batch.num_seqs and self.fail_on == "all":
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return torch.ones(batch.num_tokens, 4)

    def info(self):
        return {"ops": "fake"}

    def close(self):
        self.closed = True


def _tiny_workloads():
    spec = common.WorkloadSpec("tiny", 16, 5, 0.3, 1, 9, 4)
    return [common.make_workload(spec, 10), common.make_workload(spec, 10, budget_tokens=1024)]


def test_run_system_records_ok_skip_and_failures():
    cfg = common.BenchConfig(reps=2, target_tokens=1, device=torch.device("cpu"))
    ws = _tiny_workloads()
    meta = dict(gpu="cpu", commit="abc")
    ok = FakeSystem("ok", skip="tiny-1k")
    recs, probe = common.run_system(ok, ws, cfg, meta, ws[0].batch(0))
    assert [r["status"] for r in recs] == ["ok", "skipped"] and ok.closed
    assert recs[0]["tokens_per_s"] > 0 and recs[0]["ops"] == "fake" and recs[0]["reps"] == 2
    assert probe.shape == (ws[0].batch(0).num_tokens, 4)
    recs, _ = common.run_system(FakeSystem("oom", fail_on="all"), ws, cfg, meta)
    assert [r["status"] for r in recs] == ["failed", "failed"] and "OutOfMemoryError" in recs[0]["error"]
    recs, probe = common.run_system(FakeSystem("nosetup", fail_setup=True), ws, cfg, meta)
    assert probe is None and all(r["status"] == "failed" and "no weights" in r["error"] for r in recs)
    for r in recs:
        assert {"system", "workload", "tokens_per_s", "peak_reserved_gb", "gpu", "commit"} <= set(r)


def test_write_records_merges_by_system_and_workload(tmp_path):
    path = tmp_path / "res" / "m_h200.json"
    a = [common.make_record("s1", "q", 1.0, 0.5, gpu="g", commit="c1"),
         common.make_record("s2", "q", 2.0, 0.5, gpu="g", commit="c1")]
    common.write_records(a, path)
    b = [common.make_record("s1", "q", 3.0, 0.5, gpu="g", commit="c2")]
    merged = common.write_records(b, path)
    on_disk = json.loads(path.read_text())
    assert on_disk == merged and len(merged) == 2
    assert {(r["system"], r["tokens_per_s"]) for r in on_disk} == {("s1", 3.0), ("s2", 2.0)}


def test_table_and_names():
    recs = [common.make_record("a", "query", 123_456.0, 1.25, gpu="g", commit="c", status="ok"),
            common.make_record("a", "doc", None, None, gpu="g", commit="c", status="failed", error="boom"),
            common.make_record("b", "query", None, None, gpu="g", commit="c", status="skipped", error="x")]
    t = common.format_table(recs, {"a": 0.99999, "b": None})
    assert "123k (1.2 GB)" in t and "FAILED" in t and "skipped" in t and "FAILED a (doc): boom" in t
    assert "0.99999" in t
    assert common.gpu_slug("NVIDIA H200") == "h200" and common.gpu_slug("NVIDIA H200 NVL") == "h200-nvl"
    assert common.gpu_slug("cpu") == "cpu"


def test_chart_is_skipped_without_matplotlib(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import now raises ImportError
    recs = [common.make_record("a", "query", 1.0, 1.0, gpu="g", commit="c")]
    assert common.plot(recs, tmp_path / "x.png", "t") is None
    assert "matplotlib is not installed" in capsys.readouterr().out and not (tmp_path / "x.png").exists()


def test_encode_cli_end_to_end_on_cpu(tmp_path, capsys):
    from benchmarks import encode

    rc = encode.main(["--model", "modernbert-tiny", "--device", "cpu", "--quick", "--reps", "2",
                      "--target-tokens", "1", "--workloads", "query", "query-64k",
                      "--systems", "packedenc", "packedenc+graphs", "torch-packed", "hf-sdpa",
                      "--out-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0
    recs = json.loads((tmp_path / "modernbert-tiny_cpu_quick.json").read_text())
    cell = {(r["system"], r["workload"]): r for r in recs}
    assert cell[("packedenc", "query")]["status"] == "ok" and cell[("torch-packed", "query-64k")]["status"] == "ok"
    assert cell[("hf-sdpa", "query-64k")]["status"] == "skipped"
    # no CUDA here: the graphed system runs the same bucketed buffers eagerly, with a budget per workload
    assert cell[("packedenc+graphs", "query")]["status"] == "ok"
    assert cell[("packedenc+graphs", "query")]["probe_min_cos"] > 0.9999
    # same weights everywhere: packedenc and HF agree with the plain baseline on the probe batch
    assert cell[("packedenc", "query")]["probe_min_cos"] > 0.9999
    assert cell[("hf-sdpa", "query")]["probe_min_cos"] > 0.9999
    assert "environment: torch=" in out and "system" in out


def test_module_switches_set_flags_for_the_block_and_restore_them_even_on_error():
    import types

    from benchmarks.common import module_switches

    m = types.SimpleNamespace(ONE_PASS=False, WARPS=4)
    with module_switches({"ONE_PASS": m, "WARPS": m}, {"ONE_PASS": True, "WARPS": 8}):
        assert (m.ONE_PASS, m.WARPS) == (True, 8)
    assert (m.ONE_PASS, m.WARPS) == (False, 4)
    try:
        with module_switches({"WARPS": m}, {"WARPS": 2}):
            raise RuntimeError("a variant failed")
    except RuntimeError:
        pass
    assert m.WARPS == 4
