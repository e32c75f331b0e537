"""python -m packedenc.convert SRC DST: load a checkpoint (folder or hub id) and write it back out
as an HF folder (config.json + model.safetensors), optionally cast to another dtype."""

from __future__ import annotations

import argparse
import sys

import torch

from packedenc.errors import PackedEncError

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
          "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="model folder or hub id (e.g. answerdotai/ModernBERT-base)")
    p.add_argument("dst", help="output folder (replaced atomically if it exists)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="cast weights (default: keep)")
    p.add_argument("--revision", default=None, help="hub branch, tag or commit")


def run(args: argparse.Namespace) -> int:
    from packedenc.convert.hf import load, save
    from packedenc.hub import resolve
    from packedenc.pytree import num_params

    src = resolve(args.src, args.revision)
    params = load(src, dtype=DTYPES.get(args.dtype))
    out = save(params, args.dst, copy_tokenizer_from=src)
    print(f"wrote {type(params).__name__} ({num_params(params):,} parameters) to {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m packedenc.convert", description=__doc__)
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        return run(args)
    except PackedEncError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
