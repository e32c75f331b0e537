"""The eager CUDA path's own host time, on any machine: launches and GEMMs stubbed (no GPU needed).

    python3 -m benchmarks.host_stub --out benchmarks/results/cpu/host_stub_cpu.json

Issue 19's eager batches are host-bound: a DeBERTa-v3-base `mnli` batch costs ~2.6 ms of host
time for ~0.9 ms of GPU work (`history/host_profile_h200_*.txt`). This probe runs the same Python
as the eager CUDA path (the op table a GPU machine builds for `--backend`, default "auto": the
default path; `direct_launch` taken) on CPU tensors, with the two
things that need a GPU replaced: a Triton launch reaches the cached C launcher's slot, which is a
no-op here (the first call "compiles" into a fake compiled kernel), and every GEMM
(`F.linear`, under the table's `linear`) returns `torch.empty` of its output shape (`linear_add`,
the GEMM that adds into the residual, returns the residual). What remains is ours: argument
checks, tiles, the launch cache key, views and allocations. A cuBLAS call and a kernel launch
cost the real path ~10-20 us each on the GPU host (`history/host_profile_*`); they are not in
these figures.

Cases: DeBERTa-v3 (12 layers, c2p + p2c, 256 buckets) and ModernBERT (22 layers, every third
global), bf16 as on a GPU (the fused GEMMs take fp16 / bf16 only, so an fp32 model would take other
routes), each at the real head dim (64) but 2 heads and a 128-wide hidden size (the CPU's tensor
work stays small; the host path does not depend on widths), 16 sequences of 20-59 tokens (an `mnli`
batch; `query` has 128 shorter ones, the same calls). `ms` is the median of `--reps` rounds of 20
forwards under inference_mode, after warm-up; `launches` counts the kernel launches of one forward
that reached the stubbed launcher (0 would mean the reference ran instead). Then the same
ModernBERT's eager MLM training step (`make_step`, bf16 compute, AdamW) on 8 sequences of 100-599
tokens (`modernbert-train-8seq`, the train family's `doc-b8`): forward, autograd backward and
update, rounds of 5 steps (`_train_step` says what else it stubs). The patches are process-wide (Triton's JIT, the
launch helpers): run it as its own process, never inside a test session.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
import types
from pathlib import Path
from typing import Any, Callable

import torch

_LAUNCHES = [0]  # kernel launches that reached the stubbed C launcher


def _stub_gpu() -> None:
    """Make the eager CUDA path run on CPU tensors with every launch a no-op (process-wide)."""
    # Compiled-kernel launches are what is stubbed: under the interpreter (the CPU test suite's
    # setting) `triton.jit` builds interpreted kernels that really run, so it must be off before
    # Triton is first imported, which only a process of its own guarantees.
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("benchmarks.host_stub: Triton is already imported in interpreter mode; "
                           "run `python3 -m benchmarks.host_stub` as its own process")
    os.environ["TRITON_INTERPRET"] = "0"
    import triton.runtime.jit as jit

    from packedenc.kernels.triton import _common

    class _Launcher:  # what `_common._launcher` takes for Triton's C launcher (no scratch)
        global_scratch_size = profile_scratch_size = 0
        launch_cooperative_grid = launch_pdl = False

        @staticmethod
        def launch(*args):
            _LAUNCHES[0] += 1

    def compile_stub(self, *args, grid, warmup, **kwargs):  # JITFunction.run: a "compiled" kernel
        return types.SimpleNamespace(run=_Launcher(), function=0, packed_metadata=())

    jit.JITFunction.run = compile_stub
    _common.eager_cuda = lambda *t: type(t[0]) is torch.Tensor and not torch.compiler.is_compiling()
    _common._driver = lambda: types.SimpleNamespace(get_current_stream=lambda device: 0)
    _common._device_getter = lambda: (lambda: 0)
    torch.cuda.is_available = lambda: True  # the op table then offers the triton backend


def _gemm_stub(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    return torch.empty(x.shape[:-1] + (w.shape[0],), dtype=x.dtype)


def _linear_add_stub(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, residual: torch.Tensor,
                     overwrite_input: bool = False) -> torch.Tensor:
    return residual if overwrite_input else torch.empty_like(residual)  # the GEMM into the residual


class _LinearStub(torch.autograd.Function):
    """A GEMM with gradients, stubbed: `torch.empty` of the output forward, of x / W / b backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        ctx.like = (x, w, b)
        return torch.empty(x.shape[:-1] + (w.shape[0],), dtype=x.dtype)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        return tuple(None if t is None else torch.empty_like(t) for t in ctx.like)


