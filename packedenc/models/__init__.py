"""Model families. Each module owns its config, params tree, `params_spec`, `init`, `encode` and heads.

`family_for_model_type("modernbert")` returns the module; `family_of(params)` does the same from a
params tree, which is how `packedenc.encode(params, ...)` dispatches.

Adding a model (checklist):
1. `models/<family>.py`: a frozen `<Name>Config` with `from_hf`/`to_hf` (raise `ConfigError` on
   anything the math does not honour), `@pytree_dataclass` params with HF-named fields,
   `params_spec(cfg)`, `init(cfg, generator)`, `encode(params, ids, cu_seqlens, ...)`, heads.
2. `convert/hf_<family>.py`: the key map (HF key <-> params leaf path) and per-key transforms.
3. Register the family in `_FAMILIES` below (model_type -> module, params class).
4. `tests/models/test_<family>_vs_hf.py`: tiny random HF model, save_pretrained, load, compare.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import Any

from packedenc.errors import ConfigError

# model_type in config.json -> module under packedenc.models
_FAMILIES: dict[str, str] = {
    "modernbert": "modernbert",
    "deberta-v2": "deberta",
    "bert": "bert",
    "roberta": "bert",
    "xlm-roberta": "bert",
    "graph_transformer": "graph_transformer",
}

# module name -> name of its params class (for dispatch on a params tree)
_PARAMS_CLASSES: dict[str, str] = {
    "modernbert": "ModernBertParams",
    "deberta": "DebertaParams",
    "bert": "BertParams",
    "graph_transformer": "GraphTransformerParams",
}


def register_family(model_types: tuple[str, ...], module: str, params_class: str) -> None:
    for t in model_types:
        _FAMILIES[t] = module
    _PARAMS_CLASSES[module] = params_class


def family_for_model_type(model_type: str | None) -> ModuleType:
    if model_type not in _FAMILIES:
        raise ConfigError(
            f"unsupported model_type {model_type!r}; packedenc supports {sorted(_FAMILIES)}"
        )
    return importlib.import_module(f"packedenc.models.{_FAMILIES[model_type]}")


def _module(name: str) -> ModuleType:
    # sys.modules first: torch.compile (dynamo) traces a dict lookup but not import_module.
    mod = sys.modules.get(f"packedenc.models.{name}")
    return importlib.import_module(f"packedenc.models.{name}") if mod is None else mod


def family_of(params: Any) -> ModuleType:
    # the class name first: only the matching family's module is imported (a BERT encode, the
    # first of a process, would otherwise pay for importing the DeBERTa package)
    for module, cls_name in _PARAMS_CLASSES.items():
        if type(params).__name__ == cls_name:
            mod = _module(module)
            if isinstance(params, getattr(mod, cls_name)):
                return mod
    raise ConfigError(
        f"{type(params).__name__} is not a packedenc params tree; get one from packedenc.load(...)"
    )


def encode(params: Any, *args: Any, **kwargs: Any) -> Any:
    """Run the encoder of whatever family `params` belongs to. Pure: no state, no mutation.

    For token models (ModernBERT, DeBERTa, BERT):
        encode(params, ids, cu_seqlens, max_seqlen=None, positions=None, *, backend="auto", validate=False)
        ids: (T,) int, cu_seqlens: (S+1,) int32, max_seqlen: host int -> hidden states (T, D).
    For the graph transformer (GiGL's GraphTransformerEncoder):
        encode(params, x, cu_seqlens, max_seqlen=None, *, hops=None, node_types=None, key_features=None,
               return_tokens=False, ...) -> one embedding per sequence (S, out_dim), anchor first.
    See the family module's `encode` (packedenc.models.<family>.encode) for the extras it takes.
    """
    return family_of(params).encode(params, *args, **kwargs)


def max_seqlen_limit(params: Any) -> int | None:
    """The longest sequence a params tree's position table takes (None: no table, no limit).
    Families with absolute positions define `max_seqlen_limit(params)`; the others have none."""
    fn = getattr(family_of(params), "max_seqlen_limit", None)
    return None if fn is None else fn(params)


def init(config: Any, generator: Any = None, **kwargs: Any) -> Any:
    """Random params for a config object of any family (for tests, benchmarks, training from scratch)."""
    return family_for_model_type(config.to_hf()["model_type"]).init(config, generator, **kwargs)
