"""The op interface: one frozen table of callables that every model calls, and backend choice.

Models never import an implementation. They receive an `Ops` table (`get_ops(backend, device)`)
and call `ops.layer_norm(...)`, `ops.varlen_attention(...)`. `backend="reference"` binds every
op to `kernels/reference/` (plain torch, runs on CPU). The other backends ("triton",
"flash") register implementations for the ops they cover with `register_impl`; an op a backend
does not cover falls back to the best available choice for the device.

`backend="auto"` picks per op and shape class from measurements: `kernels/auto.py`'s table names,
for each op, the implementations in order and the committed benchmark record behind each row; what
is installed and the device only gate it (CPU: the reference). The table is logged once, and
`describe_ops(backend, device)` prints it with the reasons. Optional backends are imported only
when a chosen row or a forced backend needs them.

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
multiples of 8, `flash.covers_varlen`), `backend="cute"` `varlen_attention=cute>triton` (FA4 takes
fp16 / bf16 head dims 64 and 128 on sm90+, `cute/attention.covers_fa4`). An auto row with a shape
class is named with it, "cute[long-global]>cute[large-global]>triton": each takes the calls its
backend covers AND its shape rule accepts (two rows of one backend: two shape classes, each with
its own measurement).

Composite ops are two ops in a row that a kernel may fuse: `rotary_attention` is
`varlen_attention(*rotary(qkv, ...))`, `linear_glu` is `glu(linear(x, W, b))`,
`layer_norm_linear_glu` is `linear_glu(layer_norm(x), W, b)`, `layer_norm_linear` is
`linear(layer_norm(x), W, b)`. Their chain ends with the parts instead of the reference,
named "rotary+varlen_attention": the calls no fused implementation takes run the table's own
entries of the two parts (whatever serves them), so fusing never changes who serves the rest.

Adding a kernel (checklist):
1. The plain-torch version goes in `reference/ops.py` under the op's name; add the field to `Ops`.
2. The kernel file goes in `kernels/<backend>/<op>.py` (kernel, registered op, allocating wrapper
   with the reference's signature, backward where training needs it).
3. Call `register_impl("<backend>", "<op>", fn)` when that module is imported (with `covers=` if
   it takes only part of the op's inputs), and list the module in `_BACKEND_MODULES`. "auto"
   chooses it only once a row in `auto.py` cites the record that shows it wins.
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
from packedenc.kernels import auto, reference

__all__ = ["Ops", "get_ops", "register_impl", "chain", "choose", "describe_ops", "BACKENDS", "available_backends",
           "unfused", "PARTS"]

log = logging.getLogger("packedenc")

BACKENDS = ("auto", "reference", "triton", "flash", "cute")

# Modules that register implementations when imported; a missing dependency just means the
# backend is not available (its import fails and is recorded, never raised at import time).
_BACKEND_MODULES = {
    "triton": ("packedenc.kernels.triton",),
    "flash": ("packedenc.kernels.flash",),
    "cute": ("packedenc.kernels.cute.backend",),
}
# What to install for an optional backend (named in the ConfigError when it does not load).
_EXTRAS = {"cute": "pip install 'packedenc[cute]' (nvidia-cutlass-dsl, flash-attn-4, quack-kernels, apache-tvm-ffi; an sm90+ GPU)"}


@dataclasses.dataclass(frozen=True)
class Ops:
    """The table of ops a model may call. Field names are the reference function names."""

    backend: str
    chosen: tuple[tuple[str, str], ...]  # (op, backend or "a>b" routing chain) for each op, for logs and `info`
    linear: Callable
    linear_add: Callable  # residual + linear(x, W, b) in one GEMM (cuBLAS's beta = 1 epilogue)
    layer_norm: Callable
    add_layer_norm: Callable
    embed_layer_norm: Callable
    activation: Callable
    glu: Callable
    linear_glu: Callable  # glu(linear(x, W, b)): a gated MLP's input projection (ModernBERT's Wi + GeGLU)
    rotary: Callable
    varlen_attention: Callable
    deberta_attention: Callable  # disentangled (content + c2p + p2c) attention, DeBERTa-v2/v3
    varlen_conv1d: Callable  # conv along each packed sequence (DeBERTa-v2-xlarge ConvLayer)
    graph_attention: Callable  # varlen attention, own query/key boundaries + per-key head bias (graph)
    graph_readout: Callable  # anchor + softmax-weighted neighbours per packed sequence (graph readout)
    linear_cross_entropy: Callable  # per-row CE of x @ W^T + b (MLM decoder + loss; kernels keep no logits)
    rotary_attention: Callable  # varlen_attention(*rotary(qkv, ...)): RoPE read inside the attention where fused
    # linear_glu(layer_norm(x), W, b): the norm read inside the gated GEMM where fused (after linear_glu:
    # a composite of a composite is built from the parts' finished entries)
    layer_norm_linear_glu: Callable
    layer_norm_linear: Callable  # linear(layer_norm(x), W, b): the norm read inside the GEMM where fused (Wqkv)


OP_NAMES = tuple(f.name for f in dataclasses.fields(Ops) if f.name not in ("backend", "chosen"))
# Composite op -> (its parts, how the parts' entries make it): the end of its chain (see the docstring).
PARTS: dict[str, tuple[tuple[str, ...], Callable[..., Callable]]] = {
    "rotary_attention": (("rotary", "varlen_attention"), reference.compose_rotary_attention),
    "linear_glu": (("linear", "glu"), reference.compose_linear_glu),
    "layer_norm_linear_glu": (("layer_norm", "linear_glu"), reference.compose_layer_norm_linear_glu),
    "layer_norm_linear": (("layer_norm", "linear"), reference.compose_layer_norm_linear),
}

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


def _backend_of(name: str) -> str:
    return name.split("[", 1)[0]  # "cute[long-global]" -> "cute"


def _rules(op: str, name: str) -> tuple[Callable[..., bool], ...]:
    """The calls `name` takes: its shape class (auto.SHAPES) AND its backend's `covers` rule, in that
    order: the shape class, a host-int comparison, turns most short, host-bound calls away before
    the backend's own dozen checks (dtypes, devices, capability). So a shape class takes any of the
    op's arguments, inside a torch.compile trace too; () when the row takes every call."""
    backend = _backend_of(name)
    shape = auto.SHAPES[name[len(backend) + 1 : -1]] if name != backend else None
    return tuple(r for r in (shape, _COVERS.get((backend, op))) if r is not None)


