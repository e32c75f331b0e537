"""The cute backend (CuteDSL / FlashAttention-4) and backend="auto"'s table (kernels/auto.py).

CPU: the ConfigError without the extra, the FA4 op's registration, autograd and compile (its CPU
implementation is the reference), which calls FA4 takes, the auto table against the committed
records it cites, and the routing of a shaped row. GPU (`gpu` + `cute`, with the extra installed):
FA4's forward and gradients against the fp32 reference with the 2x rule (bf16 / fp16, global and
windowed, head dims 64 and 128), isolation, determinism, compile, CUDA-graph replay, the table.
"""

import functools
import importlib
import sys
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from benchmarks import attention as bench_attention
from packedenc import kernels
from packedenc.errors import ConfigError, InputError
from packedenc.kernels import BACKENDS, OP_NAMES, auto, choose, describe_ops, get_ops, reference
from packedenc.kernels.cute import attention as FA4
from packedenc.kernels.reference import backward as reference_bwd
from tests.kernels._assert import GPU_LENGTHS, assert_close_to_ref, cu_seqlens, other_rows, skip_without_cute

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


@pytest.fixture
def no_cute_packages(monkeypatch):
    """A machine without the extra, whatever this one has: `import cutlass` fails, caches cleared."""
    monkeypatch.setitem(sys.modules, "cutlass", None)  # None in sys.modules: the import raises
    monkeypatch.delitem(sys.modules, "packedenc.kernels.cute.backend", raising=False)
    for key in [k for k in kernels._CHOSEN if k[0] == "cute"]:
        monkeypatch.delitem(kernels._CHOSEN, key)
    kernels._load_backend.cache_clear()
    yield
    kernels._load_backend.cache_clear()
    kernels._IMPORT_ERRORS.pop("cute", None)


def test_cute_without_the_extra_is_a_config_error_that_names_it(no_cute_packages):
    with pytest.raises(ConfigError, match=r"backend 'cute' is not available.*pip install 'packedenc\[cute\]'"):
        get_ops("cute", "cuda")
    assert "cute" not in kernels.available_backends("cuda")
    # auto does not need it: its table chooses no cute row without a record
    assert "cute" not in dict(get_ops("auto", "cuda").chosen)["varlen_attention"]
    assert "pip install 'packedenc[cute]'" in describe_ops("auto", "cuda")
    assert "cute" in BACKENDS


# ---- the FA4 op on the CPU: the reference behind the same registration ----------------------------


def _qkv(T, H, K, dtype=torch.float32, device="cpu"):
    return [torch.randn(T, H, K, device=device).to(dtype) for _ in range(3)]


@pytest.mark.parametrize("need_lse", [True, False])
def test_fa4_op_opcheck(need_lse):
    q, k, v = _qkv(10, 2, 8)
    cu = cu_seqlens((1, 6, 3), "cpu")
    leaves = [t.clone().requires_grad_(need_lse) for t in (q, k, v)]
    torch.library.opcheck(torch.ops.packedenc.fa4_varlen_fwd.default, (*leaves, cu, 6, 2, 2, None, need_lse))


@pytest.mark.parametrize("window", [(-1, -1), (2, 2), (3, -1)])
def test_fa4_op_on_cpu_is_the_reference_with_its_gradients_and_compiles(window):
    q, k, v = _qkv(10, 2, 8)
    cu = cu_seqlens((1, 6, 3), "cpu")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    refs = [t.clone().requires_grad_() for t in (q, k, v)]
    w = torch.randn(10, 2, 8)
    out = FA4.varlen_attention(*leaves, cu, 6, window)
    want = reference.varlen_attention(*refs, cu, 6, window)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    (out * w).sum().backward()
    (want * w).sum().backward()
    for a, b in zip(leaves, refs):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)
    f = lambda q, k, v: FA4.varlen_attention(q, k, v, cu, 6, window)  # noqa: E731
    torch.testing.assert_close(torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v), f(q, k, v))


