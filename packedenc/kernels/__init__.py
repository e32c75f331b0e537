"""The op interface: one frozen table of callables that every model calls, and backend choice.

Models never import an implementation. They receive an `Ops` table (`get_ops(backend, device)`)
and call `ops.layer_norm(...)`, `ops.varlen_attention(...)`. `backend="reference"` binds every
op to `kernels/reference/` (plain torch, runs on CPU). The other backends ("triton",
"flash") register implementations for the ops they cover with `register_impl`; an op a backend
does not cover falls back to the best available choice for the device.

`backend="auto"` picks per op from what is installed and the device (CUDA: the fused Triton ops,
attention included; CPU: the reference), and logs the table once.

Partial implementations are routed in the table, never inside a kernel module. An implementation
that takes only some of an op's inputs registers a `covers` rule with it (`register_impl(...,
covers=fn)`: same arguments as the op, host values only, no device sync). The table entry then
calls it where the rule holds and the next choice for the op where it does not (the rest of the
auto order, ending with the reference if every choice is partial), and `Ops.chosen` names the
whole chain, "first>second": e.g. `graph_attention=triton>flash` on CUDA, because the Triton kernel
takes a full layer's fused fp16 / bf16 qkv buffer (`triton/attention_op.covers_graph`) and torch's
efficient kernel (flash.py) the anchor-only layer and fp32. `varlen_attention=triton` has no rule:
the Triton kernel takes every input (forward and backward), and refuses bad ones with an InputError.
A forced backend comes first and the rest follows the auto order: `backend="flash"` gives
`varlen_attention=flash>triton` (flash kernels take CUDA fp16 / bf16 with head dims that are
multiples of 8, `flash.covers_varlen`).

Adding a kernel (checklist):
1. The plain-torch version goes in `reference/ops.py` under the op's name; add the field to `Ops`.
2. The kernel file goes in `kernels/<backend>/<op>.py` (kernel, registered op, allocating wrapper
   with the reference's signature, backward where training needs it).
3. Call `register_impl("<backend>", "<op>", fn)` when that module is imported (with `covers=` if
   it takes only part of the op's inputs), and list the module in `_BACKEND_MODULES`.
4. Tests in `tests/kernels/test_<op>.py`: against the reference over dtypes and ragged packs,
   isolation, determinism; the CPU run uses TRITON_INTERPRET=1 on tiny shapes.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
from typing import Callable

import torch

from packedenc.errors import ConfigError
from packedenc.kernels import reference

__all__ = ["Ops", "get_ops", "register_impl", "chain", "BACKENDS", "available_backends"]

log = logging.getLogger("packedenc")

BACKENDS = ("auto", "reference", "triton", "flash")

# Modules that register implementations when imported; a missing dependency just means the
# backend is not available (its import fails and is recorded, never raised at import time).
_BACKEND_MODULES = {
    "triton": ("packedenc.kernels.triton",),
    "flash": ("packedenc.kernels.flash",),
}

# Per-op preference when backend="auto" on a CUDA device (first available wins).
_AUTO_CUDA = {
    "varlen_attention": ("triton", "flash"),  # kernels/triton/attention*.py: forward and backward
    "graph_attention": ("triton", "flash"),  # triton covers fused fp16/bf16 full layers; flash the rest
    "deberta_attention": ("triton",),  # packed disentangled attention (kernels/triton/deberta/)
}
_AUTO_CUDA_DEFAULT = ("triton",)


@dataclasses.dataclass(frozen=True)
class Ops:
    """The table of ops a model may call. Field names are the reference function names."""

    backend: str
    chosen: tuple[tuple[str, str], ...]  # (op, backend or "a>b" routing chain) for each op, for logs and `info`
    linear: Callable
    layer_norm: Callable
    add_layer_norm: Callable
    embed_layer_norm: Callable
    activation: Callable
    glu: Callable
    rotary: Callable
    varlen_attention: Callable
    deberta_attention: Callable  # disentangled (content + c2p + p2c) attention, DeBERTa-v2/v3
    varlen_conv1d: Callable  # conv along each packed sequence (DeBERTa-v2-xlarge ConvLayer)
    graph_attention: Callable  # varlen attention, own query/key boundaries + per-key head bias (graph)
    graph_readout: Callable  # anchor + softmax-weighted neighbours per packed sequence (graph readout)
    linear_cross_entropy: Callable  # per-row CE of x @ W^T + b (MLM decoder + loss; kernels keep no logits)


OP_NAMES = tuple(f.name for f in dataclasses.fields(Ops) if f.name not in ("backend", "chosen"))

_IMPLS: dict[str, dict[str, Callable]] = {"reference": {n: getattr(reference, n) for n in OP_NAMES}}
_COVERS: dict[tuple[str, str], Callable[..., bool]] = {}  # (backend, op) -> the inputs a partial impl takes
_ROUTES: dict[tuple[str, str], Callable] = {}  # (op, "a>b") -> the routed entry, built by _choose_all
_IMPORT_ERRORS: dict[str, str] = {}


def register_impl(backend: str, op: str, fn: Callable, covers: Callable[..., bool] | None = None) -> None:
    """Make `fn` the `backend` implementation of `op` (called by kernel modules at import).

    `covers`: for an implementation that takes only part of the op's inputs, a rule with the op's
    arguments that returns True for the calls `fn` takes (host values only: dtypes, shapes,
    None-ness, never a device sync). The table sends every other call to the next choice.
    """
    if op not in OP_NAMES:
        raise ValueError(f"unknown op {op!r}; add it to Ops and kernels/reference/ops.py first")
    _IMPLS.setdefault(backend, {})[op] = fn
    if covers is None:
        _COVERS.pop((backend, op), None)
    else:
        _COVERS[(backend, op)] = covers


def chain(op: str, candidates: tuple[str, ...] | list[str]) -> str:
    """The implementations that serve `op`, joined by ">": the first candidate with an `op`
    implementation, then, while the last one has a `covers` rule, the next one (the reference when
    the candidates run out)."""
    picked: list[str] = []
    for b in (*candidates, "reference"):
        if b in picked or op not in _IMPLS.get(b, {}):
            continue
        picked.append(b)
        if (b, op) not in _COVERS:
            break
    return ">".join(picked)


def _route(first: Callable, covers: Callable[..., bool], rest: Callable) -> Callable:
    def routed(*args, **kwargs):
        return first(*args, **kwargs) if covers(*args, **kwargs) else rest(*args, **kwargs)

    return routed


def _entry(op: str, name: str) -> Callable:
    """The table's callable for `op` served by `name` (one backend, or a chain "a>b>...")."""
    if ">" not in name:
        return _IMPLS[name][op]
    if (op, name) not in _ROUTES:
        first, rest = name.split(">", 1)
        _ROUTES[(op, name)] = _route(_IMPLS[first][op], _COVERS[(first, op)], _entry(op, rest))
    return _ROUTES[(op, name)]


