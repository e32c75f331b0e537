"""What torch.compile makes of every Triton op, checked on a machine without a GPU.

1. `trace`: each op's CUDA branch traced as torch.compile's AOT stage does, on fake CUDA tensors:
   op name -> {"kernels": kernel names in the traced graph, "opaque": whether a `packedenc::` op was
   left in it} or {"error": the first line of the error}. Without a GPU a stand-in Triton driver
   names an sm_90 target, so torch's kernel analysis (which arguments a kernel writes) runs as on
   the GPU. A CPU-only torch cannot functionalize views of fake CUDA tensors, so the ops whose
   launchers take views stop with an error there; the GPU traces all.
2. `inductor_ttir`: each op's launches (recorded, not run) compiled to TTIR for sm_90 with the
   argument types inductor gives a user-defined kernel: op name -> [(kernel, ints all 1, error)].
3. `symbolic`: each op's launcher with symbolic token and sequence counts (dynamic shapes):
   op name -> None or the error.
4. `aliased_writes`: each op's launches, the tensors torch's kernel analysis says a kernel writes:
   op name -> ["kernel: ARG shares memory with ARG2" or "kernel: ARG is an input of the op", ...].
   torch.compile functionalizes a kernel's written arguments one by one (clones, then writes
   back), so a written tensor that shares memory with another argument (three views of one
   gradient buffer) is miscompiled: inductor sized a clone of such a view past its buffer's end
   and the compiled ModernBERT backward faulted. An input the analysis counts as written (the ops
   mutate none) costs a clone of it in every compiled graph.

Run as a script, never under TRITON_INTERPRET (the interpreter has no compiled kernel to record);
it prints {"trace": ..., "inductor_ttir": ..., "symbolic": ..., "symbolic_scalars": ...,
"aliased_writes": ...}. `test_triton_op_trace.py` runs it.
"""

from __future__ import annotations

import itertools
import json
import os
import warnings

import torch
from torch._functorch.aot_autograd import aot_function
from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
from torch._subclasses.fake_tensor import FakeTensorMode
from triton.backends.compiler import GPUTarget
from triton.runtime import driver

import packedenc.kernels.triton  # noqa: F401  (registers the ops)


class _Sm90:
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_active_torch_device(self):
        return torch.device("cuda", 0)


def cases(device: str = "cuda"):
    """(op name, args): every forward and backward op, bf16 (fake tensors when on "cuda")."""
    bf, dev = torch.bfloat16, device
    T, D, F, H, K, S = 24, 64, 96, 2, 32, 3

    def r(*shape, dtype=bf):
        return torch.empty(shape, device=dev, dtype=dtype)

    cu = torch.empty(S + 1, device=dev, dtype=torch.int32)
    ids, pos = r(T, dtype=torch.int64), r(T, dtype=torch.int64)
    x, w = r(T, D), r(D)
    q, k, v = r(T, H, K), r(T, H, K), r(T, H, K)
    lse2 = r(H, T, dtype=torch.float32)
    m, den = r(S, dtype=torch.float32), r(S, dtype=torch.float32)
    return [
        ("layer_norm", (x, w, w, 1e-5)),
        ("add_layer_norm", (x, x, w, w, 1e-5, w)),
        ("embed_layer_norm", (ids, r(50, D), w, w, 1e-5)),
        ("layer_norm_bwd", (x, x, None, x, w, 1e-5, True, True)),
        ("activation", (x, "gelu")),
        ("activation_bwd", (x, x, "gelu")),
        ("bias_activation", (x, w, "gelu")),
        ("bias_activation_bwd", (x, x, w, "gelu")),
        ("glu", (r(T, 2 * F), "gelu")),
        ("glu_bwd", (r(T, F), r(T, 2 * F), "gelu")),
        ("rotary", (r(T, 3, H, K), pos, 10000.0, 1.0)),
        ("rotary_bwd", (q, k, pos, 10000.0, 1.0)),
        ("rotary_qkv", (r(T, 3, H, K), pos, 10000.0, 1.0)),
        ("rotary_qkv_bwd", (q, k, v, pos, 10000.0, 1.0)),
        ("triton_varlen_attention", (q, k, v, cu, 16, 4, 4, 0.2, True)),
        ("triton_varlen_attention_bwd", (q, q, k, v, q, lse2, cu, 16, -1, -1, 0.2)),
        ("graph_readout", (x, r(1, 2 * D), r(1), cu, 16)),
        ("graph_readout_bwd", (r(S, D), x, r(1, 2 * D), r(1), cu, m, den)),
        ("linear_cross_entropy", (x, r(40, D), r(40), r(T, dtype=torch.int64))),
    ]


