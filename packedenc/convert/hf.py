"""Hugging Face checkpoints <-> params trees, for every family.

Reading (`convert/reader.py`): `model.safetensors.index.json` (sharded) or `model.safetensors`,
opened lazily with `safe_open(..., device=...)` so each tensor is read once straight to its device;
otherwise `pytorch_model.bin` with `torch.load(weights_only=True)`. The family's key map (in
`convert/hf_<family>.py`) names the HF key(s) of every params leaf; the loader walks
`params_spec(cfg)` leaf by leaf, so every leaf is set exactly once, and it raises a
`CheckpointError` naming any missing, mis-shaped or non-float tensor, and any unexpected one inside
the encoder (one outside it, a task head we do not model, is skipped with a warning unless strict).
Writing (`convert/files.py`): only the checkpoint's own files, each atomically, never a window
without a checkpoint.

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
import warnings
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import Tensor

from packedenc.checks import as_device, float_dtype
from packedenc.convert.files import OWNER_KEY, check_complete, write_checkpoint
from packedenc.convert.reader import CheckpointReader, read_config
from packedenc.errors import CheckpointError, CheckpointWarning, ConfigError, InputTypeError, PackedEncError
from packedenc.models import family_for_model_type, family_of
from packedenc.pytree import ParamSpec, named_leaves, tree_map_specs

__all__ = ["load", "save", "from_state_dict", "to_state_dict", "CheckpointReader", "read_config", "config_of"]


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
        roots: the backbone's top-level module names ("embeddings", "encoder", ...): with no
            prefix, a key under one of them is the encoder's, whatever the config's layer count.
    """

    base_prefix: str
    anchor: str
    rename: tuple[tuple[str, str], ...] = ()
    top_level: tuple[str, ...] = ()
    fused: tuple[tuple[str, tuple[str, ...]], ...] = ()
    ignore: tuple[str, ...] = ()
    roots: tuple[str, ...] = ()

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


def from_state_dict(cfg: Any, tensors: Mapping[str, Tensor] | CheckpointReader, *,
                    dtype: torch.dtype | None = None, strict: bool = False, source: Any = "checkpoint") -> Any:
    """Build a params tree for config `cfg` from HF-named tensors (a dict or a reader).

    Tensors inside the encoder that the config does not expect are an error (config and weights
    disagree). Tensors outside it (task heads packedenc does not model, e.g. `cls.<name>.*` beside
    `bert.*`) are skipped with a `CheckpointWarning` naming them, as transformers reports unused
    keys; `strict=True` refuses them. `source` names the checkpoint in messages.
    """
    dtype = float_dtype(dtype)
    if not isinstance(strict, bool):
        raise InputTypeError(f"strict must be True or False, got {strict!r}")
    if not isinstance(tensors, (Mapping, CheckpointReader)):
        raise InputTypeError(f"tensors must be a dict of HF-named tensors, got {type(tensors).__name__}")
    family = family_for_model_type(cfg.to_hf()["model_type"])
    km, kmod = _keymap(family, cfg)
    keys = list(tensors.keys())
    base, top = _find_prefix(keys, km)
    heads = kmod.detect_heads({k[len(top):] for k in keys if k.startswith(top)}, cfg)
    spec = family.params_spec(cfg, heads=heads)

    wanted: dict[str, tuple[str, ...]] = {}
    for path, _ in named_leaves(spec):
        pre = top if km.is_top_level(path) else base
        wanted[path] = tuple(pre + n for n in km.hf_names(path))
    present = set(keys)
    missing = sorted(k for ks in wanted.values() for k in ks if k not in present)
    if missing:
        raise CheckpointError(
            f"{source} is missing {len(missing)} tensor(s) the config needs: {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''} (a config flag such as *_bias may disagree with the weights)"
        )
    used = {k for ks in wanted.values() for k in ks}
    _check_unused(keys, used, km, base, top, wanted, strict, source)
    loaded = tensors.get_many(used) if isinstance(tensors, CheckpointReader) else {k: tensors[k] for k in used}
    for k, t in loaded.items():  # int8 / bool weights would turn encode's output into garbage later
        if not isinstance(t, Tensor) or t.dtype not in _FLOAT_WEIGHTS:
            raise CheckpointError(f"{source}: tensor {k!r} is {getattr(t, 'dtype', type(t).__name__)}, not a "
                                  "floating dtype; quantized or integer weights are not supported")

    def build(path: str, s: ParamSpec) -> Tensor:
        parts = [loaded[k] for k in wanted[path]]
        t = parts[0] if len(parts) == 1 else torch.cat(parts, 0)
        if tuple(t.shape) != tuple(s.shape):
            raise CheckpointError(
                f"{source}: tensor {wanted[path][0]!r} has shape {tuple(t.shape)} but the config implies "
                f"{tuple(s.shape)} (for params.{path}); config.json and the weights disagree"
            )
        return t if dtype is None else t.to(dtype)

    return tree_map_specs(build, spec)


