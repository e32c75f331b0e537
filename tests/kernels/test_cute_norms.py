"""The cute backend's norms (quack's CuteDSL LayerNorm, kernels/cute/norms.py) and their auto rows.

CPU: which calls the covers rules take, the registration in cute/backend.py (with stand-in packages),
opcheck of both custom ops, the CPU implementation (the reference) with its gradients, statistics and
unused outputs, compile, and the auto rows (listed, never chosen without a record). GPU (`gpu` +
`cute`, with the extra installed): forward and gradients through get_ops("cute", "cuda") against the
fp32 reference with the 2x rule at T = 1, 7, 4097, 65536 and D = 768, 1024 (and other widths),
routing, compile, CUDA-graph replay, and a ModernBERT forward + backward against backend "triton".
"""

import importlib
import sys
import types

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from packedenc import kernels
from packedenc.errors import InputError
from packedenc.kernels import auto, choose, describe_ops, get_ops, reference
from packedenc.kernels.cute import norms as N
from tests.kernels._assert import assert_close_to_ref, skip_without_cute

EPS = 1e-5


def _inputs(T, D, dtype=torch.float32, device="cpu", bias=True):
    x = (torch.randn(T, D) * 2 + 0.5).to(device, dtype)
    r = torch.randn(T, D).to(device, dtype)
    w = (1 + 0.1 * torch.randn(D)).to(device, dtype)
    b = (0.1 * torch.randn(D)).to(device, dtype) if bias else None
    return x, r, w, b


# ---- which calls quack takes ------------------------------------------------------------------------


def test_covers_take_only_what_quack_runs(monkeypatch):
    monkeypatch.setattr(N, "_capability", lambda index: (9, 0))
    x, r, w, b = _inputs(6, 768)
    assert not N.covers_layer_norm(x.bfloat16(), w.bfloat16(), None, EPS)  # CPU tensors: never
    with FakeTensorMode():  # CUDA tensors' metadata, on any machine

        def ln(T=10, D=768, dtype=torch.bfloat16, wdtype=torch.bfloat16, bias=True, wD=None, x=None):
            x = torch.empty(T, D, device="cuda", dtype=dtype) if x is None else x
            w = torch.empty(wD or D, device="cuda", dtype=wdtype)
            return N.covers_layer_norm(x, w, w if bias else None, EPS)

        def add(rdtype=torch.bfloat16, rT=10, x_bias=False, D=768):
            x = torch.empty(10, D, device="cuda", dtype=torch.bfloat16)
            r = torch.empty(rT, D, device="cuda", dtype=rdtype)
            w = torch.empty(D, device="cuda", dtype=torch.bfloat16)
            return N.covers_add_layer_norm(x, r, w, None, EPS, w if x_bias else None)

        assert ln() and ln(D=1024) and ln(dtype=torch.float16) and ln(bias=False) and ln(T=0)
        assert ln(wdtype=torch.float32) and ln(D=N.MIN_HIDDEN) and ln(D=N.MAX_HIDDEN)
        assert not ln(dtype=torch.float32)  # fp32 activations: triton
        assert not ln(D=770)  # not 16-byte rows
        assert not ln(D=N.MIN_HIDDEN - 8) and not ln(D=N.MAX_HIDDEN + 8)  # narrower / wider than tested
        assert not ln(wD=1024)  # a weight of the wrong width: the next choice raises its own error
        strided = lambda stride: torch.empty_strided((10, 768), stride, device="cuda", dtype=torch.bfloat16)  # noqa: E731
        assert not ln(x=strided((1, 10)))  # strided last dim
        assert ln(x=strided((1536, 1)))  # a row stride: the launcher copies
        assert ln(x=torch.empty(2, 5, 768, device="cuda", dtype=torch.bfloat16))  # leading dims flatten
        assert add() and not add(rdtype=torch.float32) and not add(rT=1) and not add(x_bias=True)
        assert not add(D=770)
        monkeypatch.setattr(N, "_capability", lambda index: (8, 0))  # an A100: triton
        assert not ln() and not add()
        xc, wc = torch.empty(10, 768, device="cuda", dtype=torch.bfloat16), torch.empty(768, device="cuda")
        with pytest.raises(InputError, match="sm90"):
            N.layer_norm(xc, wc, None, EPS)
        with pytest.raises(InputError, match="x_bias"):
            N.add_layer_norm(xc, xc, wc, None, EPS)


