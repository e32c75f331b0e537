"""The op interface: one frozen table of callables that every model calls, and backend choice.

Models never import an implementation. They receive an `Ops` table (`get_ops(backend, device)`)
and call `ops.layer_norm(...)`, `ops.varlen_attention(...)`. `backend="reference"` binds every
op to `kernels/reference.py` (plain torch, runs on CPU). The other backends ("triton", "flash",
"cute") register implementations for the ops they cover with `register_impl`; an op a backend
does not cover falls back to the best available choice for the device.

`backend="auto"` picks per op from what is installed and the device (CUDA: the fused Triton ops
and torch's flash varlen attention; CPU: the reference), and logs the table once.

Adding a kernel (checklist):
1. The plain-torch version goes in `reference.py` under the op's name; add the field to `Ops`.
2. The kernel file goes in `kernels/<backend>/<op>.py` (kernel, registered op, allocating wrapper
   with the reference's signature, backward where training needs it).
3. Call `register_impl("<backend>", "<op>", fn)` when that module is imported, and list the
   module in `_BACKEND_MODULES`.
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

__all__ = ["Ops", "get_ops", "register_impl", "BACKENDS", "available_backends"]

log = logging.getLogger("packedenc")

BACKENDS = ("auto", "reference", "triton", "flash", "cute")

# Modules that register implementations when imported; a missing dependency just means the
# backend is not available (its import fails and is recorded, never raised at import time).
_BACKEND_MODULES = {
    "triton": ("packedenc.kernels.triton",),
    "flash": ("packedenc.kernels.flash", "packedenc.kernels.graph_attention"),
    "cute": ("packedenc.kernels.cute",),
}

# Per-op preference when backend="auto" on a CUDA device (first available wins).
_AUTO_CUDA = {
    # the Triton forward kernel first: it hands gradients (and what it did not win) to flash
    "varlen_attention": ("triton", "flash"),
    "graph_attention": ("flash",),
    "deberta_attention": ("triton",),  # packed disentangled attention (kernels/triton/deberta_attention.py)
}
_AUTO_CUDA_DEFAULT = ("triton",)


@dataclasses.dataclass(frozen=True)
class Ops:
    """The table of ops a model may call. Field names are the reference function names."""

    backend: str
    chosen: tuple[tuple[str, str], ...]  # (op, backend) for each op, for logs and `info`
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
_IMPORT_ERRORS: dict[str, str] = {}


def register_impl(backend: str, op: str, fn: Callable) -> None:
    """Make `fn` the `backend` implementation of `op` (called by kernel modules at import)."""
    if op not in OP_NAMES:
        raise ValueError(f"unknown op {op!r}; add it to Ops and reference.py first")
    _IMPLS.setdefault(backend, {})[op] = fn


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
        names += [b for b in ("triton", "flash", "cute") if _load_backend(b)]
    return names


def _choose(op: str, backend: str, device: torch.device) -> str:
    if device.type != "cuda" or backend == "reference":
        return "reference"
    avail = available_backends(device)
    if backend != "auto" and op in _IMPLS.get(backend, {}):
        return backend
    for b in _AUTO_CUDA.get(op, _AUTO_CUDA_DEFAULT):
        if b in avail and op in _IMPLS.get(b, {}):
            return b
    return "reference"


_CHOSEN: dict[tuple[str, str], tuple[tuple[str, str], ...]] = {}


# torch.compile: dynamo cannot trace the imports that load a backend, and would trace through an
# lru_cache. `assume_constant_result` makes it run this eagerly at trace time and keep the
# result, plain strings, as a constant; `get_ops` then only reads module-level dicts.
@torch.compiler.assume_constant_result
def _choose_all(backend: str, device_type: str) -> tuple[tuple[str, str], ...]:
    """(op, backend) for every op; computed (and logged, on CUDA) once per key."""
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
    return Ops(backend=backend, chosen=chosen, **{op: _IMPLS[b][op] for op, b in chosen})
