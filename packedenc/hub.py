"""Resolve a local folder or a Hugging Face hub id to a local folder. The only module that talks
to `huggingface_hub`.

A hub id is fetched with `snapshot_download`, limited to config, safetensors (or .bin when a repo
has no safetensors), tokenizer and sentence-transformers module files. `HF_HUB_OFFLINE=1` is
honoured: only the local cache is consulted.
"""

from __future__ import annotations

import os
from pathlib import Path

from packedenc.errors import CheckpointError

__all__ = ["resolve"]

# What packedenc reads from a model repo. Weights: safetensors first; .bin only as a fallback.
ALLOW_PATTERNS = [
    "*.json",
    "*.safetensors",
    "tokenizer*",
    "spm.model",
    "*.model",
    "vocab.txt",
    "merges.txt",
    "*/config.json",
    "*/*.safetensors",
]
BIN_PATTERNS = ["pytorch_model*.bin", "*/pytorch_model.bin"]


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on") or \
        os.environ.get("TRANSFORMERS_OFFLINE", "0").lower() in ("1", "true", "yes", "on")


def resolve(path_or_repo_id: str | os.PathLike, revision: str | None = None) -> Path:
    """Return a local folder holding the model's files.

    Arguments:
        path_or_repo_id: a local folder, or a hub id such as "answerdotai/ModernBERT-base".
        revision: branch, tag or commit (hub ids only). Pin a commit for reproducibility.
    """
    p = Path(path_or_repo_id).expanduser()
    if p.is_dir():
        return p
    s = str(path_or_repo_id)
    if p.exists():
        raise CheckpointError(f"{s} is a file; pass the folder that holds config.json and the weights")
    if s.startswith((".", "/", "~")) or s.count("/") > 1 or not s:
        raise CheckpointError(f"folder {s!r} does not exist")
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:  # pragma: no cover - a core dependency
        raise CheckpointError(f"{s!r} is not a local folder and huggingface_hub is missing: {e}") from e
    offline = _offline()
    try:
        folder = Path(snapshot_download(s, revision=revision, allow_patterns=ALLOW_PATTERNS,
                                        local_files_only=offline))
        if not any(folder.glob("*.safetensors")) and not any(folder.glob("*.safetensors.index.json")):
            folder = Path(snapshot_download(s, revision=revision, allow_patterns=ALLOW_PATTERNS + BIN_PATTERNS,
                                            local_files_only=offline))
    except Exception as e:
        how = (
            "HF_HUB_OFFLINE is set, so only the local cache was searched: download it once with network "
            f"access (`huggingface-cli download {s}`) or pass a local folder"
            if offline
            else "check the id and your network, or download it elsewhere and pass the local folder"
        )
        raise CheckpointError(
            f"model {s!r} is neither a local folder nor in the Hugging Face cache ({type(e).__name__}: {e}); {how}"
        ) from e
    return folder
