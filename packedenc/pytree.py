"""Params containers as torch pytree nodes, plus the small tree utilities the library needs.

A params tree is made of frozen dataclasses decorated with `@pytree_dataclass`. Tensor-valued
fields (and nested containers, lists, tuples) are pytree children; fields declared with
`static()` (the model config, flags) travel in the node's flatten *context*, so
`tree_map(fn, params)` and `torch.func.grad` see only tensors and hand back a tree that still
carries the config.

Two details of `torch.utils._pytree` shape this file:
- torch counts a bare `None` as a leaf (JAX counts it as an empty subtree). Optional pieces are
  `None`, so the flatten function leaves `None` fields out of the children and records their
  names in the context; `tree_map(lambda t: t.to(torch.bfloat16), params)` never sees a `None`.
- `register_dataclass` has no notion of a static field (its `drop_field_names` drops the value),
  so nodes are registered with `register_pytree_node` and an explicit context.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator

import torch
import torch.utils._pytree as pytree
from torch import Tensor

__all__ = [
    "pytree_dataclass",
    "static",
    "Linear",
    "Norm",
    "Embedding",
    "ParamSpec",
    "tree_map",
    "tree_leaves",
    "named_leaves",
    "tree_cast",
    "tree_to",
    "num_params",
]

_STATIC = "packedenc_static"


def static(default: Any = dataclasses.MISSING) -> Any:
    """Declare a dataclass field as static metadata (carried in the pytree context, not a leaf)."""
    if default is dataclasses.MISSING:
        return dataclasses.field(metadata={_STATIC: True})
    return dataclasses.field(default=default, metadata={_STATIC: True})


def pytree_dataclass(cls: type) -> type:
    """`dataclass(frozen=True, slots=True)` + registration as a torch pytree node."""
    cls = dataclasses.dataclass(frozen=True, slots=True)(cls)
    fields = dataclasses.fields(cls)
    child_names = tuple(f.name for f in fields if not f.metadata.get(_STATIC))
    static_names = tuple(f.name for f in fields if f.metadata.get(_STATIC))

    def flatten(node: Any) -> tuple[list[Any], Any]:
        present = tuple(n for n in child_names if getattr(node, n) is not None)
        statics = tuple(getattr(node, n) for n in static_names)
        return [getattr(node, n) for n in present], (present, statics)

    def flatten_with_keys(node: Any) -> tuple[list[tuple[Any, Any]], Any]:
        children, ctx = flatten(node)
        return [(pytree.GetAttrKey(n), c) for n, c in zip(ctx[0], children)], ctx

    def unflatten(children: Any, ctx: Any) -> Any:
        present, statics = ctx
        kwargs = dict.fromkeys(child_names)
        kwargs.update(zip(present, children))
        kwargs.update(zip(static_names, statics))
        return cls(**kwargs)

    pytree.register_pytree_node(
        cls,
        flatten,
        unflatten,
        serialized_type_name=f"{cls.__module__}.{cls.__qualname__}",
        flatten_with_keys_fn=flatten_with_keys,
    )
    return cls


# ---- leaf containers shared by every family -------------------------------------------------


@pytree_dataclass
class Linear:
    weight: Tensor  # (out, in), HF orientation: loading does not transpose or copy
    bias: Tensor | None = None  # (out,)


@pytree_dataclass
class Norm:
    weight: Tensor  # (D,)
    bias: Tensor | None = None  # (D,); None when the checkpoint has no norm bias


@pytree_dataclass
class Embedding:
    weight: Tensor  # (V, D)


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """Abstract leaf of a `params_spec(cfg)` tree: what `init` creates and `load` expects."""

    shape: tuple[int, ...]
    init: str = "normal"  # "normal" (std from config), "zeros", "ones"


# ---- tree utilities -------------------------------------------------------------------------

tree_map = pytree.tree_map
tree_leaves = pytree.tree_leaves


def _path_str(path: tuple[Any, ...]) -> str:
    parts = []
    for k in path:
        if isinstance(k, pytree.GetAttrKey):
            parts.append(k.name)
        elif isinstance(k, pytree.SequenceKey):
            parts.append(str(k.idx))
        elif isinstance(k, pytree.MappingKey):
            parts.append(str(k.key))
        else:  # pragma: no cover - other key kinds are not used in params trees
            parts.append(str(k))
    return ".".join(parts)


def named_leaves(tree: Any) -> Iterator[tuple[str, Any]]:
    """Yield ("layers.3.attn.wqkv.weight", leaf) for every leaf, in flatten order."""
    flat, _ = pytree.tree_flatten_with_path(tree)
    for path, leaf in flat:
        yield _path_str(path), leaf


def tree_cast(tree: Any, dtype: torch.dtype) -> Any:
    """Cast floating-point leaves to `dtype` (integer buffers, if any, are left alone)."""
    return pytree.tree_map_only(
        Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, tree
    )


def tree_to(tree: Any, device: torch.device | str) -> Any:
    return pytree.tree_map_only(Tensor, lambda t: t.to(device), tree)


def tree_map_specs(fn: Callable[[str, ParamSpec], Any], spec_tree: Any) -> Any:
    """Map over a spec tree's `ParamSpec` leaves with their dotted names; returns a params tree."""
    flat, treedef = pytree.tree_flatten_with_path(spec_tree)
    return pytree.tree_unflatten([fn(_path_str(p), s) for p, s in flat], treedef)


def num_params(tree: Any) -> int:
    return sum(t.numel() for t in tree_leaves(tree) if isinstance(t, Tensor))
