"""The host cost of one CuteDSL GeGLU GEMM call, layer by layer, against the Triton entry (H200).

    python3 -m benchmarks.cute_host_probe --out gpu_out/cute_host_probe.json

Host us a call: `calls` back-to-back calls at T = 64 tokens (the kernel's device time is a few us,
so the loop's wall time is the host's), one sync at the end, median of 5 loops. Rows, from the
outside in: the op table's `linear_glu` (auto, cute, triton); the custom op; `geglu_gemm.geglu`;
the compiled function alone with its arguments built once (pointer ABI); building those arguments
(`make_ptr` x 3, the stream object). Then the same kernel compiled behind its tensor entry with
TVM-FFI's calling convention (`call_tensors`, torch tensors passed directly, the stream taken
from torch's current one), in memory and after an `export_to_c` / `load_module` round trip (the
compile cache's path), each checked bit-identical to the pointer ABI's output at T = 4,097 and
timed at T = 65,536 as one call (`ms`, host launch included: `geglu-64k`'s metric) and queued.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

from benchmarks.records import git_commit, gpu_name, replace_text

D, FM = 768, 1152


def host_us(fn: Callable[[], Any], calls: int = 300, loops: int = 5) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    per = []
    for _ in range(loops):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        per.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(per)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m benchmarks.cute_host_probe", description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_ptr

    import packedenc as pe
    from benchmarks import common
    from benchmarks.cute_common import time_ms
    from packedenc.kernels.cute import geglu_gemm as G

    torch.manual_seed(0)
    w = torch.randn(2 * FM, D, device="cuda", dtype=torch.bfloat16) * 0.03
    xs = {T: torch.randn(T, D, device="cuda", dtype=torch.bfloat16) for T in (64, 4096, 4097, 16384, 65536)}
    rows: list[dict[str, Any]] = []

    def row(name: str, value: float | None, unit: str = "host_us", **extra: Any) -> None:
        rows.append(dict(system=name, **{unit: value}, **extra))
        print(f"{name:44s} {unit} {value if value is None else round(value, 3)} {extra or ''}", flush=True)

    def guarded(name: str, fn: Callable[[], float], unit: str = "host_us") -> None:
        try:
            row(name, fn(), unit)
        except Exception as e:  # noqa: BLE001 - one failing variant leaves the others
            traceback.print_exc()
            row(name, None, unit, error=f"{type(e).__name__}: {e}"[:300])

    x = xs[64]
    with torch.no_grad():
        for backend in ("auto", "cute", "triton"):
            ops = pe.get_ops(backend, "cuda")
            guarded(f"ops[{backend}].linear_glu", lambda ops=ops: host_us(lambda: ops.linear_glu(x, w, None, "gelu")))
        guarded("torch.ops.packedenc.cute_linear_glu",
                lambda: host_us(lambda: torch.ops.packedenc.cute_linear_glu(x, w, "gelu")))
        guarded("geglu_gemm.geglu", lambda: host_us(lambda: G.geglu(x, w)))
        fn = G.compiled(torch.bfloat16, D, FM)
        out = torch.empty(64, FM, device="cuda", dtype=torch.bfloat16)
        cdt = cutlass.BFloat16
        ptrs = [make_ptr(cdt, t.data_ptr(), cute.AddressSpace.gmem, assumed_align=16) for t in (x, w, out)]
        stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
        guarded("compiled fn, arguments built once", lambda: host_us(lambda: fn(*ptrs, 64, stream)))
        guarded("make_ptr x 3", lambda: host_us(
            lambda: [make_ptr(cdt, t.data_ptr(), cute.AddressSpace.gmem, assumed_align=16) for t in (x, w, out)]))
        guarded("cuda.CUstream(current stream)", lambda: host_us(
            lambda: cuda.CUstream(torch.cuda.current_stream().cuda_stream)))
        guarded("torch.empty (T, F)", lambda: host_us(lambda: torch.empty(64, FM, device="cuda", dtype=torch.bfloat16)))

        # the tensor entry under TVM-FFI
        tvm = {}
        try:
            t_sym = cute.sym_int()
            fake = lambda shape: cute.runtime.make_fake_compact_tensor(  # noqa: E731
                cdt, shape, stride_order=(1, 0), assumed_align=16)
            kern = G.GegluGemm(cdt, D, FM, G.DEFAULT_TILE)
            t0 = time.perf_counter()
            tvm["jit"] = cute.compile(kern.call_tensors, fake((t_sym, D)), fake((2 * FM, D)), fake((t_sym, FM)),
                                      cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
                                      options="--enable-tvm-ffi")
            row("tvm-ffi compile", (time.perf_counter() - t0) * 1e3, "ms")
            folder = Path(tempfile.mkdtemp())
            tvm["jit"].export_to_c(str(folder / "geglu.o"), "geglu_tvm")
            t0 = time.perf_counter()
            mod = cute.runtime.load_module(str(folder / "geglu.o"), enable_tvm_ffi=True)
            tvm["loaded"] = getattr(mod, "geglu_tvm")
            row("tvm-ffi load_module", (time.perf_counter() - t0) * 1e3, "ms")
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            row("tvm-ffi setup", None, error=f"{type(e).__name__}: {e}"[:300])
        for name, f in tvm.items():
            xt = xs[4097]
            ref = G.geglu(xt, w)
            got = torch.empty_like(ref)
            try:
                f(xt, w, got)
                torch.cuda.synchronize()
                same = bool(torch.equal(ref, got))
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                row(f"tvm-ffi {name}", None, error=f"{type(e).__name__}: {e}"[:300])
                continue
            row(f"tvm-ffi {name}: equal to the pointer ABI at T=4097", float(same), "equal")
            guarded(f"tvm-ffi {name}, out preallocated", lambda f=f: host_us(lambda: f(x, w, out)))

            def call(f=f, x=x):
                o = torch.empty(x.shape[0], FM, device="cuda", dtype=torch.bfloat16)
                f(x, w, o)
                return o
            guarded(f"tvm-ffi {name}, with torch.empty", lambda call=call: host_us(call))
            x64 = xs[65536]
            guarded(f"geglu-64k tvm-ffi {name} one call", lambda call=call: time_ms(lambda: call(x=x64)), "ms")
            guarded(f"geglu-64k tvm-ffi {name} queued", lambda call=call: common.median_ms(
                lambda: call(x=x64), reps=5, warmup=1, calls=40), "ms")
        x64 = xs[65536]
        guarded("geglu-64k geglu_gemm.geglu one call", lambda: time_ms(lambda: G.geglu(x64, w)), "ms")
        guarded("geglu-64k ops[cute] one call", lambda: time_ms(
            lambda: pe.get_ops("cute", "cuda").linear_glu(x64, w, None, "gelu")), "ms")
        guarded("geglu-64k ops[triton] one call", lambda: time_ms(
            lambda: pe.get_ops("triton", "cuda").linear_glu(x64, w, None, "gelu")), "ms")
        for T in (4096, 16384):  # where auto's choice between them turns (host-bound small packs)
            for backend in ("cute", "triton"):
                ops = pe.get_ops(backend, "cuda")
                guarded(f"geglu-{T // 1024}k ops[{backend}] one call", lambda ops=ops, T=T: time_ms(
                    lambda: ops.linear_glu(xs[T], w, None, "gelu")), "ms")
                guarded(f"geglu-{T // 1024}k ops[{backend}] queued", lambda ops=ops, T=T: common.median_ms(
                    lambda: ops.linear_glu(xs[T], w, None, "gelu"), reps=5, warmup=1, calls=40), "ms")
    if a.out:
        doc = dict(gpu=gpu_name(torch.device("cuda")), commit=git_commit(),
                   command="python3 -m benchmarks.cute_host_probe", rows=rows)
        replace_text(a.out, json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