def test_covers_fa4_takes_only_what_fa4_runs(monkeypatch):
    monkeypatch.setattr(FA4, "_capability", lambda index: (9, 0))
    with FakeTensorMode():  # CUDA tensors' metadata, on any machine
        cuc = torch.empty(3, dtype=torch.int32, device="cuda")

        def covers(K=64, dtype=torch.bfloat16, device="cuda", cu_=None, **kw):
            q = torch.empty(10, 2, K, device=device, dtype=dtype)
            return FA4.covers_fa4(q, q, q, cuc if cu_ is None else cu_, 5, **kw)

        assert covers() and covers(K=128) and covers(dtype=torch.float16) and covers(window=(64, 64))
        assert not covers(K=96) and not covers(K=256)  # head dims the GPU tests do not check
        assert not covers(dtype=torch.float32)
        assert not covers(device="cpu")
        assert not covers(cu_=cuc.long())
        assert not covers(dropout_p=0.1, dropout_seed=3)
        monkeypatch.setattr(FA4, "_capability", lambda index: (8, 0))  # an A100: FA4's sm80 path is not ours
        assert not covers()
        with pytest.raises(InputError, match="sm90"):
            q = torch.empty(10, 2, 64, device="cuda", dtype=torch.bfloat16)
            FA4.varlen_attention(q, q, q, cuc, 5)


# ---- the auto table --------------------------------------------------------------------------------


def _records(file):
    from benchmarks.records import load_records, ok

    return [r for r in load_records(RESULTS / file) if ok(r)]


def _newest_run_with(recs, systems, workload):
    """The records of `workload` from the newest commit (the latest in the file) that measured all
    of `systems`: a win is read within one run, never across commits."""
    mine = [r for r in recs if r["workload"] == workload]
    commits = list(dict.fromkeys(str(r.get("commit")) for r in reversed(mine)))
    for c in commits:
        run = [r for r in mine if str(r.get("commit")) == c]
        if all(any(r["system"] == s for r in run) for s in systems):
            return run
    return []


def test_every_chosen_auto_row_cites_a_committed_record_that_shows_the_win():
    checked = 0
    for op, rows in [*auto.AUTO_CUDA.items(), ("(default)", auto.DEFAULT)]:
        assert op == "(default)" or op in OP_NAMES, op
        for i, row in enumerate(rows):
            assert row.backend in BACKENDS and row.backend not in ("auto", "reference"), (op, row)
            assert row.shape is None or row.shape in auto.SHAPES, (op, row)
            if row.fallback:  # only after a measured row: it serves what that one does not take
                assert any(r.evidence for r in rows[:i]), (op, row)
            if not row.chosen:
                assert row.why_not, f"{op}: {row.name} is listed but says not why it is not chosen"
                continue
            ev = row.evidence
            if ev is None:
                continue
            recs = _records(ev.file)
            for wl in ev.workloads:
                for metric in ev.metrics:
                    run = _newest_run_with(recs, (ev.system, ev.rival), wl)
                    mine = [r[metric] for r in run if r["system"] == ev.system]
                    theirs = [r[metric] for r in run if r["system"] == ev.rival]
                    assert len(mine) == 1 and len(theirs) == 1, f"{ev.file}: {ev.system} / {ev.rival} on {wl}"
                    better = mine[0] > theirs[0] if metric.endswith("_per_s") else mine[0] < theirs[0]
                    assert better, f"{op}: {ev} does not hold on {wl} ({metric}): {mine[0]} vs {theirs[0]}"
                    checked += 1
    assert checked >= 18  # every workload of every cited record was read


