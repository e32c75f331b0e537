"""The op table: backend choice, logging once, and torch.compile(fullgraph=True) through get_ops."""

import logging

import pytest
import torch

import packedenc as pe
from packedenc.errors import ConfigError
from packedenc.kernels import OP_NAMES, get_ops


def _tiny_modernbert(dtype=torch.float32, device="cpu"):
    from packedenc.models.modernbert import ModernBertConfig, init

    cfg = ModernBertConfig(vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                           num_attention_heads=2, local_attention=4)  # window (2, 2) < the lengths below
    return pe.tree_to(init(cfg, torch.Generator().manual_seed(0), dtype=dtype), device=device)


def test_unknown_backend_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown backend"):
        get_ops("fastest", "cpu")


def test_cpu_uses_the_reference_and_a_forced_gpu_backend_is_an_error():
    for backend in ("auto", "reference"):
        ops = get_ops(backend, "cpu")
        chosen = dict(ops.chosen)  # composite ops run their parts, which are the reference here
        assert chosen.pop("rotary_attention") == "rotary+varlen_attention"
        assert chosen.pop("linear_glu") == "linear+glu"
        assert chosen.pop("layer_norm_linear_glu") == "layer_norm+linear_glu"
        assert chosen.pop("layer_norm_linear") == "layer_norm+linear"
        assert all(b == "reference" for b in chosen.values()), (backend, ops.chosen)
        assert len(ops.chosen) == len(OP_NAMES)
    for backend in ("triton", "flash", "cute"):  # the caller asked for a kernel that cannot run there: say so
        with pytest.raises(ConfigError, match=rf"backend='{backend}' runs on CUDA tensors, but these are on cpu"):
            get_ops(backend, "cpu")


def test_encode_compiles_fullgraph_on_cpu():
    params = _tiny_modernbert()
    b = pe.pack([[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11]])
    eager = pe.encode(params, b.ids, b.cu_seqlens, b.max_seqlen, backend="reference")
    compiled = torch.compile(pe.encode, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(params, b.ids, b.cu_seqlens, b.max_seqlen), eager)


def test_the_table_is_built_eagerly_inside_a_trace(monkeypatch):
    """A first `get_ops` under torch.compile (nothing cached) runs `_choose_all` eagerly, as a
    constant: dynamo cannot trace its imports and logging. packedenc marks it without importing
    torch._dynamo (a second of every `import packedenc`); torch's own decorator marks the same way."""
    from torch._dynamo import assume_constant_result

    from packedenc import kernels

    probe = assume_constant_result(lambda: 0)
    assert {k: v for k, v in vars(probe).items()} == {kernels._CONSTANT_MARK: True}
    assert getattr(kernels._choose_all, kernels._CONSTANT_MARK) is True
    monkeypatch.setattr(kernels, "_CHOSEN", {})
    monkeypatch.setattr(kernels, "_TABLES", {})
    params = _tiny_modernbert()
    b = pe.pack([[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11]])
    compiled = torch.compile(pe.encode, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(params, b.ids, b.cu_seqlens, b.max_seqlen),
                               pe.encode(params, b.ids, b.cu_seqlens, b.max_seqlen, backend="reference"))


def test_import_does_not_load_dynamo():
    import subprocess
    import sys

    code = "import sys, packedenc; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def _varlen_batches(device="cpu"):
    for lengths in ([3, 7, 1], [5, 2, 9, 4, 6], [12, 1, 3, 8]):  # tokens, sequences and longest all vary
        yield pe.pack([[1 + (i * 7 + j) % 90 for j in range(L)] for i, L in enumerate(lengths)], device=device)


def test_encode_compiles_once_for_batches_of_any_size_on_cpu():
    from torch._dynamo.testing import CompileCounterWithBackend

    params = _tiny_modernbert()
    counter = CompileCounterWithBackend("aot_eager")
    f = torch.compile(pe.encode, fullgraph=True, dynamic=True, backend=counter)
    frames = []
    for b in _varlen_batches():
        torch.testing.assert_close(f(params, b.ids, b.cu_seqlens, b.max_seqlen),
                                   pe.encode(params, b.ids, b.cu_seqlens, b.max_seqlen))
        frames.append(counter.frame_count)
    assert frames[0] == frames[-1], frames


