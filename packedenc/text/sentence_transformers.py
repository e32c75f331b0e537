"""sentence-transformers (and PyLate ColBERT) folders as a frozen value plus pure functions.

    model = packedenc.load_sentence_transformer("path/to/all-MiniLM-L6-v2")
    hidden = packedenc.encode(model.params, batch.ids, batch.cu_seqlens, batch.max_seqlen)
    out = run_modules(model.modules, hidden, batch)          # {"sentence_embedding": (S, D), ...}

`modules.json` lists the pipeline. The first module must be the Transformer (the backbone,
loaded with `packedenc.load`); after it come, in order, any of Pooling (`1_Pooling/config.json`:
cls, mean, max, mean_sqrt_len_tokens, weightedmean, lasttoken, several concatenated in ST's
order), Dense (a linear layer + activation on the sentence embedding, or on every token for
PyLate's ColBERT projection) and Normalize (L2). Each is a pure function of the packed encoder
output, matching sentence-transformers 6.2 (`sentence_transformers/base/modules/*.py`,
`sentence_transformer/modules/pooling.py`).

A folder without `modules.json` (a bare HF model) gets mean pooling and no normalization, as
`SentenceTransformer(folder)` does.

Shapes: T packed tokens, S sequences, D hidden, E output width.
"""

from __future__ import annotations

import dataclasses
import json
import os
import string
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from packedenc.errors import CheckpointError, ConfigError, InputTypeError
from packedenc.kernels.reference import activation as _activation
from packedenc.packing import Packed, first_rows, last_rows, max_rows, mean_rows, segment_ids
from packedenc.pytree import Linear, pytree_dataclass, static, tree_cast, tree_leaves, tree_to

__all__ = ["Pooling", "Dense", "Normalize", "SkipTokens", "SentenceModel", "load_sentence_transformer",
           "pool", "dense", "run_modules", "POOLING_MODES"]

# ST's concatenation order when several modes are on (pooling.py `_LEGACY_POOLING_MODE_KWARGS`).
POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")
_LEGACY_POOLING_KEYS = dict(zip(
    ("pooling_mode_cls_token", "pooling_mode_max_tokens", "pooling_mode_mean_tokens",
     "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens", "pooling_mode_lasttoken"),
    POOLING_MODES,
))
_MODE_ALIASES = {"first": "cls", "last": "lasttoken", "weighted_mean": "weightedmean", "weighted-mean": "weightedmean",
                 "last-token": "lasttoken", "last_token": "lasttoken"}
# torch.nn activation classes ST writes in Dense configs -> packedenc activation names.
_ACTIVATIONS = {"Tanh": "tanh", "Identity": "linear", "ReLU": "relu", "GELU": "gelu", "Sigmoid": "sigmoid",
                "SiLU": "silu"}


@pytree_dataclass
class Pooling:
    modes: tuple[str, ...] = static(("mean",))
    include_prompt: bool = static(True)


@pytree_dataclass
class Dense:
    linear: Linear  # (E, D)
    residual: Linear | None = None  # use_residual with D != E: a bias-free projection of the input
    activation: str = static("tanh")
    use_residual: bool = static(False)
    input_name: str = static("sentence_embedding")
    output_name: str = static("sentence_embedding")


@pytree_dataclass
class Normalize:
    input_name: str = static("sentence_embedding")
    output_name: str = static("sentence_embedding")


@pytree_dataclass
class SkipTokens:
    """ColBERT: drop the token embeddings of these ids (PyLate's punctuation skiplist), for documents
    only by default (ST's `MultiVectorMask.skiplist_tasks`)."""

    ids: tuple[int, ...] = static(())
    tasks: tuple[str, ...] = static(("document",))


@dataclasses.dataclass(frozen=True)
class ColbertConfig:
    """PyLate's knobs (config_sentence_transformers.json of a model_type "ColBERT" folder)."""

    query_prefix: str = "[Q] "
    document_prefix: str = "[D] "
    query_length: int = 32
    document_length: int = 180
    query_expansion: bool = True
    attend_to_expansion_tokens: bool = False