def _train_step(seed: int, backend: str) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """(one eager ModernBERT MLM training step, the patches' undo) on 8 doc-like sequences, as the
    train family's `doc-b8` step: `make_step` with bf16 compute and AdamW over fp32 master weights.

    Beyond the inference stubs: GEMMs keep their autograd (`_LinearStub`), the multi-tensor cast,
    the gradients' norms and the fused AdamW (GPU kernels in the real step, CPU arithmetic here) are
    no-ops, and
    `Tensor.is_cuda` answers True (and no stream is capturing), so the training ops' autograd functions take their CUDA launchers
    rather than the CPU reference. Undone after the case. What CPU arithmetic is left (the MLM
    decoder's small gradient GEMMs, the embedding gradient: ~2 ms on a 2-core CPU) is counted."""
    import torch.nn.functional as F

    import packedenc as pe
    from packedenc.kernels import get_ops
    from packedenc.models import modernbert
    from packedenc.packing import Packed, positions_from_cu_seqlens
    from packedenc.train import AdamW, TrainState, make_step
    from packedenc.train.losses import mlm_loss

    saved = (F.linear, torch.Tensor.is_cuda, torch._foreach_copy_, torch._fused_adamw_, torch._foreach_norm,
             torch.cuda.is_current_stream_capturing)
    F.linear = _LinearStub.apply
    torch.Tensor.is_cuda = property(lambda self: True)
    torch.cuda.is_current_stream_capturing = lambda: False  # asked of "CUDA" tensors by auto's shape classes
    torch._foreach_copy_ = lambda *a, **k: None
    torch._fused_adamw_ = lambda *a, **k: None
    torch._foreach_norm = lambda ts, *a, **k: [ts[0].new_zeros(())] * len(ts)

    def undo() -> None:
        (F.linear, torch.Tensor.is_cuda, torch._foreach_copy_, torch._fused_adamw_, torch._foreach_norm,
         torch.cuda.is_current_stream_capturing) = saved

    g = torch.Generator().manual_seed(seed)
    params = modernbert.init(_modernbert_config(), g, heads=("mlm",))
    lens = torch.randint(100, 600, (8,), generator=g)
    cu = torch.zeros(9, dtype=torch.int32)
    cu[1:] = lens.cumsum(0)
    T = int(cu[-1])
    ids = torch.randint(5, 900, (T,), generator=g)
    pos = torch.randperm(T, generator=g)[: T // 7].sort().values
    batch = {"text": Packed(ids, cu, positions_from_cu_seqlens(cu, T), int(lens.max())), "pos": pos, "tgt": ids[pos]}
    ops = get_ops(backend, "cuda")

    def loss_fn(p: Any, b: dict[str, Any]) -> torch.Tensor:
        t = b["text"]
        h = pe.encode(p, t.ids, t.cu_seqlens, t.max_seqlen, t.positions, backend=ops)
        return mlm_loss(p, h, b["pos"], b["tgt"], backend=ops)

    step = make_step(loss_fn, AdamW(lr=1e-4), compute_dtype=torch.bfloat16)
    state = TrainState.create(params, step.optimizer)
    return (lambda: step.update_(state, batch)), undo


_SMALL = dict(hidden_size=128, num_attention_heads=2, vocab_size=1000)  # the real head dim, narrow tensors


def _modernbert_config() -> Any:
    from packedenc.models import modernbert

    return modernbert.ModernBertConfig(intermediate_size=128, num_hidden_layers=22, **_SMALL)


def _cases(seed: int) -> dict[str, tuple[Callable, Any]]:
    from packedenc.models import deberta, modernbert

    g = torch.Generator().manual_seed(seed)
    deb = deberta.init(dataclasses.replace(deberta.PRESETS["v3-base"], intermediate_size=256, **_SMALL), g,
                       dtype=torch.bfloat16)
    mb = modernbert.init(_modernbert_config(), g, dtype=torch.bfloat16)
    return {"deberta-v3-16seq": (deberta.encode, deb), "modernbert-16seq": (modernbert.encode, mb)}


def _timed(fn: Callable[[], Any], warmup: int, calls: int, reps: int) -> tuple[list[float], int]:
    """(ms a call in each of `reps` rounds of `calls` calls, launches of one call), after `warmup` calls."""
    for _ in range(warmup):
        fn()
    n0 = _LAUNCHES[0]
    fn()
    launches = _LAUNCHES[0] - n0
    rounds = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - t0) / calls * 1e3)
    return rounds, launches