@pytest.mark.gpu
def test_gpu_auto_picks_triton_and_logs_once(caplog):
    from packedenc import kernels

    kernels._CHOSEN.pop(("auto", "cuda"), None)
    with caplog.at_level(logging.INFO, logger="packedenc"):
        ops = get_ops("auto", "cuda")
        get_ops("auto", torch.device("cuda", 0))
    chosen = dict(ops.chosen)
    for op in ("layer_norm", "embed_layer_norm", "rotary", "glu"):
        assert chosen[op] == "triton", chosen
    # with the cute extra, its measured rows come first and hand the rest to triton
    cute = kernels._load_backend("cute")
    assert chosen["linear_glu"] == ("cute[large-pack]>" if cute else "") + "triton[small-uncaptured]>linear+glu"
    assert chosen["add_layer_norm"] == "triton"  # quack's is listed, not chosen (auto.py says why)
    assert chosen["varlen_attention"] == ("cute[long-global]>cute[large-global]>triton" if cute else "triton")
    assert sum("backend=auto" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["auto", "reference"])  # fused + flash; plain torch
def test_gpu_encode_compiles_fullgraph(backend):
    params = _tiny_modernbert(torch.bfloat16, "cuda")
    b = pe.pack([[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11]], device="cuda")
    eager = pe.encode(params, b.ids, b.cu_seqlens, b.max_seqlen, backend=backend)
    out = torch.compile(pe.encode, fullgraph=True)(params, b.ids, b.cu_seqlens, b.max_seqlen, backend=backend)
    cos = torch.nn.functional.cosine_similarity(out.float(), eager.float(), dim=-1)
    assert cos.min() > 0.999, cos.min()


@pytest.mark.gpu
def test_gpu_encode_compiles_once_for_batches_of_any_size():
    """Varlen batches differ in tokens, sequences and longest sequence: with dynamic shapes one
    compiled graph (inductor launching our Triton kernels) serves them all and matches eager."""
    from torch._dynamo.testing import CompileCounterWithBackend

    params = _tiny_modernbert(torch.bfloat16, "cuda")
    counter = CompileCounterWithBackend("inductor")
    f = torch.compile(pe.encode, fullgraph=True, dynamic=True, backend=counter)
    frames = []
    for n, b in enumerate(_varlen_batches("cuda")):
        eager = pe.encode(params, b.ids, b.cu_seqlens, b.max_seqlen)
        out = f(params, b.ids, b.cu_seqlens, b.max_seqlen)
        frames.append(counter.frame_count)
        cos = torch.nn.functional.cosine_similarity(out.float(), eager.float(), dim=-1)
        assert cos.min() > 0.999, (n, cos.min())
    assert frames[0] == frames[-1], frames  # the later batches recompiled nothing


@pytest.mark.gpu
def test_gpu_fused_ops_replay_in_a_cuda_graph():
    """No host sync or allocation surprise inside the ops: capture once, replay equals eager."""
    ops = get_ops("auto", "cuda")
    T, D, H, K = 300, 64, 2, 32
    x, r = torch.randn(T, D, device="cuda", dtype=torch.bfloat16), torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(D, device="cuda", dtype=torch.bfloat16)
    qkv = torch.randn(T, 3, H, K, device="cuda", dtype=torch.bfloat16)
    pos = torch.arange(T, device="cuda") % 100
    cu = torch.tensor([0, 100, 200, 300], dtype=torch.int32, device="cuda")

    def f():
        h, s = ops.add_layer_norm(x, r, w, None, 1e-5)
        q, k = ops.rotary(qkv, pos, 12345.0)  # a theta never seen before: its table is built at warm-up
        o = ops.varlen_attention(q, k, qkv[:, 2], cu, 100, window=(8, 8))
        return ops.layer_norm(h + s, w, None, 1e-5), o, ops.glu(torch.cat((h, s), -1))

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        f()  # warm-up outside capture (compiles kernels, fills the RoPE table cache)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = f()
    x.mul_(0.5)
    qkv.add_(0.25)
    graph.replay()
    for a, b in zip(outs, f()):
        assert torch.equal(a, b)


def test_direct_launch_only_for_plain_cuda_inference():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from packedenc.kernels.triton._common import direct_launch

    assert not direct_launch(torch.randn(3))  # CPU: the registered op (reference)
    with FakeTensorMode():
        assert not direct_launch(torch.empty(3, device="cuda" if torch.cuda.is_available() else "cpu"))