def trace() -> dict[str, dict]:
    assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "trace without TRITON_INTERPRET"
    if not torch.cuda.is_available():
        driver.set_active(_Sm90())
    out: dict[str, dict] = {}
    with FakeTensorMode(allow_non_fake_inputs=True):
        for name, args in cases():
            op = getattr(torch.ops.packedenc, name).default
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            slots = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]

            def f(*ts, op=op, args=args, slots=slots):
                full = list(args)
                for i, t in zip(slots, ts):
                    full[i] = t
                return op(*full)

            graphs = []
            try:
                aot_function(f, fw_compiler=lambda gm, _: graphs.append(gm) or gm)(*tensors)
            except Exception as e:
                out[name] = {"error": str(e).splitlines()[0][:200]}
                continue
            nodes = list(graphs[0].graph.nodes)
            kernels = [kernel_side_table.get_kernel(n.kwargs["kernel_idx"]).fn.__name__
                       for n in nodes if "triton_kernel_wrapper" in str(n.target)]
            opaque = any("packedenc" in str(n.target) for n in nodes)
            out[name] = {"kernels": kernels, "opaque": opaque}
    return out


# ---- the kernels as inductor calls them ------------------------------------------------------------


def _launchers():
    """op name -> the CUDA branch of its triton_op (the launcher a trace runs)."""
    from packedenc.kernels.triton import activation, attention_op, cross_entropy, glu, graph_readout, layer_norm, rotary

    return {
        "layer_norm": layer_norm._layer_norm_cuda, "add_layer_norm": layer_norm._add_layer_norm_cuda,
        "embed_layer_norm": layer_norm._embed_layer_norm_cuda, "layer_norm_bwd": layer_norm._layer_norm_bwd_cuda,
        "activation": activation._activation_cuda, "activation_bwd": activation._activation_bwd_cuda,
        "bias_activation": activation._bias_activation_cuda,
        "bias_activation_bwd": activation._bias_activation_bwd_cuda,
        "glu": glu._glu_cuda, "glu_bwd": glu._glu_bwd_cuda,
        "rotary": rotary._rotary_cuda, "rotary_bwd": rotary._rotary_bwd_cuda,
        "rotary_qkv": rotary._rotary_qkv_cuda, "rotary_qkv_bwd": rotary._rotary_qkv_bwd_cuda,
        "triton_varlen_attention": attention_op._fwd_cuda, "triton_varlen_attention_bwd": attention_op._bwd_cuda,
        "graph_readout": graph_readout._readout_cuda, "graph_readout_bwd": graph_readout._readout_bwd_cuda,
        "linear_cross_entropy": cross_entropy._linear_ce_cuda,
    }


_PTR = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.int32: "*i32",
        torch.int64: "*i64", torch.bool: "*u8", torch.uint8: "*u8"}


def _inductor_source(kernel, args: tuple, meta: dict, ints_one: bool = False):
    """The kernel's ASTSource with the argument types inductor gives a user-defined kernel:
    Python floats fp64, ints equal to 1 and Nones constexpr (torch/_inductor/codegen/wrapper.py).
    `ints_one`: every int argument 1 (one sequence, one head, ...), so every one is a constexpr."""
    from triton.compiler.compiler import ASTSource

    if ints_one:
        args = tuple(1 if type(a) is int else a for a in args)
    values = dict(zip(kernel.arg_names, args))
    values.update({k: v for k, v in meta.items() if k in kernel.arg_names})
    signature, constexprs = {}, {}
    for p in kernel.params:
        v = values.get(p.name, p.default)
        if p.is_constexpr or v is None or (type(v) is int and v == 1):
            signature[p.name], constexprs[p.name] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            signature[p.name] = _PTR[v.dtype]
        elif type(v) is float:
            signature[p.name] = "fp64"
        elif type(v) is bool:
            signature[p.name] = "i1"
        else:
            signature[p.name] = "i32" if -(2**31) <= v < 2**31 else "i64"
    return ASTSource(kernel, signature, constexprs)