def test_cute_rows_are_chosen_only_with_a_record_and_fa4_only_for_long_global_layers():
    cute_rows = {op: [r for r in rows if r.backend == "cute"] for op, rows in auto.AUTO_CUDA.items()}
    assert all(r.chosen == (r.evidence is not None) for rows in cute_rows.values() for r in rows)
    fa4_long, fa4_large, fa4_train = cute_rows["varlen_attention"]
    assert fa4_long.chosen and fa4_long.shape == "long-global"
    assert fa4_large.chosen and fa4_large.shape == "large-global"
    assert fa4_train.shape == "train-global"
    # the record also shows FA4 losing where the shape class keeps it out: short and windowed
    recs = {(r["system"], r["workload"]): r for r in _records("cute_h200.json")}
    for wl in ("query-64k", "mid-64k", "doc-64k-window", "long-window"):
        assert recs[("packedenc[cute]", wl)]["fwd_ms"] > recs[("packedenc[triton]", wl)]["fwd_ms"], wl
    for wl in ("query-64k", "mid-64k"):  # the packs FA4 loses stay under both thresholds
        lens = bench_attention.lengths(wl)
        assert max(lens) < auto.LONG_SEQLEN <= max(bench_attention.lengths("doc-64k"))
        assert sum(lens) < auto.MEAN_SEQLEN * len(lens) and sum(lens) >= auto.LARGE_PACK
    # the mean-length row: every crossover pack at or above MEAN_SEQLEN is cited (FA4 wins it on the
    # device), every one below it shows FA4 losing there
    from benchmarks.cute import CROSSOVER
    cited = set(fa4_large.evidence.workloads)
    for wl, spec in CROSSOVER.items():
        lens = bench_attention.lengths(wl, spec=spec)
        mine, theirs = recs[("packedenc[cute]", wl)], recs[("packedenc[triton]", wl)]
        if sum(lens) >= auto.MEAN_SEQLEN * len(lens):
            assert wl in cited, wl
        else:
            assert mine["fwd_device_ms"] > theirs["fwd_device_ms"], wl
    # one long sequence among short ones: a mixed pack at or above MEAN_SEQLEN on average is cited
    # for the long-global row, one below it shows FA4 losing (forward and backward, on the device)
    from benchmarks.cute import MIXED, mixed_lengths
    cited = set(fa4_long.evidence.workloads)
    below = 0
    for wl in MIXED:
        lens = mixed_lengths(wl)
        assert max(lens) >= auto.LONG_SEQLEN, wl
        mine, theirs = recs[("packedenc[cute]", wl)], recs[("packedenc[triton]", wl)]
        if sum(lens) >= auto.MEAN_SEQLEN * len(lens):
            assert wl in cited, wl
        else:
            below += 1
            for metric in ("fwd_device_ms", "fwd_bwd_device_ms"):
                assert mine[metric] > theirs[metric], (wl, metric)
    assert below >= 1


def test_the_training_row_is_not_chosen_and_its_records_say_why():
    """FA4's training row (`train-global`) was measured and lost: on every training-size pack at or
    above TRAIN_MEAN_SEQLEN FA4 wins forward + backward on the device but loses the call (its host
    launch), and the eager training steps that took it were slower (one run, the same lease)."""
    from benchmarks.cute import TRAIN, train_lengths

    row = next(r for r in auto.rows("varlen_attention") if r.shape == "train-global")
    assert not row.chosen and row.why_not.startswith("measured, not faster")
    recs = {(r["system"], r["workload"]): r for r in _records("cute_h200.json")}
    above = 0
    for wl in TRAIN:
        lens = train_lengths(wl)
        mine, theirs = recs[("packedenc[cute]", wl)], recs[("packedenc[triton]", wl)]
        assert mine["commit"] == theirs["commit"], wl
        if sum(lens) >= auto.TRAIN_MEAN_SEQLEN * len(lens):
            above += 1
            assert mine["fwd_bwd_device_ms"] < theirs["fwd_bwd_device_ms"], wl
            assert mine["fwd_bwd_ms"] > theirs["fwd_bwd_ms"], wl
        if sum(lens) >= auto.MEAN_SEQLEN * len(lens):  # what a graphed batch the long-global row takes
            # through its bucketed max_seqlen runs: FA4 wins on the device (auto.LONG_SEQLEN's comment)
            for metric in ("fwd_device_ms", "fwd_bwd_device_ms"):
                assert mine[metric] < theirs[metric], (wl, metric)
    assert above >= 4
    steps = {(r["system"], r["workload"]): r for r in _records("history/train_cute_h200_74b33b6.json")}
    for wl in ("doc", "doc-b8"):
        took = steps[("packedenc[auto,train-global]", wl)]["tokens_per_s"]
        assert took < steps[("packedenc[auto,no-cute]", wl)]["tokens_per_s"], wl