def test_add_layer_norm_refuses_an_x_bias_on_any_device():
    x, r, w, b = _inputs(6, 8)
    with pytest.raises(InputError, match="no x_bias"):
        N.add_layer_norm(x, r, w, b, EPS, x_bias=b)


def test_the_backend_registers_the_norms_and_requires_quack(monkeypatch):
    """cute/backend.py with stand-in packages (this machine may have none): quack is required, and
    layer_norm / add_layer_norm are registered with their covers rules."""
    for name in ("cutlass", "cutlass.cute", "flash_attn", "flash_attn.cute", "tvm_ffi", "quack", "quack.rmsnorm"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.delitem(sys.modules, "packedenc.kernels.cute.backend", raising=False)
    monkeypatch.setattr(kernels, "_IMPLS", {**kernels._IMPLS, "cute": {}})
    monkeypatch.setattr(kernels, "_COVERS", dict(kernels._COVERS))
    try:
        backend = importlib.import_module("packedenc.kernels.cute.backend")
    finally:
        sys.modules.pop("packedenc.kernels.cute.backend", None)  # the next import is a real one
    assert backend.REQUIRES["quack.rmsnorm"] == "quack-kernels"
    assert kernels._IMPLS["cute"]["layer_norm"] is N.layer_norm
    assert kernels._IMPLS["cute"]["add_layer_norm"] is N.add_layer_norm
    assert kernels._COVERS[("cute", "layer_norm")] is N.covers_layer_norm
    assert kernels._COVERS[("cute", "add_layer_norm")] is N.covers_add_layer_norm
    assert "varlen_attention" in kernels._IMPLS["cute"]  # FA4 still registered beside them


# ---- the registered ops on the CPU: the reference behind the same registration -----------------------


@pytest.mark.parametrize("need_stats", [True, False])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_forward_op_opcheck(need_stats, residual, bias):
    x, r, w, b = _inputs(7, 16, bias=bias)
    leaves = [None if t is None else t.clone().requires_grad_(need_stats) for t in (x, r if residual else None, w, b)]
    torch.library.opcheck(torch.ops.packedenc.quack_layer_norm_fwd.default, (*leaves, EPS, need_stats))


@pytest.mark.parametrize("dsum", [False, True])
@pytest.mark.parametrize("has_bias", [False, True])
def test_backward_op_opcheck(dsum, has_bias):
    x, r, w, _ = _inputs(7, 16)
    mean, rstd = N._stats(x, EPS)
    args = (torch.randn_like(x), x, w, mean, rstd, r if dsum else None, EPS, has_bias)
    torch.library.opcheck(torch.ops.packedenc.quack_layer_norm_bwd.default, args)
    dx, sums = torch.ops.packedenc.quack_layer_norm_bwd(*args)
    assert dx.shape == x.shape and sums.dtype == torch.float32 and sums.shape == (1 + has_bias, 16)


def test_forward_op_statistics_are_those_of_the_layer_norm_input():
    x, r, w, b = _inputs(7, 16, dtype=torch.bfloat16)
    y, s, mean, rstd = torch.ops.packedenc.quack_layer_norm_fwd(x, r, w, b, EPS, True)
    s_ref = x + r  # rounded to bf16 before the statistics, as the reference does
    assert torch.equal(s, s_ref)
    torch.testing.assert_close(mean, s_ref.float().mean(-1))
    torch.testing.assert_close(rstd, torch.rsqrt(s_ref.float().var(-1, unbiased=False) + EPS))
    assert torch.equal(y, reference.layer_norm(s_ref, w, b, EPS))
    _, s, mean, rstd = torch.ops.packedenc.quack_layer_norm_fwd(x, None, w, b, EPS, False)
    assert s.numel() == mean.numel() == rstd.numel() == 0  # inference: nothing extra kept


def _grads(fn, leaves, cots):
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    out = fn(*leaves)
    outs = out if isinstance(out, tuple) else (out,)
    return out, torch.autograd.grad(outs, leaves, cots)


@pytest.mark.parametrize("bias", [False, True])
def test_cpu_is_the_reference_with_its_gradients(bias):
    x, r, w, b = _inputs(9, 16, bias=bias)
    extra = (b,) if bias else ()
    g1, g2 = torch.randn_like(x), torch.randn_like(x)

    def ln(fn):
        return lambda x, w, *b: fn(x, w, b[0] if b else None, EPS)

    def add(fn):
        return lambda x, r, w, *b: fn(x, r, w, b[0] if b else None, EPS)

    got, dgot = _grads(ln(N.layer_norm), (x, w, *extra), (g1,))
    want, dwant = _grads(ln(reference.layer_norm), (x, w, *extra), (g1,))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for a, c in zip(dgot, dwant):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)
    got, dgot = _grads(add(N.add_layer_norm), (x, r, w, *extra), (g1, g2))
    want, dwant = _grads(add(reference.add_layer_norm), (x, r, w, *extra), (g1, g2))
    for a, c in zip((*got, *dgot), (*want, *dwant)):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("used", ["normed", "sum"])
