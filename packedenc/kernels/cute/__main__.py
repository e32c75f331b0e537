"""Warm CuteDSL's compile caches: `python -m packedenc.kernels.cute [--head-dims 64 128] [--dtypes bf16]`.

Compiles (or finds already cached) our GeGLU GEMM for each (dtype, model width) of `--geglu`
(`compile_cache.py`: on by default, PACKEDENC_CUTE_CACHE), then runs FA4's attention once per
(dtype, head dim, global / windowed, inference / training) on a tiny pack, so that FA4 compiles
it into its own on-disk cache; later processes that set the same FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
(and FLASH_ATTENTION_CUTE_DSL_CACHE_DIR) load them. See the package docstring. Needs the extra
and an sm90+ GPU.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
WINDOWS = ((-1, -1), (64, 64))  # global layers; ModernBERT's local layers
GEGLU = ("768:1152", "1024:2624")  # ModernBERT-base and -large: hidden:mlp width (Wi is 2 x width)


def _width(value: str) -> str:
    """argparse type of a --geglu value: "D:F", both positive multiples of 8 (the kernel's TMA strides)."""
    D, _, F = value.partition(":")
    if not (D.isdigit() and F.isdigit() and int(D) > 0 and int(F) > 0 and int(D) % 8 == 0 and int(F) % 8 == 0):
        raise argparse.ArgumentTypeError(f"{value!r} is not hidden:mlp, two positive multiples of 8 (e.g. 768:1152)")
    return value


def warm_geglu(widths=GEGLU, dtypes=(torch.bfloat16,)) -> list[str]:
    """Compile, or load from the on-disk cache, the GeGLU GEMM for each (dtype, "D:F")."""
    from packedenc.kernels import get_ops
    from packedenc.kernels.cute import compile_cache, geglu_gemm

    get_ops("cute", "cuda")  # raises ConfigError naming the extra when it is missing
    lines = []
    for dtype in dtypes:
        for width in widths:
            D, F = (int(v) for v in width.split(":"))
            t0 = time.perf_counter()
            geglu_gemm.compiled(dtype, D, F)
            how = geglu_gemm.HOW[(dtype, D, F, geglu_gemm.DEFAULT_TILE)]
            lines.append(f"geglu_gemm {str(dtype).removeprefix('torch.')} D={D} F={F}: {how}, "
                         f"{time.perf_counter() - t0:.2f} s")
    lines.append(f"geglu cache: {compile_cache.cache_dir() or 'off (' + compile_cache.ENV + ')'}")
    return lines


def warm(head_dims=(64, 128), dtypes=(torch.bfloat16,), heads: int = 12, backward: bool = True) -> list[str]:
    """Compile (or load) every cute kernel for these shapes; returns one line per kernel set."""
    from packedenc.kernels import get_ops
    from packedenc.kernels.cute import attention

    get_ops("cute", "cuda")  # raises ConfigError naming the extra when it is missing
    lengths = (1, 100, 300)
    cu = torch.tensor([0, 1, 101, 401], dtype=torch.int32, device="cuda")
    lines = []
    for dtype in dtypes:
        for K in head_dims:
            for window in WINDOWS:
                t0 = time.perf_counter()
                q, k, v = (torch.randn(sum(lengths), heads, K, device="cuda", dtype=dtype) for _ in range(3))
                with torch.no_grad():
                    attention.varlen_attention(q, k, v, cu, max(lengths), window)
                if backward:
                    leaves = [t.requires_grad_() for t in (q, k, v)]
                    out = attention.varlen_attention(*leaves, cu, max(lengths), window)
                    torch.autograd.grad(out, leaves, torch.ones_like(out))
                torch.cuda.synchronize()
                lines.append(f"varlen_attention {str(dtype).removeprefix('torch.')} K={K} window={window}: "
                             f"{time.perf_counter() - t0:.2f} s")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m packedenc.kernels.cute", description=__doc__.split("\n")[0])
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["bf16"])
    ap.add_argument("--no-backward", action="store_true", help="inference kernels only")
    ap.add_argument("--geglu", nargs="*", type=_width, default=list(GEGLU), metavar="D:F",
                    help="model widths of the GeGLU GEMM, hidden:mlp (default: ModernBERT base and large)")
    a = ap.parse_args(argv)
    from packedenc.errors import ConfigError

    dtypes = tuple(DTYPES[d] for d in a.dtypes)
    try:
        print("\n".join(warm_geglu(tuple(a.geglu), dtypes)))
    except ConfigError as e:  # the extra is missing
        print(e, file=sys.stderr)
        return 2
    if os.environ.get("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED") != "1":
        print("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED is not 1: FA4 would compile into memory only and the "
              "next process would compile again. Set it (and FLASH_ATTENTION_CUTE_DSL_CACHE_DIR, for a cache "
              "that outlives $TMPDIR) in the environment of this command and of the processes that use it.",
              file=sys.stderr)
        return 2
    print("\n".join(warm(tuple(a.head_dims), dtypes, backward=not a.no_backward)))
    print(f"cache: {os.environ.get('FLASH_ATTENTION_CUTE_DSL_CACHE_DIR', '(FA4 default, under the temp folder)')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
