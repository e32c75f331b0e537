"""Warm CuteDSL's compile cache: `python -m packedenc.kernels.cute [--head-dims 64 128] [--dtypes bf16]`.

Runs the cute backend's kernels once per (dtype, head dim, global / windowed, inference / training)
on a tiny pack, so that FA4 compiles them into its on-disk cache; later processes that set the same
FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 (and FLASH_ATTENTION_CUTE_DSL_CACHE_DIR) load them.
See the package docstring. Needs the extra and an sm90+ GPU.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
WINDOWS = ((-1, -1), (64, 64))  # global layers; ModernBERT's local layers


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
    a = ap.parse_args(argv)
    if os.environ.get("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED") != "1":
        print("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED is not 1: FA4 would compile into memory only and the "
              "next process would compile again. Set it (and FLASH_ATTENTION_CUTE_DSL_CACHE_DIR, for a cache "
              "that outlives $TMPDIR) in the environment of this command and of the processes that use it.",
              file=sys.stderr)
        return 2
    from packedenc.errors import ConfigError

    try:
        lines = warm(tuple(a.head_dims), tuple(DTYPES[d] for d in a.dtypes), backward=not a.no_backward)
    except ConfigError as e:  # the extra is missing
        print(e, file=sys.stderr)
        return 2
    print("\n".join(lines))
    print(f"cache: {os.environ.get('FLASH_ATTENTION_CUTE_DSL_CACHE_DIR', '(FA4 default, under the temp folder)')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