def inductor_ttir() -> dict[str, list]:
    """op name -> [(kernel, error or None)]: each launch of the op's CUDA branch (run on CPU tensors,
    its launches recorded instead of run) compiled to TTIR for sm_90 with inductor's argument types."""
    from triton._C.libtriton import ir
    from triton.compiler.compiler import make_backend

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    options = backend.parse_options({})
    out = {}
    for name, args in cases(device="cpu"):
        out[name] = []
        for (kernel, kargs, meta), ones in itertools.product(_record_launches(name, args), (False, True)):
            context = ir.context()
            ir.load_dialects(context)
            backend.load_dialects(context)
            try:
                mod = _inductor_source(kernel, kargs, meta, ones).make_ir(
                    target, options, backend.get_codegen_implementation(options), backend.get_module_map(),
                    context)
                # fp64 arguments are cast to fp32 once; any other f64 is fp64 math the eager launch lacks
                f64 = [ln.strip() for ln in str(mod).splitlines() if "f64" in ln and "arith.truncf" not in ln
                       and "tt.func" not in ln and "loc(" not in ln.split("f64")[0][-6:]]
                out[name].append((kernel.fn.__name__, ones, f"fp64 math: {f64[:2]}" if f64 else None))
            except Exception as e:  # noqa: BLE001  (reported, the test names it)
                out[name].append((kernel.fn.__name__, ones, " | ".join(str(e).strip().splitlines()[-3:])[:400]))
    return out