def test_add_layer_norm_with_an_unused_output(used):
    """The final norm's sum is unused (ModernBERT): its gradient is None, not a zero (T, D) tensor;
    with only the sum used the LayerNorm contributes nothing."""
    x, r, w, b = _inputs(6, 8)
    cot = torch.randn_like(x)

    def grads(fn):
        leaves = [t.detach().clone().requires_grad_() for t in (x, r, w, b)]
        y, s = fn(*leaves, EPS)
        return torch.autograd.grad(y if used == "normed" else s, leaves, cot, allow_unused=True)

    got, want = grads(N.add_layer_norm), grads(reference.add_layer_norm)
    for a, c in zip(got, want):
        assert (a is None) == (c is None)
        if a is not None:
            torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)
    if used == "sum":
        assert got[2] is None and torch.equal(got[0], cot) and torch.equal(got[1], cot)
    x2, r2, w2, b2 = _inputs(6, 8)
    assert N.add_layer_norm(x2, r2, w2, b2, EPS, keep_sum=False)[1] is None


def test_backward_without_statistics_is_an_error():
    x, r, w, b = _inputs(6, 8)
    y = torch.ops.packedenc.quack_layer_norm_fwd(x.requires_grad_(), None, w, b, EPS, False)[0]
    with pytest.raises(RuntimeError, match="without statistics"):
        y.sum().backward()


def test_ops_compile_fullgraph():
    x, r, w, b = _inputs(6, 8)

    def f(x, r):
        y, s = N.add_layer_norm(x, r, w, b, EPS)
        return N.layer_norm(y + s, w, None, EPS)

    torch.testing.assert_close(torch.compile(f, fullgraph=True, backend="aot_eager")(x, r), f(x, r))


# ---- the auto rows -----------------------------------------------------------------------------------


@pytest.fixture
def fake_cute_norms(monkeypatch):
    """The cute backend's real norm entries and covers rules, registered as if the extra loaded."""
    importlib.import_module("packedenc.kernels.triton")
    monkeypatch.setitem(kernels._IMPLS, "cute", {"layer_norm": N.layer_norm, "add_layer_norm": N.add_layer_norm})
    monkeypatch.setitem(kernels._COVERS, ("cute", "layer_norm"), N.covers_layer_norm)
    monkeypatch.setitem(kernels._COVERS, ("cute", "add_layer_norm"), N.covers_add_layer_norm)


def test_auto_lists_quack_for_the_norms_but_chooses_triton(fake_cute_norms):
    every = {"triton", "flash", "cute"}.__contains__
    for op in ("layer_norm", "add_layer_norm"):
        rows = auto.rows(op)
        assert [r.backend for r in rows] == ["cute", "triton"], op
        assert rows[1].chosen
        assert choose(op, "cute", "cuda", every) == "cute>triton"  # forced: what quack does not take, triton
        assert choose(op, "auto", "cpu", every) == "reference"
    assert not auto.rows("layer_norm")[0].chosen and "not faster" in auto.rows("layer_norm")[0].why_not
    assert not auto.rows("add_layer_norm")[0].chosen and "norm_probe" in auto.rows("add_layer_norm")[0].why_not
    assert choose("layer_norm", "auto", "cuda", every) == "triton"
    assert choose("add_layer_norm", "auto", "cuda", every) == "triton"
    assert choose("add_layer_norm", "cute", "cuda", every) == "cute>triton"
    assert "(not cute)" in describe_ops("auto", "cuda")



# ---- GPU, with the extra installed --------------------------------------------------------------------


@pytest.fixture
def quack_loaded():
    skip_without_cute(lambda cap: cap >= N.MIN_CAPABILITY, "quack's norms need an sm90+ GPU here")


def _f32(*ts):
    return [None if t is None else t.float() for t in ts]


