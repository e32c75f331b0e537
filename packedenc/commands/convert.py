"""`packedenc convert SRC DST`: load a checkpoint (folder or hub id) and write it back out as an HF
checkpoint (config.json + model.safetensors and the tokenizer files), optionally cast to another dtype.

Only those files are written into DST; everything else there is kept, so converting a
sentence-transformers folder in place (SRC = DST, with --overwrite) keeps it a working
sentence-transformers folder: its backbone (the Transformer module's folder) is rewritten, its
Pooling / Dense / Normalize modules are untouched.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
          "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="model folder or hub id (e.g. answerdotai/ModernBERT-base)")
    p.add_argument("dst", help="output folder; only the checkpoint's own files are written there, each atomically")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="cast weights (default: keep)")
    p.add_argument("--revision", default=None, help="hub branch, tag or commit")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a checkpoint in DST that packedenc did not write (needed to convert in place)")


def run(args: argparse.Namespace) -> int:
    from packedenc.commands.errors import OutputError
    from packedenc.commands.inputs import backbone_folder
    from packedenc.convert.hf import TOKENIZER_FILES, load, save
    from packedenc.errors import CheckpointError
    from packedenc.hub import resolve
    from packedenc.pytree import num_params

    src = resolve(args.src, args.revision)
    backbone = backbone_folder(src)
    params = load(backbone, dtype=DTYPES.get(args.dtype))
    dst = Path(args.dst) / backbone.relative_to(src)  # a sentence-transformers backbone keeps its sub-folder
    tok = next((f for f in (backbone, src) if any((f / n).is_file() for n in TOKENIZER_FILES)), None)
    try:
        out = save(params, dst, copy_tokenizer_from=tok, overwrite=args.overwrite)
    except CheckpointError as e:  # save's own errors are about the destination
        raise OutputError(str(e)) from None
    except OSError as e:
        raise OutputError(f"cannot write {e.filename or dst}: {e.strerror or e}") from None
    print(f"wrote {type(params).__name__} ({num_params(params):,} parameters) to {out}"
          + ("" if tok is not None else f" (no tokenizer files in {args.src} to copy)"))
    return 0
