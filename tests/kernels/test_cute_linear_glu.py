"""The cute backend's linear_glu: the GeGLU input projection as one CuteDSL Hopper GEMM.

CPU: which calls the covers rule takes, the custom op (its CPU implementation is the reference),
forward-only refusals, the auto row (listed, never chosen without a record), the routing of a
forced "cute" table (training and biased calls to triton), and, where nvidia-cutlass-dsl is
installed, that the kernel lowers to sm_90a (cute.compile needs no GPU). GPU (`gpu` + `cute`, the
extra installed, an sm90 device): the 2x rule against the fp32 reference at ragged T, ModernBERT
base and large widths, fp16 and bf16; the table, compile and CUDA-graph capture.
Shapes: T packed tokens, D hidden, F mlp width.
"""

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from packedenc import kernels
from packedenc.errors import InputError
from packedenc.kernels import auto, choose, get_ops, reference
from packedenc.kernels.cute import linear_glu as LG
from tests.kernels._assert import HAS_CUTLASS, assert_close_to_ref, skip_without_cute

ROOT = Path(__file__).resolve().parents[2]


def _xw(T, D, F, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(T + D + F)
    x = torch.randn(T, D, generator=g)
    w = torch.randn(2 * F, D, generator=g) * D**-0.5  # u ~ N(0, 1): both GELU branches are used
    return x.to(device=device, dtype=dtype), w.to(device=device, dtype=dtype)


# ---- the covers rule and the op on the CPU ---------------------------------------------------------


def test_covers_takes_only_what_the_hopper_gemm_runs(monkeypatch):
    x, w = _xw(5, 16, 8, torch.bfloat16)
    assert not LG.covers_linear_glu(x, w)  # CPU tensors: never
    monkeypatch.setattr(LG, "_capability", lambda index: (9, 0))
    with FakeTensorMode():  # CUDA tensors' metadata, on any machine

        def covers(T=100, D=768, F=1152, dtype=torch.bfloat16, wdtype=None, bias=None, act="gelu", grad=False,
                   transposed=False):
            x = torch.empty(T, D, device="cuda", dtype=dtype)
            w = torch.empty(2 * F, D, device="cuda", dtype=wdtype or dtype)
            if transposed:
                w = torch.empty(D, 2 * F, device="cuda", dtype=dtype).t()
            return LG.covers_linear_glu(x, w.requires_grad_(grad), bias, act)

        assert covers() and covers(dtype=torch.float16) and covers(T=1) and covers(D=1024, F=2624)
        assert covers(act="gelu_python")  # HF's other name of exact GELU
        assert not covers(dtype=torch.float32) and not covers(wdtype=torch.float16)
        assert not covers(act="gelu_pytorch_tanh") and not covers(act="silu")
        assert not covers(bias=torch.empty(2304, device="cuda", dtype=torch.bfloat16))
        assert not covers(D=100) and not covers(F=1150)  # TMA: 16-byte row strides
        assert not covers(transposed=True)
        assert not covers(grad=True)  # forward-only: training goes to the next choice
        with torch.no_grad():
            assert covers(grad=True)  # weights that require grad, in inference: taken
        monkeypatch.setattr(LG, "_capability", lambda index: (10, 0))  # WGMMA is sm90 only
        assert not covers()
        monkeypatch.setattr(LG, "_capability", lambda index: (8, 0))
        assert not covers()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_op_on_cpu_is_the_reference(dtype):
    x, w = _xw(9, 32, 24, dtype)
    out = LG.linear_glu(x, w, None, "gelu")
    assert torch.equal(out, reference.linear_glu(x, w, None, "gelu"))
    assert out.shape == (9, 24) and out.dtype == dtype
    torch.library.opcheck(torch.ops.packedenc.cute_linear_glu.default, (x, w, "gelu"))
    f = torch.compile(lambda x, w: LG.linear_glu(x, w), fullgraph=True, backend="aot_eager")
    assert torch.equal(f(x, w), out)


def test_forward_only_and_no_bias_are_input_errors():
    x, w = _xw(4, 16, 8)
    with pytest.raises(InputError, match="forward-only"):
        LG.linear_glu(x, w.clone().requires_grad_())
    with torch.no_grad():  # the same tensors in inference: fine
        assert LG.linear_glu(x, w.clone().requires_grad_()).shape == (4, 8)
    with pytest.raises(InputError, match="no bias"):
        LG.linear_glu(x, w, torch.zeros(16))
    with pytest.raises(InputError, match="act"):
        LG.linear_glu(x, w, None, "silu")


# ---- the auto table and the routing of a forced "cute" table ---------------------------------------


@pytest.fixture
def fake_cute(monkeypatch):
    """The cute backend's real linear_glu covers rule, registered as if the extra loaded, with spies."""
    calls = []
    importlib.import_module("packedenc.kernels.triton")
    monkeypatch.setitem(kernels._IMPLS, "cute", {"linear_glu": lambda *a, **k: calls.append("cute")})
    # what cute does not take goes to the fused Triton GEMM on small packs (its covers rule is the
    # real one, which fake tensors never meet, so it is stubbed to "inference"), the rest to the
    # op's parts, whose gate is the spy
    monkeypatch.setitem(kernels._IMPLS, "triton", {**kernels._IMPLS["triton"],
                                                   "linear_glu": lambda *a, **k: calls.append("triton"),
                                                   "glu": lambda *a, **k: calls.append("parts")})
    monkeypatch.setitem(kernels._COVERS, ("triton", "linear_glu"), lambda x, w, b=None, act="gelu": (
        x.dtype in (torch.float16, torch.bfloat16) and not (torch.is_grad_enabled() and x.requires_grad)))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setitem(kernels._IMPLS, "reference", {**kernels._IMPLS["reference"],  # no GEMM on fake tensors
                                                      "linear": lambda x, w, b=None: x.new_empty(x.shape[0], w.shape[0])})
    monkeypatch.setitem(kernels._COVERS, ("cute", "linear_glu"), LG.covers_linear_glu)
    monkeypatch.setattr(kernels, "_ROUTES", {})  # routed entries are cached by name: build them anew
    monkeypatch.setattr(LG, "_capability", lambda index: (9, 0))
    return calls


def _table(backend):
    """The table's linear_glu entry for `backend` on CUDA with the fixture's backends (composites
    are built from the same table's parts)."""
    usable = {"triton", "cute"}.__contains__
    return kernels._entries(tuple((op, choose(op, backend, "cuda", usable)) for op in kernels.OP_NAMES))["linear_glu"]


def test_the_auto_row_is_chosen_on_its_record_and_hands_training_on(fake_cute):
    rows = auto.rows("linear_glu")
    assert [r.name for r in rows] == ["cute[large-pack]", "triton[small-uncaptured]"]
    assert rows[0].chosen and rows[0].evidence.workloads == ("geglu-64k",) and rows[0].shape == "large-pack"
    assert rows[1].chosen and rows[1].evidence.workloads == ("query", "doc-b8", "doc-b16")
    every = {"triton", "flash", "cute"}.__contains__
    want = "cute[large-pack]>triton[small-uncaptured]>linear+glu"  # then training and the packs between
    assert choose("linear_glu", "auto", "cuda", every) == want
    assert choose("linear_glu", "auto", "cuda", {"triton"}.__contains__) == "triton[small-uncaptured]>linear+glu"
    assert choose("linear_glu", "cute", "cuda", every) == "cute>triton[small-uncaptured]>linear+glu"  # then auto's
    assert choose("linear_glu", "auto", "cuda", {"flash"}.__contains__) == "linear+glu"  # its parts
    assert str(rows[0].evidence) == "ops_h200.json: packedenc[cute] beats packedenc[triton] on ms (geglu-64k)"


def test_a_forced_cute_table_hands_what_it_does_not_take_to_auto_s_rows(fake_cute):
    fn = _table("cute")
    with FakeTensorMode():
        x = torch.empty(100, 768, device="cuda", dtype=torch.bfloat16)
        w = torch.empty(2304, 768, device="cuda", dtype=torch.bfloat16)
        fn(x, w, None, "gelu")  # inference: the Hopper GEMM
        fn(x.requires_grad_(), w, None, "gelu")  # training
        fn(x.detach(), w, torch.empty(2304, device="cuda", dtype=torch.bfloat16), "gelu")  # a bias
        fn(x.detach(), w, None, "silu")  # another activation
        fn(x.detach().float(), w.float(), None, "gelu")  # fp32
        with torch.no_grad():
            fn(x, w, None, "gelu")  # inputs that require grad, in inference
    assert fake_cute == ["cute", "parts", "triton", "triton", "parts", "cute"]  # bias, silu: the Triton GEMM


def test_auto_sends_large_packs_to_the_cute_gemm_and_small_eager_ones_to_the_triton_gemm(fake_cute, monkeypatch):
    fn = _table("auto")
    with FakeTensorMode(), torch.no_grad():
        w = torch.empty(2304, 768, device="cuda", dtype=torch.bfloat16)
        for tokens in (3628, auto.SMALL_PACK - 1, auto.SMALL_PACK, auto.LARGE_PACK - 1, auto.LARGE_PACK, 65536):
            fn(torch.empty(tokens, 768, device="cuda", dtype=torch.bfloat16), w, None, "gelu")
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)  # a CUDA graph's capture
        fn(torch.empty(3628, 768, device="cuda", dtype=torch.bfloat16), w, None, "gelu")
    with FakeTensorMode():
        x = torch.empty(3628, 768, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
        fn(x, w, None, "gelu")  # training: the parts
    assert fake_cute == ["triton", "triton", "parts", "parts", "cute", "cute", "parts", "parts"]


# ---- the kernel lowers without a GPU ---------------------------------------------------------------

_COMPILE = """
import torch
from packedenc.kernels.cute import geglu_gemm as G
for dtype, D, F, tile in [(torch.bfloat16, 768, 1152, G.DEFAULT_TILE), (torch.float16, 1024, 2624, G.DEFAULT_TILE),
                          (torch.bfloat16, 768, 1152, G.Tile(64, 128, 4)),
                          (torch.bfloat16, 768, 1152, G.Tile(cluster=(2, 1)))]:
    assert G.compiled(dtype, D, F, tile) is not None
print("compiled")
"""


@pytest.mark.skipif(not HAS_CUTLASS, reason="nvidia-cutlass-dsl is not installed")
def test_the_kernel_compiles_for_sm90a_without_a_gpu(tmp_path):
    env = {**os.environ, "CUTE_DSL_ARCH": "sm_90a", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "PACKEDENC_CUTE_CACHE": str(tmp_path / "cache")}  # the user's own cache stays untouched
    res = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "compiled" in res.stdout, res.stdout[-2000:] + res.stderr[-4000:]


def test_tile_rejects_shapes_the_kernel_does_not_take():
    if not HAS_CUTLASS:
        pytest.skip("nvidia-cutlass-dsl is not installed")
    from packedenc.kernels.cute import geglu_gemm as G

    assert G.smem_bytes(G.DEFAULT_TILE) <= G.SMEM_CAPACITY
    for bad in (dict(m=256), dict(n=256), dict(stages=1), dict(stages=5), dict(cluster=(4, 1))):
        with pytest.raises(ValueError, match="Tile"):
            G.Tile(**bad)


# ---- GPU, with the extra installed ------------------------------------------------------------------


@pytest.fixture
def cute_loaded():
    skip_without_cute(lambda cap: cap[0] == LG.CAPABILITY, "the GeGLU GEMM needs an sm90 GPU")


SHAPES = [(768, 1152), (1024, 2624)]  # ModernBERT base, large (2624 = 20.5 tiles of 128: a ragged N tile)


@pytest.mark.gpu
@pytest.mark.cute
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D,F", SHAPES)
@pytest.mark.parametrize("T", [1, 7, 1000, 4097, 65536])  # one row; under a tile; ragged; one past 32 tiles; 64k
def test_gpu_cute_linear_glu_two_x_rule(cute_loaded, dtype, D, F, T):
    if T == 65536 and D != 768:
        pytest.skip("the 64k pack at the base width only (the fp32 reference is slow)")
    x, w = _xw(T, D, F, dtype, "cuda")
    with torch.no_grad():
        out = LG.linear_glu(x, w)
        ref32 = reference.linear_glu(x.float(), w.float(), None, "gelu")
        lowp = reference.linear_glu(x, w, None, "gelu")  # cuBLAS in dtype, rounded, then the gate
        assert_close_to_ref(out, ref32, lowp, atol=1e-5, what=f"cute linear_glu T={T} D={D} F={F}")
        assert torch.equal(LG.linear_glu(x, w), out)  # deterministic
        if T > 1:  # rows are independent: another row's input changes nothing here
            x2 = x.clone()
            x2[T // 2] *= 3
            out2 = LG.linear_glu(x2, w)
            keep = torch.ones(T, dtype=torch.bool, device="cuda")
            keep[T // 2] = False
            assert torch.equal(out2[keep], out[keep]) and not torch.equal(out2[~keep], out[~keep])


@pytest.mark.gpu
@pytest.mark.cute
def test_gpu_cute_linear_glu_unaligned_input_is_copied_not_misread(cute_loaded):
    x, w = _xw(300, 768, 1152, torch.bfloat16, "cuda")
    buf = torch.empty(300 * 768 + 1, device="cuda", dtype=torch.bfloat16)
    x_off = buf[1:].view(300, 768)  # contiguous, 2 bytes past a 16-byte boundary: TMA cannot read it
    x_off.copy_(x)
    with torch.no_grad():
        assert torch.equal(LG.linear_glu(x_off, w), LG.linear_glu(x, w))


@pytest.mark.gpu
@pytest.mark.cute
def test_gpu_cute_linear_glu_table_training_compile_and_cuda_graph(cute_loaded):
    ops, tri = get_ops("cute", "cuda"), get_ops("triton", "cuda")
    assert dict(ops.chosen)["linear_glu"] == "cute>triton"
    assert dict(get_ops("auto", "cuda").chosen)["linear_glu"] == "cute[large-pack]>triton"
    x, w = _xw(1000, 768, 1152, torch.bfloat16, "cuda")
    with torch.no_grad():
        eager = ops.linear_glu(x, w, None, "gelu")
        assert torch.equal(eager, LG.linear_glu(x, w))
    # training: the triton entry, with its gradients
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = ops.linear_glu(xg, wg, None, "gelu")
    assert y.grad_fn is not None and torch.equal(y, tri.linear_glu(x, w, None, "gelu"))
    y.float().sum().backward()
    assert xg.grad is not None and wg.grad is not None
    b = torch.randn(2304, device="cuda", dtype=torch.bfloat16)  # a bias: triton as well
    with torch.no_grad():
        assert torch.equal(ops.linear_glu(x, w, b, "gelu"), tri.linear_glu(x, w, b, "gelu"))
        f = torch.compile(lambda x: ops.linear_glu(x, w, None, "gelu"), fullgraph=True)
        assert torch.equal(f(x), eager)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            ops.linear_glu(x, w, None, "gelu")  # warm-up outside capture (compiles)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = ops.linear_glu(x, w, None, "gelu")
        x.mul_(0.5)
        graph.replay()
        assert torch.equal(out, LG.linear_glu(x, w))


@pytest.mark.gpu
@pytest.mark.cute
def test_gpu_cute_linear_glu_runs_on_the_callers_stream(cute_loaded):
    """The kernel goes to torch's current stream (TVM-FFI's environment stream), not the default one:
    on a side stream whose input is written by work still queued there, it reads the written input."""
    x, w = _xw(4096, 768, 1152, torch.bfloat16, "cuda")
    ops = get_ops("cute", "cuda")
    with torch.no_grad():
        want = ops.linear_glu(x, w, None, "gelu")
        side, src = torch.cuda.Stream(), x.clone()
        x_late = torch.zeros_like(x)
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            torch.cuda._sleep(50_000_000)  # ~25 ms of GPU time queued before the write
            x_late.copy_(src)
            got = ops.linear_glu(x_late, w, None, "gelu")
        torch.cuda.synchronize()
    assert torch.equal(got, want)  # on the default stream it would have read zeros