_FLOAT_WEIGHTS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _check_unused(keys: list[str], used: set[str], km: KeyMap, base: str, top: str,
                  wanted: dict[str, tuple[str, ...]], strict: bool, source: Any) -> None:
    """Unused tensors: inside the encoder's namespace an error; outside it skipped with a warning."""
    ignore = [re.compile(p) for p in km.ignore]
    unused = sorted(k for k in keys if k not in used
                    and not any(r.fullmatch(k[len(top):] if k.startswith(top) else k) for r in ignore))
    # The encoder's namespace: everything under a backbone prefix ("bert."); without one, the
    # top-level modules the encoder's own keys start with ("embeddings", "encoder", ...).
    roots = {k[len(base):].split(".", 1)[0] for p, ks in wanted.items() if not km.is_top_level(p) for k in ks}
    roots |= set(km.roots)
    inside = [k for k in unused if (k.startswith(base) if base else k.split(".", 1)[0] in roots)]
    outside = [k for k in unused if k not in inside]
    if inside or (outside and strict):
        bad = inside or outside
        why = ("a config flag may disagree with the weights, or this is a different architecture" if inside
               else "tensors outside the encoder, refused because strict=True")
        raise CheckpointError(f"{source} has {len(bad)} unexpected tensor(s): {bad[:8]}"
                              f"{' ...' if len(bad) > 8 else ''} ({why})")
    if outside:
        warnings.warn(f"{source}: skipped {len(outside)} tensor(s) outside the encoder that packedenc does not "
                      f"model (task heads): {outside[:8]}{' ...' if len(outside) > 8 else ''}; pass strict=True "
                      "to refuse them", CheckpointWarning, stacklevel=4)


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
         dtype: torch.dtype | None = None, device: torch.device | str | None = None, strict: bool = False) -> Any:
    """Load a params tree from a local folder or a hub id.

    Arguments:
        path_or_repo_id: folder with config.json + weights, or a hub id ("answerdotai/ModernBERT-base").
        revision: hub branch / tag / commit. dtype: cast floating leaves (default: as stored); a
            floating torch.dtype. device: where the tensors are read to (safetensors reads straight
            to a CUDA device).
        strict: refuse tensors outside the encoder (task heads packedenc does not model) instead of
            skipping them with a `CheckpointWarning`. Unexpected tensors inside the encoder are
            always an error.
    Return:
        the family's params tree, with its config carried as static metadata.
    """
    from packedenc.hub import resolve

    if not isinstance(path_or_repo_id, (str, os.PathLike)):
        raise InputTypeError(f"load() takes a folder or a hub id, got {type(path_or_repo_id).__name__}")
    if revision is not None and not isinstance(revision, str):
        raise InputTypeError(f"revision must be a str (branch, tag or commit), got {revision!r}")
    dtype, device = float_dtype(dtype), as_device(device)
    folder = resolve(path_or_repo_id, revision)
    check_complete(folder)
    cfg = config_of(folder, read_config(folder))
    return from_state_dict(cfg, CheckpointReader(folder, device), dtype=dtype, strict=strict, source=folder)


