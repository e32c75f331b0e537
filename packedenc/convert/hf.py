"""Hugging Face checkpoints <-> params trees, for every family.

Reading: `model.safetensors.index.json` (sharded) or `model.safetensors`, opened lazily with
`safe_open(..., device=...)` so each tensor is read once straight to its device; otherwise
`pytorch_model.bin` with `torch.load(weights_only=True)`. The family's key map (in
`convert/hf_<family>.py`) names the HF key(s) of every params leaf; the loader walks
`params_spec(cfg)` leaf by leaf, so every leaf is set exactly once, and it raises a
`CheckpointError` naming any missing, unexpected or mis-shaped key.

Checkpoint prefixes are discovered, not assumed: none (sentence-transformers backbones),
`model.` / `deberta.` / `bert.` (task models), or nested (`0.model.`). Heads live one level up,
next to the backbone prefix.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterable

import torch
from torch import Tensor

from packedenc.errors import CheckpointError
from packedenc.models import family_for_model_type, family_of
from packedenc.pytree import ParamSpec, named_leaves, tree_map_specs

__all__ = ["load", "save", "from_state_dict", "to_state_dict", "CheckpointReader", "read_config"]


@dataclasses.dataclass(frozen=True)
class KeyMap:
    """How one family's params leaves are named in HF checkpoints.

    Fields:
        base_prefix: the task models' backbone attribute plus a dot ("model.", "deberta.").
        anchor: a key every backbone checkpoint has, relative to the backbone (finds the prefix).
        rename: ordered (our_fragment, hf_fragment) substring renames, applied to leaf paths.
        top_level: leaf-path prefixes that live beside the backbone (heads), not inside it.
        fused: our leaf path suffix -> HF suffixes concatenated along dim 0 to make it.
        ignore: regexes of HF keys (relative to the top) that are read by nobody and are fine to skip.
    """

    base_prefix: str
    anchor: str
    rename: tuple[tuple[str, str], ...] = ()
    top_level: tuple[str, ...] = ()
    fused: tuple[tuple[str, tuple[str, ...]], ...] = ()
    ignore: tuple[str, ...] = ()

    def hf_names(self, path: str) -> tuple[str, ...]:
        """HF key(s) of a params leaf path, relative to the backbone (or the top for heads)."""
        for ours, theirs in self.fused:
            if path.endswith(ours):
                stem = path[: -len(ours)]
                return tuple(self._rename(stem + t) for t in theirs)
        return (self._rename(path),)

    def _rename(self, path: str) -> str:
        out = f".{path}."
        for ours, theirs in self.rename:
            out = out.replace(f".{ours}.", f".{theirs}.")
        return out[1:-1]

    def is_top_level(self, path: str) -> bool:
        return any(path == t or path.startswith(t + ".") for t in self.top_level)


def _keymap(family_module: Any, cfg: Any = None) -> tuple[KeyMap, Any]:
    name = family_module.__name__.rsplit(".", 1)[-1]
    mod = importlib.import_module(f"packedenc.convert.hf_{name}")
    # A module that serves several model types (BERT / RoBERTa prefixes) picks its map per config.
    if cfg is not None and hasattr(mod, "keymap_for"):
        return mod.keymap_for(cfg), mod
    return mod.KEYMAP, mod


# ---- reading ----------------------------------------------------------------------------------


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
            weight_map = json.loads(index.read_text())["weight_map"]
            for k, f in weight_map.items():
                self._where[k] = self.folder / f
            missing = {str(p.name) for p in set(self._where.values()) if not p.is_file()}
            if missing:
                raise CheckpointError(f"{index} names shard files that are missing: {sorted(missing)}")
        elif single.is_file():
            from safetensors import safe_open

            with safe_open(str(single), framework="pt") as f:
                for k in f.keys():
                    self._where[k] = single
        else:
            bins = sorted(self.folder.glob("pytorch_model*.bin"))
            if not bins:
                raise CheckpointError(
                    f"no weights in {self.folder}: expected model.safetensors, "
                    "model.safetensors.index.json or pytorch_model.bin"
                )
            self._bin = {}
            for b in bins:
                try:
                    sd = torch.load(b, map_location="cpu", weights_only=True, mmap=True)
                except Exception as e:
                    raise CheckpointError(f"cannot read {b} with weights_only=True: {e}") from e
                self._bin.update(sd)
            self._where = {k: bins[0] for k in self._bin}

    def keys(self) -> list[str]:
        return list(self._where)

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
            with safe_open(str(path), framework="pt", device=self.device) as f:
                for k in ks:
                    out[k] = f.get_tensor(k)
        return out


def read_config(folder: Path) -> dict[str, Any]:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{folder} has no config.json; is it a Hugging Face model folder?")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from e


def _find_prefix(keys: list[str], km: KeyMap) -> tuple[str, str]:
    """(backbone prefix, top prefix) found from where the anchor key sits."""
    hits = sorted((k[: -len(km.anchor)] for k in keys if k.endswith(km.anchor)), key=len)
    hits = [h for h in hits if h == "" or h.endswith(".")]
    if not hits:
        raise CheckpointError(
            f"the checkpoint has no {km.anchor!r} (under any prefix): it does not look like this model "
            f"family; first keys: {keys[:5]}"
        )
    base = hits[0]
    top = base[: -len(km.base_prefix)] if km.base_prefix and base.endswith(km.base_prefix) else base
    return base, top


def from_state_dict(cfg: Any, tensors: dict[str, Tensor] | CheckpointReader, *,
                    dtype: torch.dtype | None = None) -> Any:
    """Build a params tree for config `cfg` from HF-named tensors (a dict or a reader)."""
    family = family_for_model_type(cfg.to_hf()["model_type"])
    km, kmod = _keymap(family, cfg)
    keys = tensors.keys() if isinstance(tensors, CheckpointReader) else list(tensors)
    keys = list(keys)
    base, top = _find_prefix(keys, km)
    rel_top = {k[len(top):] for k in keys if k.startswith(top)}
    heads = kmod.detect_heads(rel_top, cfg)
    spec = family.params_spec(cfg, heads=heads)

    wanted: dict[str, tuple[str, ...]] = {}
    for path, _ in named_leaves(spec):
        pre = top if km.is_top_level(path) else base
        wanted[path] = tuple(pre + n for n in km.hf_names(path))
    present = set(keys)
    missing = sorted(k for ks in wanted.values() for k in ks if k not in present)
    if missing:
        raise CheckpointError(
            f"checkpoint is missing {len(missing)} tensor(s) the config needs: {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''} (a config flag such as *_bias may disagree with the weights)"
        )
    used = {k for ks in wanted.values() for k in ks}
    ignore = [re.compile(p) for p in km.ignore]
    unexpected = sorted(
        k for k in keys
        if k not in used and not any(r.fullmatch(k[len(top):] if k.startswith(top) else k) for r in ignore)
    )
    if unexpected:
        raise CheckpointError(
            f"checkpoint has {len(unexpected)} unexpected tensor(s): {unexpected[:8]}"
            f"{' ...' if len(unexpected) > 8 else ''} (a config flag may disagree with the weights, or this "
            "is a different architecture)"
        )
    if isinstance(tensors, CheckpointReader):
        loaded = tensors.get_many(used)
    else:
        loaded = {k: tensors[k] for k in used}

    def build(path: str, s: ParamSpec) -> Tensor:
        parts = [loaded[k] for k in wanted[path]]
        t = parts[0] if len(parts) == 1 else torch.cat(parts, 0)
        if tuple(t.shape) != tuple(s.shape):
            raise CheckpointError(
                f"tensor {wanted[path][0]!r} has shape {tuple(t.shape)} but the config implies "
                f"{tuple(s.shape)} (for params.{path}); config.json and the weights disagree"
            )
        return t if dtype is None else t.to(dtype)

    return tree_map_specs(build, spec)


def to_state_dict(params: Any) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """(HF-named tensors, config.json dict) for a params tree; the inverse of `from_state_dict`."""
    family = family_of(params)
    km, kmod = _keymap(family, params.config)
    cfg_dict = params.config.to_hf()
    heads = kmod.heads_of(params)
    base = km.base_prefix if heads else ""
    out: dict[str, Tensor] = {}
    for path, t in named_leaves(params):
        names = km.hf_names(path)
        pre = "" if km.is_top_level(path) else base
        if len(names) == 1:
            out[pre + names[0]] = t
        else:
            for n, chunk in zip(names, torch.chunk(t, len(names), 0)):
                out[pre + n] = chunk
    cfg_dict["architectures"] = [kmod.architecture(params)]
    if hasattr(kmod, "finish_config"):  # config fields that follow from the heads (DeBERTa `legacy`)
        cfg_dict = kmod.finish_config(params, cfg_dict)
    return out, cfg_dict


# ---- public entry points ----------------------------------------------------------------------


def load(path_or_repo_id: str | os.PathLike, *, revision: str | None = None,
         dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> Any:
    """Load a params tree from a local folder or a hub id.

    Arguments:
        path_or_repo_id: folder with config.json + weights, or a hub id ("answerdotai/ModernBERT-base").
        revision: hub branch / tag / commit. dtype: cast floating leaves (default: as stored).
        device: where the tensors are read to (safetensors reads straight to a CUDA device).
    Return:
        the family's params tree, with its config carried as static metadata.
    """
    from packedenc.hub import resolve

    folder = resolve(path_or_repo_id, revision)
    cfg_dict = read_config(folder)
    family = family_for_model_type(cfg_dict.get("model_type"))
    cfg = family.config_from_hf(cfg_dict)
    return from_state_dict(cfg, CheckpointReader(folder, device), dtype=dtype)


def save(params: Any, folder: str | os.PathLike, *, copy_tokenizer_from: str | os.PathLike | None = None) -> Path:
    """Write an HF-compatible folder (config.json + model.safetensors) that transformers loads.

    The files are written into a temporary sibling folder which then replaces `folder`, so a
    failure never leaves a half-written checkpoint behind. `copy_tokenizer_from` copies tokenizer
    files from another folder (e.g. the one the params were loaded from).
    """
    from safetensors.torch import save_file

    folder = Path(folder).expanduser().resolve()
    if folder.exists() and not folder.is_dir():
        raise CheckpointError(f"{folder} exists and is not a folder")
    folder.parent.mkdir(parents=True, exist_ok=True)
    sd, cfg_dict = to_state_dict(params)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    try:
        save_file({k: v.detach().contiguous().cpu() for k, v in sd.items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg_dict, indent=2, sort_keys=True) + "\n")
        if copy_tokenizer_from is not None:
            src = Path(copy_tokenizer_from)
            for pattern in ("tokenizer*", "special_tokens_map.json", "vocab.txt", "spm.model", "merges.txt"):
                for f in src.glob(pattern):
                    shutil.copy2(f, tmp / f.name)
        old = None
        if folder.exists():
            old = folder.parent / f".{folder.name}.old-{os.getpid()}"
            folder.rename(old)
        tmp.rename(folder)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder
