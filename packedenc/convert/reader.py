"""Reading a checkpoint folder: its config.json and its tensors, whatever the file layout, with
every damaged or inconsistent file reported as a `CheckpointError` / `ConfigError` naming the file.

Layouts, in the order they are looked for: `model.safetensors.index.json` (sharded), then
`model.safetensors`, then `pytorch_model*.bin` (read with `torch.load(weights_only=True)`; memory
mapped when it is a zip archive, read whole when it uses torch's legacy serialization, which
older BERT checkpoints still do).
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any, Iterable

import torch
from torch import Tensor

from packedenc.errors import CheckpointError, ConfigError

__all__ = ["CheckpointReader", "read_config", "check_config_fields"]

# Size fields every HF encoder config uses: what they must be before a family reads them (a 0 or a
# string here otherwise surfaces as a ZeroDivisionError or a TypeError deep in a config class).
_POSITIVE = ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size", "max_position_embeddings")
_NON_NEGATIVE = ("num_hidden_layers", "type_vocab_size")


class CheckpointReader:
    """Lazy access to the tensors of a folder's weights, whatever the file layout."""

    def __init__(self, folder: Path, device: torch.device | str | None = None):
        self.folder = Path(folder)
        self.device = "cpu" if device is None else str(torch.device(device))
        self._where: dict[str, Path] = {}
        self._bin: dict[str, Tensor] | None = None
        index = self.folder / "model.safetensors.index.json"
        single = self.folder / "model.safetensors"
        if index.is_file():
            self._where = _read_index(index)
        elif single.is_file():
            self._where = {k: single for k in safetensors_keys(single)}
        else:
            bins = sorted(self.folder.glob("pytorch_model*.bin"))
            if not bins:
                raise CheckpointError(
                    f"no weights in {self.folder}: expected model.safetensors, "
                    "model.safetensors.index.json or pytorch_model.bin"
                )
            self._bin = {}
            for b in bins:
                sd = _read_bin(b)
                self._bin.update(sd)
                self._where.update({k: b for k in sd})

    def keys(self) -> list[str]:
        return list(self._where)

    def file_of(self, key: str) -> Path:
        return self._where[key]

    def get_many(self, keys: Iterable[str]) -> dict[str, Tensor]:
        """Read `keys`, opening each safetensors file once."""
        keys = list(keys)
        if self._bin is not None:
            return {k: self._bin[k].to(self.device) for k in keys}
        from safetensors import safe_open

        by_file: dict[Path, list[str]] = {}
        for k in keys:
            by_file.setdefault(self._where[k], []).append(k)
        out = {}
        for path, ks in by_file.items():
            k = ks[0]
            try:
                with safe_open(str(path), framework="pt", device=self.device) as f:
                    for k in ks:
                        out[k] = f.get_tensor(k)
            except Exception as e:  # safetensors raises its own SafetensorError, or an OSError
                raise CheckpointError(f"cannot read tensor {k!r} from {path}: {type(e).__name__}: {e}") from e
        return out


def safetensors_keys(path: Path) -> set[str]:
    """The tensor names in a safetensors file; a CheckpointError naming it when it is damaged
    (empty, truncated, garbage: safetensors checks that the header covers the whole file)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return set(f.keys())
    except Exception as e:
        raise CheckpointError(
            f"{path} is not a readable safetensors file ({type(e).__name__}: {e}); it may be truncated or "
            "damaged: download or save it again"
        ) from e


def safetensors_metadata(path: Path) -> dict[str, str]:
    """The string metadata of a safetensors header ({} when unreadable)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return dict(f.metadata() or {})
    except Exception:
        return {}


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON ({e}); the {what} may be truncated or damaged") from e
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e.strerror or e}") from e


def _read_index(index: Path) -> dict[str, Path]:
    """key -> shard file, from a sharded checkpoint's index, with every route checked."""
    data = _read_json(index, "index")
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(
            f"{index} has no \"weight_map\" object (tensor name -> shard file), so the shards cannot be "
            f"found; got {type(data).__name__} with keys {sorted(data)[:5] if isinstance(data, dict) else '-'}"
        )
    folder = index.parent
    where: dict[str, Path] = {}
    for k, f in weight_map.items():
        if not isinstance(f, str) or not f or Path(f).is_absolute() or ".." in Path(f).parts:
            raise CheckpointError(f"{index} routes {k!r} to {f!r}, which is not a file name inside {folder}")
        where[k] = folder / f
    missing = sorted({p.name for p in where.values() if not p.is_file()})
    if missing:
        raise CheckpointError(f"{index} names shard files that are missing: {missing}")
    by_file: dict[Path, list[str]] = {}
    for k, p in where.items():
        by_file.setdefault(p, []).append(k)
    for p, ks in by_file.items():
        held = safetensors_keys(p)
        lost = [k for k in ks if k not in held]
        if lost:
            raise CheckpointError(
                f"{index} routes {lost[0]!r}{f' (and {len(lost) - 1} more)' if len(lost) > 1 else ''} to "
                f"{p.name}, which does not hold it; the index and the shards are from different saves"
            )
    return where


def _read_bin(path: Path) -> dict[str, Tensor]:
    # mmap needs the zip format; checkpoints written with torch's legacy serialization (older BERT
    # releases) are read whole, still with weights_only=True.
    mmap = zipfile.is_zipfile(path)
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:
        raise CheckpointError(f"cannot read {path} with weights_only=True: {type(e).__name__}: {e}") from e
    if not isinstance(sd, dict) or not all(isinstance(k, str) and isinstance(v, Tensor) for k, v in sd.items()):
        raise CheckpointError(f"{path} does not hold a state dict (tensor name -> tensor), got {type(sd).__name__}")
    return sd


def read_config(folder: Path) -> dict[str, Any]:
    """config.json as a dict, with its size fields checked (errors name the file and the field)."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{folder} has no config.json; is it a Hugging Face model folder?")
    d = _read_json(path, "config")
    if not isinstance(d, dict):
        raise ConfigError(f"{path} must hold a JSON object of settings, got a {type(d).__name__}")
    check_config_fields(d, path)
    return d


def check_config_fields(d: dict[str, Any], where: Any) -> None:
    """Raise ConfigError naming `where` and the field when a size, epsilon, RoPE base or dropout
    field has a bad type or value (families read them as they are)."""
    for name, v in d.items():
        is_num = isinstance(v, (int, float)) and not isinstance(v, bool)
        if name.endswith("eps") or name.endswith("rope_theta"):
            if not is_num or not 0 < v < float("inf"):
                raise ConfigError(f"{where}: {name} must be a positive number, got {v!r}")
        elif name.endswith("_token_id") and v is not None:
            ids = v if isinstance(v, list) else [v]  # eos_token_id may list several
            if not ids or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
                raise ConfigError(f"{where}: {name} must be a token id (an int >= 0) or null, got {v!r}")
        elif "dropout" in name and v is not None and name.endswith(("dropout", "_prob")):
            if not is_num or not 0 <= v < 1:
                raise ConfigError(f"{where}: {name} must be a number in [0, 1), got {v!r}")
    for name in _POSITIVE + _NON_NEGATIVE:
        if name not in d:
            continue
        v = d[name]
        low = 1 if name in _POSITIVE else 0
        if not isinstance(v, int) or isinstance(v, bool) or v < low:
            raise ConfigError(
                f"{where}: {name} must be an integer >= {low}, got {v!r}"
                + (f" ({type(v).__name__})" if not isinstance(v, int) else "")
            )