def _check_forward(ops, T, D, bias, dtype=torch.bfloat16):
    x, r, w, b = _inputs(T, D, dtype, "cuda", bias)
    atol = 1e-3
    y = ops.layer_norm(x, w, b, EPS)
    assert_close_to_ref(y, reference.layer_norm(*_f32(x, w, b), EPS), reference.layer_norm(x, w, b, EPS),
                        atol=atol, what=f"layer_norm T={T} D={D}")
    y, s = ops.add_layer_norm(x, r, w, b, EPS)
    y_ref, s_ref = reference.add_layer_norm(x, r, w, b, EPS)
    assert torch.equal(s, s_ref)  # torch's rounded sum, bit for bit
    assert_close_to_ref(y, reference.layer_norm(*_f32(s_ref, w, b), EPS), y_ref, atol=atol,
                        what=f"add_layer_norm T={T} D={D}")
    assert torch.equal(ops.layer_norm(x, w, b, EPS), ops.layer_norm(x, w, b, EPS))  # deterministic


def _check_backward(ops, T, D, bias, dtype=torch.bfloat16):
    x, r, w, b = _inputs(T, D, dtype, "cuda", bias)
    g1, g2 = torch.randn(T, D, device="cuda").to(dtype), torch.randn(T, D, device="cuda").to(dtype)
    names = ("dx", "dw", "db")[: 2 + bias]

    def ln(fn):
        return lambda x, w, *b: fn(x, w, b[0] if b else None, EPS)

    def add(fn):
        return lambda x, r, w, *b: fn(x, r, w, b[0] if b else None, EPS)

    leaves = (x, w, b) if bias else (x, w)
    got, lowp, f32 = (_grads(ln(f), [t.to(c) for t in leaves], (g1.to(c),))[1] for f, c in
                      ((ops.layer_norm, dtype), (reference.layer_norm, dtype), (reference.layer_norm, torch.float32)))
    for name, a, c, e in zip(names, got, lowp, f32):
        assert_close_to_ref(a, e, c, atol=1e-4, what=f"layer_norm {name} T={T} D={D}")
    leaves = (x, r, w, b) if bias else (x, r, w)
    cot = (g1, g2)

    def addgrads(f, c):
        return _grads(add(f), [t.to(c) for t in leaves], tuple(g.to(c) for g in cot))[1]

    got, lowp, f32 = addgrads(ops.add_layer_norm, dtype), addgrads(reference.add_layer_norm, dtype), \
        addgrads(reference.add_layer_norm, torch.float32)
    for name, a, c, e in zip(("dx", "dres", *names[1:]), got, lowp, f32):
        assert_close_to_ref(a, e, c, atol=1e-4, what=f"add_layer_norm {name} T={T} D={D}")
    assert all(torch.equal(a, c) for a, c in zip(got, addgrads(ops.add_layer_norm, dtype)))  # deterministic


@pytest.mark.gpu
@pytest.mark.cute
@pytest.mark.parametrize("T", [1, 7, 4097, 65536])
@pytest.mark.parametrize("D", [768, 1024])  # ModernBERT base / large
@pytest.mark.parametrize("bias", [False, True])
def test_gpu_forward(quack_loaded, T, D, bias):
    ops = get_ops("cute", "cuda")
    assert dict(ops.chosen)["layer_norm"] == "cute>triton" and dict(ops.chosen)["add_layer_norm"] == "cute>triton"
    _check_forward(ops, T, D, bias)


@pytest.mark.gpu
@pytest.mark.cute
@pytest.mark.parametrize("T", [1, 7, 4097, 65536])
@pytest.mark.parametrize("D", [768, 1024])
@pytest.mark.parametrize("bias", [False, True])
def test_gpu_backward(quack_loaded, T, D, bias):
    _check_backward(get_ops("cute", "cuda"), T, D, bias)


@pytest.mark.gpu
@pytest.mark.cute
@pytest.mark.parametrize("D", [N.MIN_HIDDEN, 384, 4096, N.MAX_HIDDEN])  # other widths covers_* take
def test_gpu_other_widths_and_fp16(quack_loaded, D):
    ops = get_ops("cute", "cuda")
    _check_forward(ops, 1000, D, True, torch.float16)
    _check_backward(ops, 1000, D, True, torch.float16)