def measure(reps: int, seed: int = 0, backend: str = "auto") -> list[dict[str, Any]]:
    _stub_gpu()
    import torch.nn.functional as F

    from packedenc import kernels
    from packedenc.kernels import get_ops

    F.linear = _gemm_stub  # under the table's own `linear` entry and the composites (linear_glu)
    kernels._IMPLS["reference"]["linear_add"] = _linear_add_stub  # ModernBERT's inference output projections
    ops = get_ops(backend, "cuda")
    system = "packedenc" if backend == "auto" else f"packedenc[{backend}]"  # the default path, or another table
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(20, 60, (16,), generator=g)
    cu = torch.zeros(17, dtype=torch.int32)
    cu[1:] = lens.cumsum(0)
    ids = torch.randint(5, 900, (int(cu[-1]),), generator=g)
    out = []
    for name, (encode, params) in _cases(seed).items():
        with torch.inference_mode():
            rounds, launches = _timed(lambda: encode(params, ids, cu, int(lens.max()), backend=ops), 5, 20, reps)
        out.append({"system": system, "workload": name, "ms": statistics.median(rounds), "min_ms": min(rounds),
                    "rounds": reps, "launches": launches, "tokens": int(cu[-1]), "sequences": 16})
        print(f"{name:18s} {out[-1]['ms']:.3f} ms a forward (min {out[-1]['min_ms']:.3f}), {launches} launches",
              flush=True)
    run, undo = _train_step(seed, backend)
    try:
        rounds, launches = _timed(run, 3, 5, reps)
    finally:
        undo()
    name = "modernbert-train-8seq"
    out.append({"system": system, "workload": name, "ms": statistics.median(rounds), "min_ms": min(rounds),
                "rounds": reps, "launches": launches, "sequences": 8})
    print(f"{name:18s} {out[-1]['ms']:.3f} ms a step (min {out[-1]['min_ms']:.3f}), {launches} launches", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--out", help="write the records (JSON) here")
    ap.add_argument("--backend", default="auto", help="the op table (auto: the default path; triton: every Triton entry)")
    a = ap.parse_args(argv)
    records = measure(a.reps, backend=a.backend)
    if a.out:
        from benchmarks.records import git_commit, replace_text

        meta = {"gpu": None, "cpu": platform.processor() or platform.machine(), "commit": git_commit(),
                "command": "python3 -m benchmarks.host_stub " + " ".join(argv if argv is not None else sys.argv[1:]),
                "torch": torch.__version__}
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        replace_text(a.out, json.dumps([{**r, **meta} for r in records], indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