@functools.lru_cache(maxsize=None)
def _load_backend(backend: str) -> bool:
    if backend == "reference":
        return True
    ok = True
    for mod in _BACKEND_MODULES.get(backend, ()):
        try:
            importlib.import_module(mod)
        except Exception as e:  # an optional dependency is missing or has no driver
            _IMPORT_ERRORS[backend] = f"{type(e).__name__}: {e}"
            ok = False
    return ok and bool(_IMPLS.get(backend))


def available_backends(device: torch.device | str = "cuda") -> list[str]:
    dev = torch.device(device)
    names = ["reference"]
    if dev.type == "cuda" and torch.cuda.is_available():
        names += [b for b in ("triton", "flash") if _load_backend(b)]
    return names


def _choose(op: str, backend: str, device: torch.device) -> str:
    if device.type != "cuda" or backend == "reference":
        return "reference"
    avail = available_backends(device)
    prefs = _AUTO_CUDA.get(op, _AUTO_CUDA_DEFAULT)
    if backend != "auto":  # a forced backend first; the inputs it does not cover follow the auto order
        prefs = (backend, *prefs)
    return chain(op, [b for b in prefs if b in avail])


_CHOSEN: dict[tuple[str, str], tuple[tuple[str, str], ...]] = {}


# torch.compile: dynamo cannot trace the imports that load a backend, and would trace through an
# lru_cache. `assume_constant_result` makes it run this eagerly at trace time and keep the
# result, plain strings, as a constant; `get_ops` then only reads module-level dicts.
@torch.compiler.assume_constant_result
def _choose_all(backend: str, device_type: str) -> tuple[tuple[str, str], ...]:
    """(op, backend or "a>b" chain) for every op; computed (and logged, on CUDA) once per key."""
    key = (backend, device_type)
    if key in _CHOSEN:
        return _CHOSEN[key]
    device = torch.device(device_type)
    if backend not in ("auto", "reference") and device.type != "cuda":  # never a silent reference run
        raise ConfigError(f"backend={backend!r} runs on CUDA tensors, but these are on {device_type}; use "
                          "backend='auto' (the reference on the CPU) or 'reference', or move the inputs to a GPU")
    if backend not in ("auto", "reference") and device.type == "cuda" and not _load_backend(backend):
        why = _IMPORT_ERRORS.get(backend, "it registers no op")
        raise ConfigError(f"backend {backend!r} is not available on this machine ({why})")
    chosen = tuple((op, _choose(op, backend, device)) for op in OP_NAMES)
    for op, name in chosen:
        _entry(op, name)  # routed entries are built here, outside any trace
    _CHOSEN[key] = chosen
    if device.type == "cuda":
        log.info("packedenc backend=%s on %s: %s", backend, device_type,
                 ", ".join(f"{op}={b}" for op, b in chosen))
    return chosen


def get_ops(backend: str | Ops = "auto", device: torch.device | str | None = None) -> Ops:
    """The op table for `backend` on `device` (a ready `Ops` is passed through unchanged).

    Safe inside `torch.compile(fullgraph=True)`, also on the first call.
    """
    if isinstance(backend, Ops):
        return backend
    if backend not in BACKENDS:
        raise ConfigError(f"unknown backend {backend!r}; choose one of {BACKENDS}")
    dev = torch.device("cpu" if device is None else device)
    chosen = _choose_all(backend, dev.type)
    return Ops(backend=backend, chosen=chosen, **{op: _entry(op, b) for op, b in chosen})