@dataclasses.dataclass(frozen=True, eq=False)
class SentenceModel:
    """A loaded sentence-transformers folder: backbone params, tokenizer and the module chain.

    Fields:
        params: the backbone params tree (`packedenc.encode(params, ...)`).
        tokenizer: `packedenc.text.tokenizer.Tokenizer` with the folder's length limit.
        modules: what runs after the backbone: `Pooling`, `Dense`, `Normalize`, `SkipTokens`.
        folder: where it was loaded from. prompts: (name, text) pairs; default_prompt_name.
        colbert: PyLate settings for multi-vector (ColBERT) models, else None.
    """

    params: Any
    tokenizer: Any
    modules: tuple[Any, ...]
    folder: str = ""
    prompts: tuple[tuple[str, str], ...] = ()
    default_prompt_name: str | None = None
    colbert: ColbertConfig | None = None

    @property
    def multi_vector(self) -> bool:
        """True when there is no Pooling: the output is one vector per token (ColBERT)."""
        return not any(isinstance(m, Pooling) for m in self.modules)

    @property
    def device(self) -> torch.device:
        return next(t for t in tree_leaves(self.params) if isinstance(t, Tensor)).device

    @property
    def dim(self) -> int:
        """Width of the output embeddings."""
        d = self.params.config.hidden_size
        for m in self.modules:
            if isinstance(m, Pooling):
                d *= len(m.modes)
            elif isinstance(m, Dense):
                d = m.linear.weight.shape[0]
        return d

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> "SentenceModel":
        params, modules = self.params, self.modules
        if dtype is not None:
            params, modules = tree_cast(params, dtype), tree_cast(modules, dtype)
        if device is not None:
            params, modules = tree_to(params, device), tree_to(modules, device)
        return dataclasses.replace(self, params=params, modules=modules)


# ---- pure functions ---------------------------------------------------------------------------


def pool(hidden_TD: Tensor, cu_seqlens: Tensor, pooling: Pooling, prompt_length: int = 0) -> Tensor:
    """(T, D) token embeddings -> (S, D * len(modes)), sentence-transformers' Pooling.

    `prompt_length` > 0 with `include_prompt=False` leaves the first tokens of every sequence
    (the prompt) out of the mean / max / weighted means, as ST does.
    """
    T = hidden_TD.shape[0]
    x_TD, cu = hidden_TD, cu_seqlens
    weights_T = None
    if "weightedmean" in pooling.modes:  # positions + 1 within each sequence (before dropping the prompt)
        weights_T = _positions(cu, T).to(torch.float32) + 1
    if prompt_length and not pooling.include_prompt:
        keep_T = _positions(cu, T) >= prompt_length
        lengths = torch.zeros(cu.numel() - 1, dtype=torch.long, device=cu.device).index_add(
            0, segment_ids(cu, T), keep_T.long())
        cu = torch.cat([cu.new_zeros(1), torch.cumsum(lengths, 0).to(cu.dtype)])
        x_TD = hidden_TD[keep_T]
        weights_T = None if weights_T is None else weights_T[keep_T]
    out = []
    for mode in pooling.modes:
        if mode == "cls":
            # ST's cls with a prompt excluded takes the first token after the prompt.
            out.append(first_rows(x_TD, cu) if x_TD is not hidden_TD else first_rows(hidden_TD, cu_seqlens))
        elif mode == "lasttoken":
            out.append(last_rows(hidden_TD, cu_seqlens))
        elif mode == "max":
            out.append(max_rows(x_TD, cu))
        elif mode == "mean":
            out.append(mean_rows(x_TD, cu))
        elif mode == "mean_sqrt_len_tokens":
            seq = segment_ids(cu, x_TD.shape[0])
            total = torch.zeros(cu.numel() - 1, x_TD.shape[1], device=x_TD.device).index_add(0, seq, x_TD.float())
            n = (cu[1:] - cu[:-1]).to(torch.float32).clamp_min(1e-9)
            out.append((total / n.sqrt()[:, None]).to(x_TD.dtype))
        elif mode == "weightedmean":
            out.append(mean_rows(x_TD, cu, weights_T))
        else:
            raise ConfigError(f"unknown pooling mode {mode!r}; choose from {POOLING_MODES}")
    return out[0] if len(out) == 1 else torch.cat(out, dim=-1)


def _positions(cu: Tensor, total: int) -> Tensor:
    seq = segment_ids(cu, total)
    return torch.arange(total, device=cu.device) - cu[:-1].long()[seq]


def dense(x: Tensor, d: Dense) -> Tensor:
    """sentence-transformers' Dense: act(x W^T + b) (+ x, or + x R^T, with `use_residual`)."""
    y = _activation(F.linear(x, d.linear.weight, d.linear.bias), d.activation)
    if d.use_residual:
        y = y + (x if d.residual is None else F.linear(x, d.residual.weight))
    return y


def run_modules(modules: tuple[Any, ...], hidden_TD: Tensor, batch: Packed, *, prompt_length: int = 0,
                task: str = "document") -> dict[str, Tensor]:
    """Apply the module chain after the backbone. Pure: returns a new features dict with
    "token_embeddings" (T', E), "cu_seqlens" (S+1,) and, after a Pooling, "sentence_embedding" (S, E).
    `task` ("document" or "query") decides whether a ColBERT skiplist applies."""
    f: dict[str, Tensor] = {"token_embeddings": hidden_TD, "cu_seqlens": batch.cu_seqlens}
    for m in modules:
        if isinstance(m, Pooling):
            f["sentence_embedding"] = pool(f["token_embeddings"], f["cu_seqlens"], m, prompt_length)
        elif isinstance(m, Dense):
            f[m.output_name] = dense(f[m.input_name], m)
        elif isinstance(m, Normalize):
            if m.input_name in f:
                f[m.output_name] = F.normalize(f[m.input_name], p=2, dim=-1)
        elif isinstance(m, SkipTokens):
            if task in m.tasks:
                f = _skip_tokens(f, batch, m.ids)
        else:  # pragma: no cover - the loader only builds the classes above
            raise ConfigError(f"unknown module {type(m).__name__}")
    return f