def test_the_inference_shape_class():
    x = torch.zeros(3, 4)
    g = x.clone().requires_grad_()
    assert auto.inference(x, x, eps=1e-5) and auto.inference(x, residual=x)
    assert not auto.inference(x, g) and not auto.inference(x, residual=g)
    with torch.no_grad():
        assert auto.inference(x, g)

@pytest.fixture
def fake_cute(monkeypatch):
    """The cute backend's real attention entry and covers rule, registered as if the extra loaded."""
    importlib.import_module("packedenc.kernels.triton")
    importlib.import_module("packedenc.kernels.flash")
    monkeypatch.setitem(kernels._IMPLS, "cute", {"varlen_attention": FA4.varlen_attention})
    monkeypatch.setitem(kernels._COVERS, ("cute", "varlen_attention"), FA4.covers_fa4)


def test_the_table_for_cuda_with_and_without_cute(fake_cute):
    every = {"triton", "flash", "cute"}.__contains__
    assert choose("varlen_attention", "auto", "cuda", every) == "cute[long-global]>cute[large-global]>triton"
    assert choose("varlen_attention", "auto", "cuda", {"triton", "flash"}.__contains__) == "triton"
    assert choose("graph_attention", "auto", "cuda", every) == "triton>flash"
    assert choose("deberta_attention", "auto", "cuda", every) == "triton"
    assert choose("linear_glu", "auto", "cuda", every) == "triton[small-uncaptured]>linear+glu"
    assert choose("layer_norm", "auto", "cuda", every) == "triton"
    assert choose("linear", "auto", "cuda", every) == "reference"  # cuBLAS through F.linear
    # forced cute: FA4 first, what it does not take to the auto rows; ops it has none of: auto's
    assert choose("varlen_attention", "cute", "cuda", every) == "cute>triton"
    assert choose("layer_norm", "cute", "cuda", every) == "triton"
    # triton missing: flash is the varlen fallback; nothing usable: the reference
    assert choose("varlen_attention", "auto", "cuda", {"flash"}.__contains__) == "flash>reference"
    assert choose("varlen_attention", "auto", "cuda", lambda b: False) == "reference"
    assert choose("varlen_attention", "auto", "cpu", every) == "reference"


def test_a_measured_shaped_row_takes_its_shape_class_and_hands_on_the_rest(fake_cute, monkeypatch):
    calls = []
    monkeypatch.setitem(kernels._IMPLS, "test-fa", {"varlen_attention": lambda *a, **k: calls.append("fa")})
    monkeypatch.setitem(kernels._IMPLS, "test-tri", {"varlen_attention": lambda *a, **k: calls.append("tri")})
    monkeypatch.setitem(kernels._COVERS, ("test-fa", "varlen_attention"), lambda q, *a, **k: q.dtype != torch.float32)
    ev = auto.Evidence("cute_h200.json", "fwd_ms", "x", "y", ("long",))
    monkeypatch.setitem(auto.AUTO_CUDA, "varlen_attention",
                        (auto.Row("test-fa", ev, "long-global"), auto.Row("test-tri", ev)))
    name = choose("varlen_attention", "auto", "cuda", {"test-fa", "test-tri"}.__contains__)
    assert name == "test-fa[long-global]>test-tri"
    fn = kernels._entry("varlen_attention", name)
    L, M = auto.LONG_SEQLEN, auto.MEAN_SEQLEN
    q, cu = torch.zeros(M, 2, 64, dtype=torch.bfloat16), cu_seqlens((M,), "cpu")  # mean M: long enough
    fn(q, q, q, cu, L)  # global, long, inference: the shaped row
    fn(q, q, q, cu, L, window=(64, 64))  # windowed
    fn(q, q, q, cu, L - 1)  # shorter than the class
    fn(q.float(), q.float(), q.float(), cu, L)  # the backend does not cover it
    g = q.clone().requires_grad_()
    fn(g, g, g, cu, L)  # training: the class takes it too
    with torch.no_grad():
        fn(g, g, g, cu, L)  # inputs that require grad, under no_grad: inference
    assert calls == ["fa", "tri", "tri", "tri", "fa", "fa"]


