"""The DeBERTa benchmark (`python -m benchmarks.encode --model deberta-v3-base`, issue 5) on the CPU:
the tiny end-to-end run with the peers absent, the peers' wiring through stand-in modules (same
call signatures as DisentangledFlash 1.1.1 / FlashDeBERTa 0.0.8, computing with transformers), the
graphed system's per-workload cleanup, and the issue-target verdicts."""

import json
import sys
import types
from typing import NamedTuple

import pytest
import torch

from benchmarks import common, deberta_systems as ds
from benchmarks import encode

transformers = pytest.importorskip("transformers")

RUN = ["--model", "deberta-tiny", "--device", "cpu", "--quick", "--reps", "2", "--target-tokens", "1"]


def _absent(monkeypatch):
    for m in ds.PEERS:  # None in sys.modules: `import m` raises ImportError even if it is installed
        monkeypatch.setitem(sys.modules, m, None)


def _cells(path):
    return {(r["system"], r["workload"]): r for r in json.loads(path.read_text())}


def test_tiny_end_to_end_with_the_peers_absent(tmp_path, capsys, monkeypatch):
    _absent(monkeypatch)
    assert encode.main(RUN + ["--out-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    cell = _cells(tmp_path / "deberta-tiny_cpu_quick.json")
    assert (tmp_path / "deberta-tiny_cpu_quick.png").exists()
    assert {w for _, w in cell} == {"mnli", "doc1k", "long"}  # the three, no 64k packs by default
    for s in ("packedenc", "packedenc+graphs", "hf-eager"):
        for w in ("mnli", "doc1k", "long"):
            assert cell[(s, w)]["status"] == "ok" and cell[(s, w)]["tokens_per_s"] > 0, (s, w)
        # same weights everywhere: each system's probe output equals the fp32 reference
        assert cell[(s, "mnli")]["probe_min_cos"] > 0.9999, s
    assert cell[("packedenc+graphs", "mnli")]["graphs"] == "eager buckets (no CUDA)"
    assert cell[(ds.REFERENCE, "mnli")]["status"] == "skipped"  # probe oracle only
    for s, pin in (("flashdeberta", "flashdeberta==0.0.8"), ("disentangled-flash", "disentangled-flash==1.1.1")):
        assert cell[(s, "long")]["status"] == "skipped" and cell[(s, "long")]["error"] == f"absent: pip install {pin}"
    assert "issue-5 targets" in out and "mnli tokens/s >= 2.5x disentangled-flash" in out
    assert "n/a: disentangled-flash: absent: pip install disentangled-flash==1.1.1" in out
    assert "system (long)" in out


# ---- stand-ins for the peers (their public call signatures, transformers underneath) -------------


class PackedSequenceInfo(NamedTuple):
    offsets: tuple
    lengths: tuple
    max_seqlen: int


class PackedEncoder(torch.nn.Module):
    """Like DisentangledFlash's DebertaV2OptimizedEncoder.forward_packed: runs the HF encoder per sequence."""

    def __init__(self, hf_encoder, backend):
        super().__init__()
        self.inner, self.backend, self.calls, self.clears = hf_encoder, backend, 0, []

    def clear_inference_cache(self):
        self.clears.append(self.calls)

    def forward_packed(self, hidden_states, cu_seqlens, max_seqlen=None, *, output_hidden_states=True,
                       return_dict=True, packed_info=None):
        assert hidden_states.dim() == 2 and not output_hidden_states and return_dict
        assert packed_info.offsets == tuple(cu_seqlens.tolist()) and packed_info.max_seqlen == max_seqlen
        assert packed_info.lengths == tuple(b - a for a, b in zip(packed_info.offsets, packed_info.offsets[1:]))
        self.calls += 1
        outs = [self.inner(h[None], torch.ones(1, h.shape[0], dtype=torch.long)).last_hidden_state[0]
                for h in torch.split(hidden_states, list(packed_info.lengths))]
        return types.SimpleNamespace(last_hidden_state=torch.cat(outs))


def fake_df(install=True):
    m = types.ModuleType("disentangled_flash")
    m.PackedSequenceInfo, m.DebertaV2OptimizedEncoder = PackedSequenceInfo, PackedEncoder

    def optimize_deberta(model, *, backend="triton", inference=True):
        assert inference and backend == "torch"  # CPU: its PyTorch backend
        if install:  # else: as when Triton is unavailable, the HF encoder stays
            model.encoder = m.encoder = PackedEncoder(model.encoder, backend)
        return model

    m.optimize_deberta = optimize_deberta
    return m


def test_disentangled_flash_wiring_and_fallback_detection(tmp_path, monkeypatch):
    _absent(monkeypatch)
    monkeypatch.setitem(sys.modules, "disentangled_flash", fake_df())
    assert encode.main(RUN + ["--systems", ds.REFERENCE, "disentangled-flash", "--out-dir", str(tmp_path)]) == 0
    cell = _cells(tmp_path / "deberta-tiny_cpu_quick.json")
    for w in ("mnli", "doc1k", "long"):
        assert cell[("disentangled-flash", w)]["status"] == "ok"
    # HF embeddings on the packed ids + packed encoder + the host boundary info = the reference
    assert cell[("disentangled-flash", "mnli")]["probe_min_cos"] > 0.9999
    assert cell[("disentangled-flash", "mnli")]["df_backend"] == "torch"
    # its caches are dropped once per workload, before that workload's first call
    enc = sys.modules["disentangled_flash"].encoder
    assert len(enc.clears) == 3 and enc.clears[0] == 1 and enc.clears[1] > enc.clears[0]
    # optimize_deberta keeping the HF encoder is a failure of that system, not of the run
    monkeypatch.setitem(sys.modules, "disentangled_flash", fake_df(install=False))
    assert encode.main(RUN + ["--systems", "disentangled-flash", "--workloads", "long", "--out-dir", str(tmp_path)]) == 0
    rec = _cells(tmp_path / "deberta-tiny_cpu_quick.json")[("disentangled-flash", "long")]
    assert rec["status"] == "failed" and "optimize_deberta kept DebertaV2Encoder" in rec["error"]


def test_flashdeberta_builder_loads_the_same_weights():
    fd = types.ModuleType("flashdeberta")
    fd.FlashDebertaV2Model = transformers.DebertaV2Model
    fd_model = types.ModuleType("flashdeberta.model")
    fd_model.DebertaV2Config = transformers.DebertaV2Config
    params = ds.make_params(ds.DEBERTA_TINY)(torch.float32)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "flashdeberta.model", fd_model)
        model = ds.hf_builder(params, torch.float32, flash=fd)(torch.device("cpu"))
    ref = ds.hf_builder(params, torch.float32)(torch.device("cpu"))
    assert not model.training
    for (n, a), (m, b) in zip(model.state_dict().items(), ref.state_dict().items()):
        assert n == m and torch.equal(a, b), n
    sd = dict(ref.state_dict())
    sd.pop("encoder.rel_embeddings.weight")
    with pytest.raises(RuntimeError, match="missing"):
        ds._load_exact(transformers.DebertaV2Model(ref.config), sd, "x")


def test_import_peer_reasons(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashdeberta", None)
    assert ds.import_peer("flashdeberta") == (None, "absent: pip install flashdeberta==0.0.8")

    def boom(name):
        raise AttributeError("module 'transformers' has no attribute 'PretrainedConfig'")

    monkeypatch.setattr(ds.importlib, "import_module", boom)
    mod, why = ds.import_peer("disentangled_flash")
    assert mod is None and why.startswith("broken: import disentangled_flash failed (AttributeError")

    def no_dep(name):
        raise ModuleNotFoundError("No module named 'einops'", name="einops")

    monkeypatch.setattr(ds.importlib, "import_module", no_dep)
    assert ds.import_peer("flashdeberta")[1] == "absent: pip install flashdeberta==0.0.8 (its dependency 'einops' is missing)"


def test_graphed_system_drops_the_previous_workloads_graphs():
    params = ds.make_params(ds.DEBERTA_TINY)(torch.float32)
    s = ds.GraphedDeberta("g", params, torch.device("cpu"), max_tokens=256, max_seqs=16)
    s.setup()
    w1, w2 = (common.make_workload(ds.TINY_WORKLOADS[n], 1000) for n in ("mnli", "doc1k"))
    assert s.skip_reason(w1) is None
    s.run(s.prepare(w1.batch(0)))
    assert s.graphed.num_graphs == 1
    assert s.skip_reason(w1) is None and s.graphed.num_graphs == 1  # same workload: kept
    assert s.skip_reason(w2) is None and s.graphed.num_graphs == 0  # next workload: dropped


def _rec(system, workload, tps=None, ms=None, peak=None, resident=None, status="ok", error=None):
    return common.make_record(system, workload, tps, None, gpu="g", commit="c", status=status, error=error,
                              ms_per_batch=ms, peak_allocated_gb=peak, resident_gb=resident)


def test_target_verdicts():
    recs = [
        _rec("packedenc", "mnli", 300e3), _rec("disentangled-flash", "mnli", 100e3),  # 3.0x >= 2.5 ok
        _rec("packedenc", "doc1k", 140e3), _rec("disentangled-flash", "doc1k", 100e3),  # 1.4x < 1.5 missed
        _rec("packedenc", "long", 1, ms=50.0, peak=0.6, resident=0.4),
        _rec("disentangled-flash", "long", 1, ms=78.0, peak=0.7, resident=0.37),  # 0.64x ok; memory ok
        _rec("flashdeberta", "long", None, status="failed", error="OutOfMemoryError: boom"),
        _rec("packedenc+graphs", "mnli", 400e3), _rec("packedenc+graphs", "long", status="skipped"),
    ]
    got = {(t.label, s): (None if r is None else round(r, 3), v) for t, s, r, v in ds.evaluate(recs)}
    assert got[("mnli tokens/s >= 2.5x disentangled-flash", "packedenc")] == (3.0, "ok")
    assert got[("mnli tokens/s >= 2.5x disentangled-flash", "packedenc+graphs")] == (4.0, "ok")
    assert got[("doc1k tokens/s >= 1.5x disentangled-flash", "packedenc")] == (1.4, "missed")
    assert got[("long latency <= 0.8x disentangled-flash", "packedenc")] == (0.641, "ok")
    assert got[("long peak allocated <= 1.0x disentangled-flash", "packedenc")] == (0.857, "ok")
    assert got[("long working mem (peak - resident) vs disentangled-flash (info)", "packedenc")] == (0.606, "info")
    assert got[("long latency <= 1.0x flashdeberta", "packedenc")] == (None, "n/a (flashdeberta: OutOfMemoryError: boom)")
    assert got[("long latency <= 0.8x disentangled-flash", "packedenc+graphs")][1].startswith("n/a (packedenc+graphs")
    text = ds.target_report(recs)
    assert "1.40x missed" in text and "0.64x ok" in text and "n/a: flashdeberta: OutOfMemoryError: boom" in text
    assert "50.0" in text and "0.200" in text  # the long table: latency, working memory 0.6 - 0.4


def test_band_split_launcher_matches_the_shipped_forward():
    """`benchmarks.deberta_band_split.launch` times the shipped kernel: with both terms on and the
    band bounds it computes what `deberta_attention_fwd` computes, and with the terms off it is
    content-only attention (the interpreter ignores the launch options)."""
    from types import SimpleNamespace

    from benchmarks import deberta_band_split as split
    from packedenc.kernels.triton import deberta_attention as da

    cfg = SimpleNamespace(position_buckets=4, max_relative=8, scale=0.125)
    g = torch.Generator().manual_seed(0)
    H, K, R = 2, 16, 8
    cu = torch.tensor([0, 37, 40], dtype=torch.int32)
    q, k, v = (torch.randn(40, H, K, generator=g) for _ in range(3))
    pk, pq = (torch.randn(R, H, K, generator=g) for _ in range(2))

    def run(**kw):
        return split.launch(cfg, q, k, v, cu, 37, pk, pq, block=16, **kw)

    for c2p, p2c in ((True, True), (True, False), (False, True)):
        want, _ = da.deberta_attention_fwd(q, k, v, cu, 37, pk if c2p else None, pq if p2c else None, 4, 8, 0.125)
        for reuse in (True, False):
            torch.testing.assert_close(run(c2p=c2p, p2c=p2c, band=True, reuse=reuse), want, rtol=1e-4, atol=1e-4)
    content, _ = da.deberta_attention_fwd(q, k, v, cu, 37, None, None, 4, 8, 0.125)
    for band in (True, False):
        torch.testing.assert_close(run(c2p=False, p2c=False, band=band), content, rtol=1e-4, atol=1e-4)
    # the wide tiles at (32, 16) (block 16 = WIDE_N), their options set through `launch`
    want, _ = da.deberta_attention_fwd(q, k, v, cu, 37, pk, pq, 4, 8, 0.125)
    for p2c_wide in (True, False):
        got = run(c2p=True, p2c=True, band=True, WIDE_M=32, WIDE_N=16, WIDE_P2C=p2c_wide)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert da.WIDE_N == 32  # restored
