"""`python -m benchmarks <family> [options]`: one entry point per benchmark family.

    python -m benchmarks modernbert            # ModernBERT-base inference vs plain torch and HF
    python -m benchmarks train --quick         # training steps
    python -m benchmarks report                # the README tables and charts from one commit's records
    python -m benchmarks <family> --help       # a family's options

Every family writes JSON records to `benchmarks/results/<family>_<gpu>.json` (see
`benchmarks/records.py`); `report` draws the tables and charts from them. A whole GPU session, one
device call per stage: `bash benchmarks/gpu_session.sh`.
"""

from __future__ import annotations

import importlib
import sys
from typing import Callable

# family -> (module, what it measures); each module has main(argv)
FAMILIES: dict[str, tuple[str, str]] = {
    "modernbert": ("benchmarks.encode", "ModernBERT-base inference: packedenc eager / graphed, plain torch, HF sdpa"),
    "deberta": ("benchmarks.encode", "DeBERTa-v3-base inference: packedenc vs DisentangledFlash, FlashDeBERTa, HF"),
    "bert": ("benchmarks.encode", "BERT-base inference: packedenc eager / graphed vs HF sdpa"),
    "graph": ("benchmarks.graph", "graph transformer forward / training vs padded SDPA and packed aten"),
    "train": ("benchmarks.train", "MLM training steps: ModernBERT-base and DeBERTa-v3-base vs peers"),
    "embed": ("benchmarks.embed", "texts -> embeddings with the real all-MiniLM-L6-v2 vs sentence-transformers"),
    "ops": ("benchmarks.ops", "fused ops alone: Triton vs plain torch vs torch.compile, error vs fp32"),
    "attention": ("benchmarks.attention", "varlen attention forward / backward (its own script)"),
    "cute": ("benchmarks.cute", "the cute backend (FA4, CuteDSL) vs Triton: attention, GeGLU GEMM, norms, model"),
    "distributed": ("benchmarks.distributed", "data-parallel scaling on 1 and N GPUs"),
    "report": ("benchmarks.report", "README tables + charts from one commit's records"),
}
_ENCODE = ("modernbert", "deberta", "bert")


def entry(family: str) -> Callable[[list[str]], int]:
    """The family's main(argv); a clear SystemExit when its module is missing."""
    module, _ = FAMILIES[family]
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise
        raise SystemExit(f"{family}: {module} is not in this checkout") from None
    if family in _ENCODE:
        return lambda argv: mod.main(argv, family)
    if family == "attention":  # its script asks for the results folder: the suite's, unless given
        from benchmarks.records import RESULTS_DIR

        return lambda argv: mod.main(argv if "--out" in argv else ["--out", str(RESULTS_DIR), *argv])
    return mod.main


def usage() -> str:
    width = max(map(len, FAMILIES))
    lines = [__doc__.strip().split("\n\n")[0], "", "families:"]
    lines += [f"  {name:<{width}}  {what}" for name, (_, what) in FAMILIES.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    family, rest = argv[0], argv[1:]
    if family not in FAMILIES:
        print(f"unknown family {family!r}\n\n{usage()}", file=sys.stderr)
        return 2
    rc = entry(family)(rest)
    return rc if isinstance(rc, int) else 0  # a family may return its records instead of a code


if __name__ == "__main__":
    raise SystemExit(main())