@pytest.mark.gpu
@pytest.mark.cute
def test_gpu_routing_views_compile_and_cuda_graph(quack_loaded):
    ops, tri = get_ops("cute", "cuda"), get_ops("triton", "cuda")
    x, r, w, b = _inputs(300, 768, torch.bfloat16, "cuda")
    P = torch.ops.packedenc
    # calls quack does not take go to triton: an x_bias, fp32 activations
    assert all(torch.equal(a, c) for a, c in zip(ops.add_layer_norm(x, r, w, b, EPS, x_bias=b),
                                                 tri.add_layer_norm(x, r, w, b, EPS, x_bias=b)))
    assert torch.equal(ops.layer_norm(x.float(), w, b, EPS), tri.layer_norm(x.float(), w, b, EPS))
    # the direct launch, the eager autograd path and the registered op give the same forward
    y = ops.layer_norm(x, w, b, EPS)
    assert torch.equal(y, ops.layer_norm(x, w.clone().requires_grad_(), b, EPS))
    assert torch.equal(y, P.quack_layer_norm_fwd(x, None, w, b, EPS, True)[0])
    # views: a row-strided slice, and an odd offset (copied to an aligned buffer first)
    wide = torch.randn(300, 1536, device="cuda").to(torch.bfloat16)
    assert torch.equal(ops.layer_norm(wide[:, :768], w, b, EPS), ops.layer_norm(wide[:, :768].contiguous(), w, b, EPS))
    flat = torch.randn(300 * 768 + 1, device="cuda").to(torch.bfloat16)
    odd = flat[1:].view(300, 768)
    assert torch.equal(ops.layer_norm(odd, w, b, EPS), ops.layer_norm(odd.clone(), w, b, EPS))
    f = torch.compile(lambda x, r: ops.add_layer_norm(x, r, w, b, EPS), fullgraph=True)
    assert all(torch.equal(a, c) for a, c in zip(f(x, r), ops.add_layer_norm(x, r, w, b, EPS)))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ops.add_layer_norm(x, r, w, b, EPS)  # warm-up outside capture (quack compiles)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.add_layer_norm(x, r, w, b, EPS)
    x.mul_(0.5)
    graph.replay()
    assert all(torch.equal(a, c) for a, c in zip(out, ops.add_layer_norm(x, r, w, b, EPS)))


@pytest.mark.gpu
@pytest.mark.cute
def test_gpu_modernbert_forward_and_backward_on_cute_norms(quack_loaded, monkeypatch):
    rmsnorm = importlib.import_module("quack.rmsnorm")  # `quack.rmsnorm` the attribute is quack's function

    import packedenc as pe
    from packedenc.models.modernbert import ModernBertConfig, init

    calls = {"fwd": 0, "bwd": 0}
    for name, key in (("layernorm_fwd", "fwd"), ("_rmsnorm_bwd", "bwd")):
        real = getattr(rmsnorm, name)
        monkeypatch.setattr(rmsnorm, name, lambda *a, _f=real, _k=key, **k: (calls.__setitem__(_k, calls[_k] + 1),
                                                                                   _f(*a, **k))[1])
    cfg = ModernBertConfig(vocab_size=500, hidden_size=256, intermediate_size=384, num_hidden_layers=3,
                           num_attention_heads=4, local_attention=128)
    b = pe.pack([torch.randint(0, 500, (n,)).tolist() for n in (1, 300, 77, 1000)], device="cuda")
    cot = torch.randn(b.ids.numel(), 256, device="cuda")

    def run(dtype, backend):
        params = pe.tree_to(init(cfg, torch.Generator().manual_seed(0), dtype=dtype), "cuda")
        leaves, spec = torch.utils._pytree.tree_flatten(params)
        leaves = [t.detach().clone().requires_grad_() for t in leaves]
        out = pe.encode(torch.utils._pytree.tree_unflatten(leaves, spec), b.ids, b.cu_seqlens, b.max_seqlen,
                        backend=backend)
        return out.detach(), torch.autograd.grad((out.float() * cot).sum(), leaves, allow_unused=True)

    ref, gref = run(torch.float32, "reference")
    tri, gtri = run(torch.bfloat16, "triton")
    assert calls == {"fwd": 0, "bwd": 0}
    out, gout = run(torch.bfloat16, "cute")
    assert calls["fwd"] >= cfg.num_hidden_layers and calls["bwd"] >= cfg.num_hidden_layers, calls  # quack ran
    cos = torch.nn.functional.cosine_similarity(out.float(), ref, dim=-1)
    assert cos.min() > 0.999, cos.min()
    for i, (a, t, r) in enumerate(zip(gout, gtri, gref)):
        if r is None:
            continue
        rel = lambda g: ((g.float() - r).norm() / r.norm().clamp_min(1e-12)).item()  # noqa: E731
        assert rel(a) <= 2 * rel(t) + 1e-2, f"leaf {i} {tuple(r.shape)}: cute {rel(a):.3g} vs triton {rel(t):.3g}"