def _skip_tokens(f: dict[str, Tensor], batch: Packed, ids: tuple[int, ...]) -> dict[str, Tensor]:
    if not ids:
        return f
    keep_T = ~torch.isin(batch.ids, torch.tensor(ids, device=batch.ids.device))
    cu = f["cu_seqlens"]
    seq = segment_ids(cu, keep_T.numel())
    lengths = torch.zeros(cu.numel() - 1, dtype=torch.long, device=cu.device).index_add(0, seq, keep_T.long())
    new_cu = torch.cat([cu.new_zeros(1), torch.cumsum(lengths, 0).to(cu.dtype)])
    return {**f, "token_embeddings": f["token_embeddings"][keep_T], "cu_seqlens": new_cu}


# ---- loading ----------------------------------------------------------------------------------


def _json(path: Path, kind: type = dict) -> Any:
    """A JSON file's content ({} when missing), which must be a `kind`; errors name the file."""
    try:
        data = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else kind()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from e
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e.strerror or e}") from e
    if not isinstance(data, kind):
        raise ConfigError(f"{path} must hold a JSON {'object' if kind is dict else 'list'}, got {type(data).__name__}")
    return data


def _modules(path: Path) -> list[dict[str, Any]] | None:
    """modules.json: a list of {"type", "path"} objects, or None without the file (a bare HF folder)."""
    spec = _json(path, list) if path.is_file() else None
    for m in spec or ():
        if not isinstance(m, dict) or not isinstance(m.get("path", ""), str) or ".." in Path(m.get("path", "")).parts:
            raise ConfigError(f"{path}: every module must be an object with a relative \"path\", got {m!r}")
    return spec


def _pooling(cfg: dict[str, Any]) -> Pooling:
    modes = cfg.get("pooling_mode")
    if modes is None:
        modes = [mode for key, mode in _LEGACY_POOLING_KEYS.items() if cfg.get(key)] or ["mean"]
    modes = [modes] if isinstance(modes, str) else list(modes)
    modes = [_MODE_ALIASES.get(m, m) for m in modes]
    bad = [m for m in modes if m not in POOLING_MODES]
    if bad:
        raise ConfigError(f"unsupported pooling mode(s) {bad}; packedenc supports {POOLING_MODES}")
    return Pooling(tuple(modes), bool(cfg.get("include_prompt", True)))


def _dense(folder: Path, after_pooling: bool) -> Dense:
    cfg = _json(folder / "config.json")
    if "out_features" not in cfg:
        raise CheckpointError(f"{folder}/config.json is missing or has no out_features; is this a Dense module?")
    act_name = str(cfg.get("activation_function", "torch.nn.modules.activation.Tanh")).rsplit(".", 1)[-1]
    if act_name not in _ACTIVATIONS:
        raise ConfigError(f"Dense activation {cfg.get('activation_function')!r} is not supported; "
                          f"packedenc knows {sorted(_ACTIVATIONS)}")
    sd = _read_weights(folder)
    w, b = sd.get("linear.weight"), sd.get("linear.bias")
    if w is None:
        raise CheckpointError(f"{folder} has no linear.weight tensor (keys: {sorted(sd)[:5]})")
    expected = (cfg["out_features"], cfg.get("in_features", w.shape[1]))
    if tuple(w.shape) != tuple(expected):
        raise CheckpointError(f"{folder}: linear.weight has shape {tuple(w.shape)}, config says {expected}")
    # Dense configs that predate module IO names: ST's dense models project the pooled vector,
    # PyLate's ColBERT (no Pooling before it) projects every token.
    default_in = "sentence_embedding" if after_pooling else "token_embeddings"
    inp = cfg.get("module_input_name") or default_in
    res = sd.get("residual.weight")
    return Dense(Linear(w, b if cfg.get("bias", True) else None),
                 None if res is None else Linear(res),
                 _ACTIVATIONS[act_name], bool(cfg.get("use_residual", False)), inp,
                 cfg.get("module_output_name") or inp)