def _record_launches(name: str, args: tuple) -> list:
    """The (kernel, args, meta) launches of op `name`'s CUDA branch run on CPU tensors, recorded, not run."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from packedenc.kernels.triton import _common

    class _PassThrough(TorchDispatchMode):  # makes `launch` take its traced branch
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    calls: list = []
    saved = _common._traced_launch
    _common._traced_launch = lambda kernel, grid, args, meta: calls.append((kernel, args, meta))
    try:
        with _PassThrough():
            _launchers()[name](*args)
    finally:
        _common._traced_launch = saved
    return calls


def aliased_writes() -> dict[str, list[str]]:
    """op name -> the written kernel arguments that share memory with another argument the kernel
    touches, or with an input of the op (none wanted)."""
    from torch._higher_order_ops import triton_kernel_wrap as tkw

    if not torch.cuda.is_available():
        driver.set_active(_Sm90())
    out = {}
    for name, args in cases(device="cpu"):
        out[name] = problems = []
        inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        for kernel, kargs, meta in _record_launches(name, args):
            kwargs = {**dict(zip(kernel.arg_names, kargs)), **meta}
            tensors = {k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
            rw = tkw.identify_accessed_tensors(kernel, dict(kwargs), {}).read_writes  # CPU CI's torch
            writes, used = {d.name for d in rw.writes}, {d.name for d in (*rw.reads, *rw.writes)}
            for w in sorted(writes & set(tensors)):  # a placeholder pointer the kernel never touches is fine
                mem = tensors[w].untyped_storage().data_ptr()
                if mem in inputs:
                    problems.append(f"{kernel.fn.__name__}: {w} is an input of the op")
                problems += [f"{kernel.fn.__name__}: {w} shares memory with {k}" for k in sorted(used & set(tensors))
                             if k != w and tensors[k].untyped_storage().data_ptr() == mem]
    return out


def symbolic(every_dim: bool = True) -> dict[str, str | None]:
    """op name -> None, or the error its CUDA branch raises when the token counts are symbolic.

    Varlen batches change T and S from call to call, so torch.compile (automatic dynamic shapes)
    traces the launchers with SymInts for them; `dynamic=True` makes every dim of every input
    symbolic, the weights' widths too. Tile choices must guard on comparisons (or specialise by
    int()), grids be expressions, nothing hash a SymInt. The launchers run on CPU fake tensors
    whose dims are all symbolic (`every_dim`) or only the token and sequence dims, their launches
    recorded."""
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    from packedenc.kernels.triton import _common

    mode = FakeTensorMode(shape_env=ShapeEnv())
    T, S = 24, 3  # cases(): T tokens, S sequences

    def fake(t):
        dims = [DimDynamic.DYNAMIC if every_dim or n in (T, S, S + 1) else DimDynamic.STATIC for n in t.shape]
        return mode.from_tensor(t, symbolic_context=StatelessSymbolicContext(dynamic_sizes=dims))

    launchers, out = _launchers(), {}
    saved = _common._traced_launch
    _common._traced_launch = lambda kernel, grid, args, meta: None
    try:
        for name, args in cases(device="cpu"):
            with mode:
                try:
                    launchers[name](*(fake(a) if isinstance(a, torch.Tensor) else a for a in args))
                    out[name] = None
                except Exception as e:  # noqa: BLE001  (reported, the test names it)
                    out[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    finally:
        _common._traced_launch = saved
    return out


def symbolic_scalars() -> str | None:
    """None, or the error of the attention launchers given what `dynamic=True` hands them: the
    head dim, the window and the longest sequence as SymInts and the scale as a SymFloat (the
    default K ** -0.5 of a symbolic K). Tile choices must reach the caches as plain bools and ints, and
    the kernels' float arguments as host floats."""
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    from packedenc.kernels.triton import _common
    from packedenc.kernels.triton.attention import attention_fwd
    from packedenc.kernels.triton.attention_bwd import attention_bwd

    mode = FakeTensorMode(shape_env=ShapeEnv())

    def fake(t):
        return mode.from_tensor(t, symbolic_context=StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC] * t.dim()))

    env = mode.shape_env

    def sym(value, name):  # an unspecialised scalar input, as dynamo makes it
        from torch._dynamo.source import ConstantSource

        node = env.create_symbol(value, ConstantSource(name), dynamic_dim=DimDynamic.DYNAMIC)
        return env.create_symfloatnode(node, hint=value) if isinstance(value, float) else env.create_symintnode(node, hint=value)

    launched, steps = [], []

    def record(kernel, grid, args, meta):
        bad = [type(a).__name__ for a in (*args, *meta.values()) if isinstance(a, (torch.SymFloat, torch.SymBool))]
        launched.append(bad)
        steps.append(args[next(i for i, a in enumerate(args) if a is cu) + 3])  # CU, T, S, then the binary search's step count

    saved = _common._traced_launch
    _common._traced_launch = record
    try:
        real_q, real_cu = torch.randn(24, 2, 16), torch.tensor([0, 10, 24], dtype=torch.int32)  # outside the mode
        with mode:
            q, cu = fake(real_q), fake(real_cu)
            window = (sym(6, "left"), sym(6, "right"))
            max_seqlen, scale = sym(14, "max_seqlen"), sym(0.25, "scale")
            o, lse = attention_fwd(q, q, q, cu, max_seqlen, window, scale, lse=True)
            attention_bwd(o, q, q, q, o, lse, cu, max_seqlen, window, scale)
    except Exception as e:  # noqa: BLE001  (reported, the test names it)
        return f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    finally:
        _common._traced_launch = saved
    if len(launched) != 3 or any(launched):
        return f"launches with symbolic floats / bools: {launched}"
    if steps != [31] * 3:  # ceil(log2 S) of a symbolic S would specialise the graph on S: one compile per batch size
        return f"binary-search steps {steps}, not the bound 31 for a symbolic sequence count"
    return None


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    print(json.dumps({"trace": trace(), "inductor_ttir": inductor_ttir(), "symbolic": symbolic(),
                      "symbolic_scalars": symbolic_scalars(), "aliased_writes": aliased_writes()}))