def test_two_shaped_rows_of_one_backend_and_the_large_global_class(monkeypatch):
    """FA4's two rows: long sequences at any pack size, or a large pack, either way when the mean
    length reaches MEAN_SEQLEN (host values: T and the cu_seqlens length); everything else goes on
    down the chain."""
    calls = []
    monkeypatch.setitem(kernels._IMPLS, "test-fa", {"varlen_attention": lambda *a, **k: calls.append("fa")})
    monkeypatch.setitem(kernels._IMPLS, "test-tri", {"varlen_attention": lambda *a, **k: calls.append("tri")})
    ev = auto.Evidence("cute_h200.json", "fwd_ms", "x", "y", ("long",))
    monkeypatch.setitem(auto.AUTO_CUDA, "varlen_attention", (
        auto.Row("test-fa", ev, "long-global"), auto.Row("test-fa", ev, "large-global"), auto.Row("test-tri", ev)))
    name = choose("varlen_attention", "auto", "cuda", {"test-fa", "test-tri"}.__contains__)
    assert name == "test-fa[long-global]>test-fa[large-global]>test-tri"
    # forced, the backend comes once: its unshaped entry takes what it covers (everything here)
    assert choose("varlen_attention", "test-fa", "cuda", {"test-fa", "test-tri"}.__contains__) == "test-fa"
    fn = kernels._entry("varlen_attention", name)
    T, M, L = auto.LARGE_PACK, auto.MEAN_SEQLEN, 100  # L: a longest under LONG_SEQLEN
    q = torch.zeros(T, 1, 8)

    def cu(S):  # only its length is read
        return torch.zeros(S + 1, dtype=torch.int32)

    fn(q, q, q, cu(T // M), L)  # mean >= M on a large pack: FA4
    fn(q, q, q, cu(T // M + 1), L)  # mean < M
    fn(q, q, q, cu(T // M), L, window=(64, 64))  # windowed
    fn(q[:-1], q[:-1], q[:-1], cu(1), L)  # one long sequence, but under LARGE_PACK and LONG_SEQLEN
    fn(q[:M], q[:M], q[:M], cu(1), auto.LONG_SEQLEN)  # a long sequence in a small pack: the first row
    fn(q[:M], q[:M], q[:M], cu(2), auto.LONG_SEQLEN)  # ... among short ones (mean under M): neither
    fn(q, q, q, cu(T // M + 1), auto.LONG_SEQLEN)  # a large pack, long, but short on average: neither
    assert calls == ["fa", "tri", "tri", "tri", "fa", "tri", "tri"]


def test_the_train_global_class_takes_global_layers_with_gradients_long_enough_on_average():
    """FA4's training row: any pack size, a mean of TRAIN_MEAN_SEQLEN or more (T / S, host values),
    a global layer, and a gradient to compute; inference and windowed layers never."""
    M = auto.TRAIN_MEAN_SEQLEN
    q = torch.zeros(4 * M, 1, 8)
    g = q.clone().requires_grad_()

    def cu(S):  # only its length is read
        return torch.zeros(S + 1, dtype=torch.int32)

    assert auto.train_global(g, g, g, cu(4), 2 * M)  # mean M exactly, 4 * M tokens: far under LARGE_PACK
    assert not auto.train_global(g, g, g, cu(5), 2 * M)  # mean under M
    assert not auto.train_global(g, g, g, cu(4), 2 * M, window=(64, 64))
    assert not auto.train_global(q, q, q, cu(4), 2 * M)  # inference
    with torch.no_grad():
        assert not auto.train_global(g, g, g, cu(4), 2 * M)


def test_a_candidate_row_is_measured_beside_auto(fake_cute, monkeypatch):
    """`benchmarks.cute_common.auto_with_candidate`: auto's table with one unchosen row taken in its
    place, every other op as auto has it; a row that is chosen already (or absent) is an error."""
    from benchmarks.cute_common import auto_with_candidate

    monkeypatch.setattr(kernels, "_usable_on_cuda", {"reference", "triton", "flash", "cute"}.__contains__)
    monkeypatch.setattr(kernels, "choose", functools.partial(kernels.choose, usable=kernels._usable_on_cuda))
    ops = auto_with_candidate("varlen_attention", "train-global")
    chosen = dict(ops.chosen)
    assert chosen["varlen_attention"] == "cute[long-global]>cute[large-global]>cute[train-global]>triton"
    assert chosen["layer_norm"] == "triton"
    with pytest.raises(ValueError, match="no unchosen row"):
        auto_with_candidate("varlen_attention", "long-global")


def test_describe_ops_names_every_op_its_choice_and_why():
    text = describe_ops("auto", "cpu")
    lines = text.splitlines()
    assert lines[0] == "packedenc ops, backend='auto' on cpu"
    for op in OP_NAMES:  # a composite op runs its parts (the reference ones here)
        want = {"rotary_attention": "rotary+varlen_attention", "linear_glu": "linear+glu",
                "layer_norm_linear_glu": "layer_norm+linear_glu", "layer_norm_linear": "layer_norm+linear"}.get(op, "reference")
        assert any(line.split()[:2] == [op, want] for line in lines), op
    assert "rotary then varlen_attention, as the table serves them" in text
    cuda = describe_ops("auto", "cuda")
    assert "(not cute)" in cuda and "not faster" in cuda  # layer_norm's quack row, measured and left out
    chosen = dict(get_ops("auto", "cuda").chosen)
    for op in OP_NAMES:
        assert any(line.split()[:2] == [op, chosen[op]] for line in cuda.splitlines()), op
    if "triton" in chosen["layer_norm"]:  # a GPU machine: the evidence is printed
        assert "modernbert_h200.json: packedenc beats torch-packed" in cuda


# ---- GPU, with the extra installed ------------------------------------------------------------------


@pytest.fixture
def cute_loaded():
    skip_without_cute(lambda cap: cap >= FA4.MIN_CAPABILITY, "FA4 needs an sm90+ GPU")


def _eager_lowp(q, k, v, cu, L, window):
    from tests.kernels.test_flash import _eager_lowp as plain

    return plain(q, k, v, cu, L, window)


GPU_T = sum(GPU_LENGTHS)


@pytest.mark.gpu
@pytest.mark.cute
@pytest.mark.parametrize("K", FA4.HEAD_DIMS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [(-1, -1), (64, 64)])  # ModernBERT global / local layers
def test_gpu_cute_forward(cute_loaded, K, dtype, window):
    fn = get_ops("cute", "cuda").varlen_attention
    q, k, v = _qkv(GPU_T, 12 if K == 64 else 6, K, dtype, "cuda")
    cu, L = cu_seqlens(GPU_LENGTHS, "cuda"), max(GPU_LENGTHS)
    out = fn(q, k, v, cu, L, window)
    ref32 = reference.varlen_attention(q.float(), k.float(), v.float(), cu, L, window)
    assert_close_to_ref(out, ref32, _eager_lowp(q, k, v, cu, L, window), atol=1e-3, what=f"fa4 K={K}")
    assert torch.equal(fn(q, k, v, cu, L, window), out)  # deterministic forward
    other = other_rows(GPU_LENGTHS, 7)  # the 2047-token sequence
    k2, v2 = k.clone(), v.clone()
    k2[other] *= 5
    v2[other] += 1
    out2 = fn(q, k2, v2, cu, L, window)
    assert torch.equal(out[~other], out2[~other]) and not torch.equal(out[other], out2[other])


@pytest.mark.gpu
@pytest.mark.cute
@pytest.mark.parametrize("K", FA4.HEAD_DIMS)
@pytest.mark.parametrize("window", [(-1, -1), (64, 64)])
def test_gpu_cute_backward(cute_loaded, K, window):
    fn = get_ops("cute", "cuda").varlen_attention
    lengths = (1, 63, 64, 65, 129, 700)  # the reference backward is dense: keep it moderate
    T, cu, L = sum(lengths), cu_seqlens(lengths, "cuda"), max(lengths)
    q, k, v = _qkv(T, 4, K, torch.bfloat16, "cuda")
    do = torch.randn(T, 4, K, device="cuda").to(torch.bfloat16)

    def grads(f, cast):
        leaves = [t.detach().to(cast).requires_grad_() for t in (q, k, v)]
        return torch.autograd.grad(f(*leaves, cu, L, window), leaves, do.to(cast))

    got, lowp = grads(fn, torch.bfloat16), grads(_eager_lowp, torch.bfloat16)
    f32 = reference_bwd.varlen_attention_bwd(do.float(), q.float(), k.float(), v.float(), cu, window)
    for name, a, b, c in zip(("dq", "dk", "dv"), got, lowp, f32):
        assert_close_to_ref(a, c, b, atol=1e-3, what=f"fa4 {name} K={K}")


@pytest.mark.gpu
@pytest.mark.cute
def test_gpu_cute_table_compile_and_cuda_graph(cute_loaded):
    ops = get_ops("cute", "cuda")
    assert dict(ops.chosen)["varlen_attention"] == "cute>triton"
    assert dict(get_ops("auto", "cuda").chosen)["varlen_attention"] == "cute[long-global]>cute[large-global]>triton"
    cu, L = cu_seqlens((100, 300, 1), "cuda"), 300
    q, k, v = _qkv(401, 12, 64, torch.bfloat16, "cuda")
    triton_fn = get_ops("triton", "cuda").varlen_attention
    q96 = torch.randn(401, 12, 96, device="cuda", dtype=torch.bfloat16)  # FA4 is not asked: triton runs it
    assert torch.equal(ops.varlen_attention(q96, q96, q96, cu, L), triton_fn(q96, q96, q96, cu, L))
    eager = ops.varlen_attention(q, k, v, cu, L, (64, 64))
    f = torch.compile(lambda q, k, v: ops.varlen_attention(q, k, v, cu, L, (64, 64)), fullgraph=True)
    assert torch.equal(f(q, k, v), eager)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ops.varlen_attention(q, k, v, cu, L, (64, 64))  # warm-up outside capture (compiles)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.varlen_attention(q, k, v, cu, L, (64, 64))
    q.mul_(0.5)
    graph.replay()
    assert torch.equal(out, ops.varlen_attention(q, k, v, cu, L, (64, 64)))


@pytest.mark.gpu
@pytest.mark.cute
def test_gpu_fa4_backward_replays_in_a_cuda_graph(cute_loaded):
    """auto sends long global layers to FA4 in training too: graphed training steps capture its backward."""
    fn = get_ops("auto", "cuda").varlen_attention
    lengths = (auto.LONG_SEQLEN, 5, 300)
    T, cu, L = sum(lengths), cu_seqlens(lengths, "cuda"), max(lengths)
    q, k, v = (t.requires_grad_() for t in _qkv(T, 4, 64, torch.bfloat16, "cuda"))
    do = torch.randn(T, 4, 64, device="cuda").to(torch.bfloat16)

    def step():
        return torch.autograd.grad(fn(q, k, v, cu, L), (q, k, v), do)

    eager = step()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up outside capture (compiles)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = step()
    graph.replay()
    for a_, b_ in zip(got, eager):
        assert torch.equal(a_, b_) or (a_.float() - b_.float()).abs().max() < 1e-2  # FA4's dq: atomics


@pytest.mark.gpu
@pytest.mark.cute
def test_gpu_modernbert_on_the_cute_backend(cute_loaded):
    import packedenc as pe
    from packedenc.models.modernbert import ModernBertConfig, init

    cfg = ModernBertConfig(vocab_size=500, hidden_size=256, intermediate_size=384, num_hidden_layers=3,
                           num_attention_heads=4, local_attention=128)  # K = 64: FA4 takes every layer
    b = pe.pack([torch.randint(0, 500, (n,)).tolist() for n in (1, 300, 77, 1000)], device="cuda")
    params32 = pe.tree_to(init(cfg, torch.Generator().manual_seed(0), dtype=torch.float32), "cuda")
    ref = pe.encode(params32, b.ids, b.cu_seqlens, b.max_seqlen, backend="reference")
    params = pe.tree_to(init(cfg, torch.Generator().manual_seed(0), dtype=torch.bfloat16), "cuda")
    out = pe.encode(params, b.ids, b.cu_seqlens, b.max_seqlen, backend="cute")
    cos = torch.nn.functional.cosine_similarity(out.float(), ref, dim=-1)
    assert cos.min() > 0.999, cos.min()