@pytest.mark.gpu
def test_gpu_direct_launch_equals_the_registered_op():
    from packedenc.kernels.triton._common import direct_launch

    ops = get_ops("triton", "cuda")
    P = torch.ops.packedenc
    x, r = torch.randn(70, 96, device="cuda", dtype=torch.bfloat16), torch.randn(70, 96, device="cuda", dtype=torch.bfloat16)
    w, ids = torch.randn(96, device="cuda", dtype=torch.bfloat16), torch.randint(0, 70, (33,), device="cuda")
    qkv, pos = torch.randn(70, 3, 2, 48, device="cuda", dtype=torch.bfloat16), torch.arange(70, device="cuda")
    assert direct_launch(x, w) and not direct_launch(x, w.clone().requires_grad_())
    assert torch.equal(ops.layer_norm(x, w, None, 1e-5), P.layer_norm(x, w, None, 1e-5))
    assert all(torch.equal(a, b) for a, b in zip(ops.add_layer_norm(x, r, w, w, 1e-5), P.add_layer_norm(x, r, w, w, 1e-5)))
    x1, r1 = x.clone(), r.clone()  # eager inference writes into inputs the caller gives up
    y1, s1 = ops.add_layer_norm(x1, r1, w, w, 1e-5, overwrite_input=True)
    assert y1.data_ptr() == x1.data_ptr() and s1.data_ptr() == r1.data_ptr()
    assert all(torch.equal(a, b) for a, b in zip((y1, s1), P.add_layer_norm(x, r, w, w, 1e-5)))
    assert torch.equal(ops.embed_layer_norm(ids, x, w, None, 1e-5), P.embed_layer_norm(ids, x, w, None, 1e-5))
    assert all(torch.equal(a, b) for a, b in zip(ops.rotary(qkv, pos, 1e4), P.rotary(qkv, pos, 1e4)))
    assert torch.equal(ops.glu(x, "silu"), P.glu(x, "silu"))


# ---- linear_glu: a gated MLP's input projection as one op (ModernBERT's Wi + GeGLU) ----------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_glu_reference_is_the_two_steps_it_replaces(dtype, bias):
    from packedenc.kernels import reference

    x, w = torch.randn(7, 16).to(dtype), torch.randn(2 * 24, 16).to(dtype)
    b = torch.randn(48).to(dtype) if bias else None
    for act in ("gelu", "silu", "gelu_pytorch_tanh"):
        want = reference.glu(reference.linear(x, w, b), act)
        assert torch.equal(reference.linear_glu(x, w, b, act), want), act
    with pytest.raises(ConfigError, match="mish"):
        reference.linear_glu(x, w, b, "mish")


def test_modernbert_mlp_calls_linear_glu_once_per_layer():
    import dataclasses

    from packedenc.kernels import reference

    params = _tiny_modernbert()
    b = pe.pack([[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11]])
    ops = get_ops("reference", "cpu")
    calls = []

    def spy(x, weight, bias=None, act="gelu"):
        calls.append((tuple(x.shape), tuple(weight.shape), act))
        return reference.linear_glu(x, weight, bias, act)

    def no_glu(*a, **k):
        raise AssertionError("ModernBERT's MLP should call linear_glu, not glu")

    spied = dataclasses.replace(ops, linear_glu=spy, glu=no_glu)
    out = pe.encode(params, b.ids, b.cu_seqlens, b.max_seqlen, backend=spied)
    assert torch.equal(out, pe.encode(params, b.ids, b.cu_seqlens, b.max_seqlen, backend=ops))
    assert calls == [((11, 32), (96, 32), "gelu")] * 2  # (T, D), Wi (2F, D), per layer