def config_of(folder: Path, cfg_dict: dict[str, Any]) -> Any:
    """The family config of a config.json dict; every error names the file."""
    path = Path(folder) / "config.json"
    model_type = cfg_dict.get("model_type")
    if not isinstance(model_type, str):
        raise ConfigError(f"{path}: model_type must be a string such as \"bert\", got {model_type!r}")
    try:
        family = family_for_model_type(model_type)
        return family.config_from_hf(cfg_dict)
    except PackedEncError as e:
        raise type(e)(f"{path}: {e}") from None
    except (TypeError, ValueError, KeyError, AttributeError, ZeroDivisionError, IndexError) as e:
        raise ConfigError(f"{path}: cannot read this {cfg_dict.get('model_type')} config "
                          f"({type(e).__name__}: {e}); a field has a value of the wrong type") from e


# What a model's tokenizer is made of (fast tokenizers: tokenizer.json; slow ones: a vocabulary).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.txt", "vocab.json", "merges.txt", "spm.model", "sentencepiece.bpe.model",
                   "tokenizer.model")


def save(params: Any, folder: str | os.PathLike, *, copy_tokenizer_from: str | os.PathLike | None = None,
         overwrite: bool = False) -> Path:
    """Write an HF-compatible checkpoint (config.json + model.safetensors) that transformers loads.

    Only those files (and the tokenizer files when asked) are written, each through a temp file in
    the same folder and an atomic rename, weights first and config.json last; a crash at any moment
    leaves a checkpoint that loads (the old or the new one) or one that `load` reports as
    half-finished by name, never none. Everything else in the folder (a sentence-transformers
    folder's modules.json, Pooling/, README...) is kept. An old sharded index is removed with its
    shards, since it would hide the new weights.

    Arguments:
        params: a params tree (`load`, `init`). folder: the target folder (created if missing).
        copy_tokenizer_from: a folder whose tokenizer files are copied in too (they replace the
            target's tokenizer files); it must hold some.
        overwrite: replace a checkpoint that packedenc did not write (one it wrote is replaced anyway).
    Return:
        the folder, resolved.
    """
    from safetensors.torch import save_file

    if not isinstance(folder, (str, os.PathLike)) or not str(folder):
        raise InputTypeError(f"save() needs a folder path, got {folder!r}")
    if not isinstance(overwrite, bool):
        raise InputTypeError(f"overwrite must be True or False, got {overwrite!r}")
    folder = Path(folder).expanduser().resolve()
    if folder.exists() and not folder.is_dir():
        raise CheckpointError(f"{folder} exists and is not a folder")
    sd, cfg_dict = to_state_dict(params)
    tok = _tokenizer_files(copy_tokenizer_from, folder)
    sd = {k: v.detach().contiguous().cpu() for k, v in sd.items()}
    writers = {"model.safetensors": lambda p: save_file(sd, str(p), metadata={"format": "pt", OWNER_KEY: "1"})}
    for f in tok:
        writers[f.name] = lambda p, f=f: shutil.copyfile(f, p)
    text = json.dumps(cfg_dict, indent=2, sort_keys=True) + "\n"
    writers["config.json"] = lambda p: p.write_text(text, encoding="utf-8")
    shadows = tuple(n for n in TOKENIZER_FILES if n not in writers) if tok else ()
    write_checkpoint(folder, writers, overwrite=overwrite, shadows=shadows)
    return folder


def _tokenizer_files(src: str | os.PathLike | None, target: Path) -> list[Path]:
    """The tokenizer files to copy from `src` ([] when None or when it is the target itself)."""
    if src is None:
        return []
    if not isinstance(src, (str, os.PathLike)):
        raise InputTypeError(f"copy_tokenizer_from must be a folder path, got {type(src).__name__}")
    path = Path(src).expanduser()
    if not path.is_dir():
        what = "not a folder" if path.exists() else "no such folder"
        raise CheckpointError(f"copy_tokenizer_from={str(src)!r}: {what}")
    if path.resolve() == target:
        return []  # the tokenizer is already in place
    files = [path / n for n in TOKENIZER_FILES if (path / n).is_file()]
    if not files:
        raise CheckpointError(f"copy_tokenizer_from={str(src)!r} holds no tokenizer files (looked for "
                              f"{', '.join(TOKENIZER_FILES)})")
    return files