def chain(op: str, candidates: tuple[str, ...] | list[str], usable: Callable[[str], bool] = lambda b: True) -> str:
    """The implementations that serve `op`, joined by ">": the first candidate whose backend is
    `usable` and has an `op` implementation, then, while the last one takes only some calls (a
    `covers` rule or a shape class), the next one (the reference when the candidates run out).
    A candidate is a backend name or a shaped auto row, "backend[shape]"; `usable` is asked only
    about the backends that are reached."""
    picked: list[str] = []
    last = _parts_name(op) if op in PARTS else "reference"
    for name in (*candidates, last):
        b = _backend_of(name)
        if name == last:
            picked.append(name)
            break
        # a backend once, unless as rows of different shape classes ("cute[long-global]>cute[large-global]")
        if name in picked or b in picked or (b != "reference" and not usable(b)) or op not in _IMPLS.get(b, {}):
            continue
        picked.append(name)
        if not _rules(op, name):
            break
    return ">".join(picked)


def _parts_name(op: str) -> str:
    return "+".join(PARTS[op][0])  # "rotary+varlen_attention"


def _route(first: Callable, rules: tuple[Callable[..., bool], ...], rest: Callable) -> Callable:
    if len(rules) == 1:  # one closure level fewer: the eager host path of every routed op
        (rule,) = rules

        def routed(*args, **kwargs):
            return first(*args, **kwargs) if rule(*args, **kwargs) else rest(*args, **kwargs)
    else:
        shape, covers = rules

        def routed(*args, **kwargs):
            if shape(*args, **kwargs) and covers(*args, **kwargs):
                return first(*args, **kwargs)
            return rest(*args, **kwargs)

    return routed


def _entry(op: str, name: str, parts: Callable | None = None) -> Callable:
    """The table's callable for `op` served by `name` (one backend, or a chain "a>b[shape]>...");
    `parts`: a composite op's parts in a row (its chain's last link), built from the same table."""
    if op in PARTS:  # per table (the parts differ between tables): built by _choose_all, not cached here
        first, _, rest = name.partition(">")
        if not rest:
            return parts if first == _parts_name(op) else _IMPLS[first][op]
        return _route(_IMPLS[_backend_of(first)][op], _rules(op, first), _entry(op, rest, parts))
    if ">" not in name:
        return _IMPLS[name][op]
    if (op, name) not in _ROUTES:
        first, rest = name.split(">", 1)
        _ROUTES[(op, name)] = _route(_IMPLS[_backend_of(first)][op], _rules(op, first), _entry(op, rest))
    return _ROUTES[(op, name)]


def _entries(chosen: tuple[tuple[str, str], ...]) -> dict[str, Callable]:
    """op -> callable for one table: plain ops first, then the composites from their parts' entries."""
    out = {op: _entry(op, name) for op, name in chosen if op not in PARTS}
    for op, name in chosen:
        if op in PARTS:
            names, compose = PARTS[op]
            out[op] = _entry(op, name, compose(*(out[p] for p in names)))
    return out


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


def _usable_on_cuda(backend: str) -> bool:
    return backend == "reference" or (torch.cuda.is_available() and _load_backend(backend))


def available_backends(device: torch.device | str = "cuda") -> list[str]:
    """The backends that load here for `device` (imports every optional one: for `info`, not hot paths)."""
    dev = torch.device(device)
    names = ["reference"]
    if dev.type == "cuda":
        names += [b for b in _BACKEND_MODULES if _usable_on_cuda(b)]
    return names