def test_cli_info_ops_prints_every_op_without_a_model(capsys):
    from packedenc import cli

    assert cli.main(["info", "--ops", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "backend='auto' on cpu" in out
    for op in OP_NAMES:
        assert f"\n{op} " in out, op


# ---- composite ops: rotary_attention = varlen_attention(*rotary(...)) -------------------------------


def test_a_composite_op_ends_its_chain_with_its_parts_from_the_same_table():
    from packedenc import kernels

    usable = {"triton", "flash", "reference"}.__contains__
    kernels._load_backend("triton")  # its registrations, whichever tests ran before this one
    # auto: the fused row's record, then the parts for the calls it does not take
    assert kernels.choose("rotary_attention", "auto", "cuda", usable) == "triton[uncaptured]>rotary+varlen_attention"
    assert kernels.choose("rotary_attention", "triton", "cuda", usable) == "triton>rotary+varlen_attention"
    assert kernels.choose("rotary_attention", "reference", "cuda", usable) == "rotary+varlen_attention"
    # the parts are the table's own entries: a call the fused kernel does not take reaches them
    calls = []
    rot = lambda qkv, pos, theta, scaling=1.0, with_v=False, overwrite_input=False: (  # noqa: E731
        calls.append(("rotary", theta, with_v, overwrite_input)) or (qkv[:, 0], qkv[:, 1], qkv[:, 2]))
    att = lambda q, k, v, cu, L, window=(-1, -1), scale=None, **kw: calls.append(("attn", L, window, kw)) or q  # noqa: E731
    routed = kernels._entry("rotary_attention", "triton>rotary+varlen_attention",
                            kernels.reference.compose_rotary_attention(rot, att))
    qkv = torch.zeros(5, 3, 2, 4)
    out = routed(qkv, torch.arange(5), 10.0, torch.tensor([0, 5], dtype=torch.int32), 5, window=(2, 2),
                 overwrite_input=True)
    assert calls == [("rotary", 10.0, True, True), ("attn", 5, (2, 2), {})] and out.shape == (5, 2, 4)


def test_the_fused_rotary_attention_stays_out_of_cuda_graph_capture(monkeypatch):
    """auto's rotary_attention row saves host time only: a call being captured into a CUDA graph
    goes to the parts (rotary, then varlen_attention), which cost the device less."""
    from packedenc.kernels import auto

    class OnCuda(torch.Tensor):  # a host tensor that says it is on a GPU: the rule reads host values only
        is_cuda = True

    x = torch.Tensor._make_subclass(OnCuda, torch.zeros(2))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert auto.uncaptured(torch.zeros(2)) and auto.uncaptured(x) and auto.uncaptured(1.0)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert not auto.uncaptured(x) and auto.uncaptured(torch.zeros(2))  # a CPU tensor is never captured
    assert [r.shape for r in auto.rows("rotary_attention")] == ["uncaptured"]


def test_unfused_runs_a_composite_as_its_parts():
    from packedenc import kernels

    ops = kernels.unfused(get_ops("auto", "cpu"), "rotary_attention")
    assert dict(ops.chosen)["rotary_attention"] == "rotary+varlen_attention"
    qkv = torch.randn(9, 3, 2, 8)
    cu, pos = torch.tensor([0, 4, 9], dtype=torch.int32), torch.tensor([0, 1, 2, 3, 0, 1, 2, 3, 4])
    want = kernels.reference.varlen_attention(*kernels.reference.rotary(qkv, pos, 100.0, with_v=True), cu, 5)
    torch.testing.assert_close(ops.rotary_attention(qkv, pos, 100.0, cu, 5), want)


def test_modernbert_calls_rotary_attention_once_per_layer():
    params = _tiny_modernbert()
    b = pe.pack([[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11]])
    base = get_ops("reference", "cpu")
    seen = []

    def spy(*args, **kwargs):
        seen.append(kwargs.get("window"))
        return base.rotary_attention(*args, **kwargs)

    import dataclasses

    ops = dataclasses.replace(base, rotary_attention=spy)
    out = pe.encode(params, b.ids, b.cu_seqlens, b.max_seqlen, backend=ops)
    assert seen == [(-1, -1), (2, 2)]  # layer 0 global, layer 1 local (local_attention 4)
    torch.testing.assert_close(out, pe.encode(params, b.ids, b.cu_seqlens, b.max_seqlen, backend="reference"))


def _tiny_params(family):
    from packedenc.models import bert, deberta

    if family == "modernbert":
        return _tiny_modernbert()
    cfg = (bert.BertConfig(vocab_size=101, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                           num_attention_heads=4, max_position_embeddings=256) if family == "bert"
           else deberta.PRESETS["tiny"])
    return pe.init(cfg, torch.Generator().manual_seed(0))


# per family: (norms written in place, attentions written into q) of one tiny 2-layer encode.
# ModernBERT's inference adds each block's output in its GEMM (`linear_add`): its norms are plain
# LayerNorms of the residual stream, which stays live, so none is written in place.
_IN_PLACE = {"modernbert": (0, 2), "bert": (4, 0), "deberta": (4, 0)}


@pytest.mark.parametrize("family", sorted(_IN_PLACE))
def test_eager_inference_path_on_the_interpreter(family, monkeypatch):
    """The GPU's eager inference chain (direct launches; ModernBERT's fused RoPE forward writing
    into qkv's q slot; norms writing into the inputs the layer gives up), run by the interpreter on
    a CPU machine (CPU tensors taken for CUDA ones) and by the kernels on a GPU: the same hidden
    states as the reference."""
    import importlib
    import pkgutil

    from packedenc import kernels
    from packedenc.kernels import triton as KT
    from packedenc.kernels.triton import attention_op as AO
    from packedenc.kernels.triton import layer_norm_kernels as LK

    no_grad = lambda *t: not (torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in t))  # noqa: E731
    for m in pkgutil.walk_packages(KT.__path__, KT.__name__ + "."):
        mod = importlib.import_module(m.name)
        if hasattr(mod, "direct_launch"):
            monkeypatch.setattr(mod, "direct_launch", no_grad)
        if hasattr(mod, "eager_cuda"):
            monkeypatch.setattr(mod, "eager_cuda", lambda *t: True)
    usable = {"triton", "reference"}.__contains__
    chosen = tuple((op, kernels.choose(op, "auto", "cuda", usable)) for op in kernels.OP_NAMES)
    assert dict(chosen)["rotary_attention"] == "triton[uncaptured]>rotary+varlen_attention"
    ops = kernels.Ops(backend="auto", chosen=chosen, **kernels._entries(chosen))
    taken = [0, 0]
    can = LK._can_overwrite
    monkeypatch.setattr(LK, "_can_overwrite", lambda *a: can(*a) and taken.__setitem__(0, taken[0] + 1) is None)
    fwd = AO.attention_fwd

    def attention_fwd(*args, **kwargs):
        out = kwargs.get("out")
        taken[1] += out is not None and out.data_ptr() == args[0].data_ptr()
        return fwd(*args, **kwargs)

    monkeypatch.setattr(AO, "attention_fwd", attention_fwd)
    from tests.kernels._assert import DEVICE  # the interpreter on a CPU machine, the kernels on a GPU one

    params = pe.tree_to(_tiny_params(family), device=DEVICE)
    g = torch.Generator().manual_seed(1)  # sequences across the 64-row query tiles: programs share k / v rows
    b = pe.pack([torch.randint(3, 100, (n,), generator=g).tolist() for n in (70, 3, 50, 1, 90, 17)]).to(DEVICE)
    with torch.inference_mode():
        got = pe.encode(params, b.ids, b.cu_seqlens, b.max_seqlen, backend=ops)
    want = pe.encode(params, b.ids, b.cu_seqlens, b.max_seqlen, backend="reference")
    # fp32: exact-ish on the interpreter; a GPU's fp32 dots may run as TF32 (the parity tests hold the 2x rule)
    tol = dict(atol=3e-5, rtol=1e-4) if torch.device(DEVICE).type == "cpu" else dict(atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(got, want, **tol)
    assert tuple(taken) == _IN_PLACE[family]


def test_encode_imports_only_its_own_family():
    """`pe.encode` finds the family by the params' class name before importing anything: a BERT
    encode (all-MiniLM, the README's job) does not import the DeBERTa or graph-transformer
    modules (DeBERTa's alone ~0.1 s), registered before BERT."""
    import subprocess
    import sys

    code = ("import sys, torch, packedenc as pe\n"
            "from packedenc.models.bert.config import BertConfig\n"
            "from packedenc.models.bert.params import init\n"
            "cfg = BertConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,"
            " num_attention_heads=2)\n"
            "p = init(cfg, torch.Generator().manual_seed(0))\n"
            "b = pe.pack([[1, 2, 3]])\n"
            "pe.encode(p, b.ids, b.cu_seqlens, b.max_seqlen)\n"
            "print(sorted(m for m in sys.modules if m.startswith('packedenc.models.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "packedenc.models.bert" in out
    assert "deberta" not in out and "graph_transformer" not in out
