"""What the cute family's parts share (benchmarks/cute.py, benchmarks/cute_norms.py): shapes, timing, the printed line.

Shapes: ModernBERT-base's MLP at 64k tokens: T64K rows, D hidden, FM mlp width.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from benchmarks import attention as A
from benchmarks import common

BF16 = torch.bfloat16
T64K, D, FM = 65536, 768, 1152


def cute_error() -> str | None:
    from packedenc import kernels

    return None if kernels._load_backend("cute") else kernels._IMPORT_ERRORS.get("cute", "not registered")


def auto_without_cute() -> Any:
    """The op table `auto` builds on a CUDA machine without the cute extra (the same rows, cute
    unusable): what the cute rows replace, as a system beside `auto` in one process."""
    from packedenc import kernels

    return _table({op: kernels.choose(op, "auto", "cuda", lambda b: b != "cute" and kernels._usable_on_cuda(b))
                   for op in kernels.OP_NAMES})


def auto_with_candidate(op: str, shape: str) -> Any:
    """The op table `auto` builds here, with `op`'s listed but unchosen row of shape class `shape`
    taken in its place in the order: how a candidate row is measured beside `auto` before a record
    makes it a chosen row (system name `packedenc[auto,<shape>]`)."""
    from packedenc import kernels
    from packedenc.kernels import auto

    rows = auto.rows(op)
    if not any(r.shape == shape and not r.chosen for r in rows):
        raise ValueError(f"{op} has no unchosen row of shape class {shape!r}: {[r.name for r in rows]}")
    names = [r.name for r in rows if r.chosen or r.shape == shape]
    return _table({o: kernels.chain(o, names, kernels._usable_on_cuda) if o == op else kernels.choose(o, "auto", "cuda")
                   for o in kernels.OP_NAMES})


def _table(chains: dict[str, str]) -> Any:
    """An `auto` op table from each op's implementation chain."""
    from packedenc import kernels

    chosen = tuple(chains.items())
    return kernels.Ops(backend="auto", chosen=chosen, **kernels._entries(chosen))


def time_ms(fn: Callable[[], Any]) -> float:
    """One call's time, host launch included (the GPU waits for it): what a host-bound batch pays."""
    return A.median_ms(fn, reps=20, warmup=5)


def stream_ms(fn: Callable[[], Any], calls: int = 40, reps: int = 5) -> float:
    """The time per call of `calls` calls queued back to back (median of `reps`): the GPU's time
    when the host runs ahead, as in a device-bound model. For kernels shorter than their launch
    cost it is the host's time instead; `time_ms` and this bound a call from both sides."""
    return common.median_ms(fn, reps=reps, warmup=1, calls=calls)


def line(r: dict[str, Any]) -> str:
    head = f"{r['workload']:22s} {r['system']:18s}"
    if r["status"] != "ok":
        return f"{head} {r['status'].upper()}: {str(r.get('error'))[:90]}"
    cells = [f"{k} {r[k]:.3f}" for k in ("fwd_ms", "fwd_bwd_ms", "ms") if r.get(k) is not None]
    if r.get("tokens_per_s"):
        cells.append(f"{r['tokens_per_s'] / 1e6:.3f}M tok/s")
    if "check_ok" in r:
        worst = max(("out", "dq", "dk", "dv"), key=lambda n: r[f"err_{n}"] / max(r[f"err_plain_{n}"], 1e-9))
        cells.append(f"check {'ok' if r['check_ok'] else 'FAIL'} ({worst} {r[f'err_{worst}']:.1e} "
                     f"vs plain {r[f'err_plain_{worst}']:.1e})")
    if r.get("err_ratio") is not None:
        cells.append(f"err/bf16-ref {r['err_ratio']:.2f}")
    if r.get("min_cos_vs_triton") is not None:
        cells.append(f"min cos vs triton {r['min_cos_vs_triton']:.5f}")
    return f"{head} " + ", ".join(cells)