def _read_weights(folder: Path) -> dict[str, Tensor]:
    st, pt = folder / "model.safetensors", folder / "pytorch_model.bin"
    if st.is_file():
        from safetensors.torch import load_file

        return load_file(str(st))
    if pt.is_file():
        try:
            return torch.load(pt, map_location="cpu", weights_only=True)
        except Exception as e:
            raise CheckpointError(f"cannot read {pt} with weights_only=True: {e}") from e
    raise CheckpointError(f"{folder} has no model.safetensors or pytorch_model.bin")


def load_sentence_transformer(path_or_repo_id: str | os.PathLike, *, device: torch.device | str | None = None,
                              dtype: torch.dtype | None = None, revision: str | None = None) -> SentenceModel:
    """Load a sentence-transformers / PyLate folder (or a bare HF model folder).

    Arguments:
        path_or_repo_id: a local folder or a hub id.
        device: where the weights are read to. dtype: cast floating weights (default: as stored).
        revision: hub branch / tag / commit.
    Return:
        `SentenceModel`. A bare HF folder (no modules.json) gets mean pooling, no normalization.
    """
    from packedenc.convert.hf import load
    from packedenc.hub import resolve
    from packedenc.text.tokenizer import tokenizer

    if not isinstance(path_or_repo_id, (str, os.PathLike)):
        raise InputTypeError("load_sentence_transformer() takes a folder or a hub id, got "
                             f"{type(path_or_repo_id).__name__}")
    root = resolve(path_or_repo_id, revision)
    spec = _modules(root / "modules.json")
    st_cfg = _json(root / "config_sentence_transformers.json")
    if spec is None:
        backbone, rest = root, []
    else:
        kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in spec]
        if not kinds or kinds[0] != "Transformer":
            raise ConfigError(f"{root}/modules.json must start with a Transformer module, got {kinds}")
        backbone, rest = root / spec[0].get("path", ""), list(zip(kinds[1:], spec[1:]))
    params = load(backbone, dtype=dtype, device=device)
    tok = tokenizer(root)
    modules: list[Any] = []
    for kind, m in rest:
        sub = root / m.get("path", "")
        if kind == "Pooling":
            modules.append(_pooling(_json(sub / "config.json")))
        elif kind == "Dense":
            modules.append(_dense(sub, any(isinstance(x, Pooling) for x in modules)))
        elif kind == "Normalize":
            c = _json(sub / "config.json")
            default = "sentence_embedding" if any(isinstance(x, Pooling) for x in modules) else "token_embeddings"
            inp = c.get("module_input_name") or default
            modules.append(Normalize(inp, c.get("module_output_name") or inp))
        elif kind == "MultiVectorMask":  # ST's ColBERT scoring mask: a document-side skiplist
            c = _json(sub / "config.json")
            tasks = c.get("skiplist_tasks") or ["document"]
            tasks = [tasks] if isinstance(tasks, str) else tasks
            modules.append(SkipTokens(_token_ids(tok, c.get("skiplist_words") or []), tuple(tasks)))
        else:
            raise ConfigError(
                f"{root}/modules.json has a {m.get('type')!r} module; packedenc supports Transformer, Pooling, "
                "Dense, Normalize and MultiVectorMask"
            )
    if spec is None:
        modules.append(Pooling(("mean",)))
    colbert = None
    if st_cfg.get("model_type") == "ColBERT" or (spec is not None and not any(isinstance(x, Pooling) for x in modules)):
        colbert = _colbert(st_cfg)
        if not any(isinstance(x, Normalize) for x in modules):  # PyLate normalizes every token inline
            skip = st_cfg.get("skiplist_words")
            words = list(string.punctuation) if skip is None else list(skip)
            modules += [SkipTokens(_token_ids(tok, words)), Normalize("token_embeddings", "token_embeddings")]
    modules_t = tuple(modules)
    if dtype is not None:
        modules_t = tree_cast(modules_t, dtype)
    if device is not None:
        modules_t = tree_to(modules_t, device)
    prompts = tuple(sorted((str(k), str(v)) for k, v in (st_cfg.get("prompts") or {}).items()))
    return SentenceModel(params, tok, modules_t, str(root), prompts, st_cfg.get("default_prompt_name"), colbert)


def _colbert(c: dict[str, Any]) -> ColbertConfig:
    d = ColbertConfig()
    return ColbertConfig(
        query_prefix=c.get("query_prefix", d.query_prefix) or "",
        document_prefix=c.get("document_prefix", d.document_prefix) or "",
        query_length=int(c.get("query_length") or d.query_length),
        document_length=int(c.get("document_length") or d.document_length),
        query_expansion=bool(c.get("do_query_expansion", True)),
        attend_to_expansion_tokens=bool(c.get("attend_to_expansion_tokens", False)),
    )


def _token_ids(tok: Any, words: list[str]) -> tuple[int, ...]:
    """Vocabulary ids of single-token words; words that are not one token are skipped, as ST does."""
    return tuple(sorted({i for i in (tok.token_id(w) for w in words) if i is not None}))