def choose(op: str, backend: str = "auto", device_type: str = "cuda",
           usable: Callable[[str], bool] | None = None) -> str:
    """The implementation chain that serves `op` (what `Ops.chosen` shows), from `auto.py`'s table.

    "auto" takes the rows that cite a record (or are fallbacks), in order; a forced backend comes
    first and the same rows follow for the calls it does not take. `usable(backend)` says which
    backends load here (default: import them, on a machine with CUDA); pass a set's `__contains__`
    to ask what the table gives elsewhere. CPU devices and `backend="reference"`: the reference.
    """
    if device_type != "cuda" or backend == "reference":
        return _parts_name(op) if op in PARTS else "reference"
    names = [row.name for row in auto.rows(op) if row.chosen]
    if backend != "auto":
        names.insert(0, backend)
    return chain(op, names, usable or _usable_on_cuda)


_CHOSEN: dict[tuple[str, str], tuple[tuple[str, str], ...]] = {}
_TABLES: dict[tuple[str, str], dict[str, Callable]] = {}  # (backend, device type) -> op -> callable


# torch.compile: dynamo cannot trace the imports that load a backend, and would trace through an
# lru_cache. `torch.compiler.assume_constant_result` makes it run this eagerly at trace time and
# keep the result, plain strings, as a constant; `get_ops` then only reads module-level dicts. The
# decorator only sets this attribute, but calling it imports torch._dynamo: a second added to
# every `import packedenc` (tests check that torch's decorator still sets just this).
_CONSTANT_MARK = "_dynamo_marked_constant"


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
        fix = f"; install it with {_EXTRAS[backend]}" if backend in _EXTRAS else ""
        raise ConfigError(f"backend {backend!r} is not available on this machine ({why}){fix}")
    chosen = tuple((op, choose(op, backend, device.type)) for op in OP_NAMES)
    _TABLES[key] = _entries(chosen)  # routed entries are built here, outside any trace
    _CHOSEN[key] = chosen
    if device.type == "cuda":
        log.info("packedenc backend=%s on %s: %s", backend, device_type,
                 ", ".join(f"{op}={b}" for op, b in chosen))
    return chosen


setattr(_choose_all, _CONSTANT_MARK, True)


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
    return Ops(backend=backend, chosen=chosen, **_TABLES[(backend, dev.type)])


def unfused(ops: Ops, op: str) -> Ops:
    """`ops` with the composite `op` run as its parts from the same table, never fused (benchmarks
    time what a fused kernel replaces this way)."""
    names, compose = PARTS[op]
    chosen = tuple((o, _parts_name(op) if o == op else b) for o, b in ops.chosen)
    return dataclasses.replace(ops, chosen=chosen, **{op: compose(*(getattr(ops, p) for p in names))})


def _why(op: str, name: str, backend: str, chained: str) -> str:
    """Why `name` (one link of a chain) serves `op`: the evidence of its auto row, or what forced it."""
    if name == backend:
        return "forced (backend=%r)" % backend
    if name == "reference":
        return "plain torch" if name == chained else "plain torch, for the calls the others do not take"
    if op in PARTS and name == _parts_name(op):
        how = " then ".join(PARTS[op][0])
        return f"{how}, as the table serves them" + ("" if name == chained else ", for the calls the others do not take")
    row = next((r for r in auto.rows(op) if r.name == name), None)
    if row is None:
        return ""
    return str(row.evidence) if row.evidence is not None else "fallback: replaces only the reference"


def describe_ops(backend: str = "auto", device: torch.device | str = "cuda") -> str:
    """The implementation of every op for `backend` on `device`, why it was chosen, and the rows
    of `auto.py` that were not (for `packedenc info --ops`). Imports every optional backend."""
    dev = torch.device(device)
    chosen = get_ops(backend, dev).chosen
    head = f"packedenc ops, backend={backend!r} on {dev.type}"
    if dev.type == "cuda" and not torch.cuda.is_available():
        head += " (no CUDA device here: every op runs the reference)"
    table = [("op", "implementation", "why")]
    for op, name in chosen:
        parts = name.split(">")
        table.append((op, name, "; ".join(filter(None, (_why(op, p, backend, name) for p in parts)))))
        for row in auto.rows(op) if dev.type == "cuda" else ():
            if not row.chosen:
                table.append(("", f"(not {row.name})", row.why_not))
    widths = [max(len(r[i]) for r in table) for i in range(2)]
    lines = [head, *(f"{a:<{widths[0]}}  {b:<{widths[1]}}  {c}".rstrip() for a, b, c in table)]
    if dev.type == "cuda":
        loaded = available_backends(dev)
        missing = [f"{b} ({_IMPORT_ERRORS.get(b, 'no CUDA device')}"
                   + (f"; {_EXTRAS[b]})" if b in _EXTRAS else ")") for b in _BACKEND_MODULES if b not in loaded]
        lines.append("backends that load here: " + ", ".join(loaded))
        lines += [f"not available: {m}" for m in missing]
    return "\n".join(lines)
