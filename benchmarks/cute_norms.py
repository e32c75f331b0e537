"""Part 3 of `python -m benchmarks cute` (`--only norms`): LayerNorm and residual add + LayerNorm.

Workloads, bf16, 65,536 x 768 (ModernBERT-base), no norm bias, eps 1e-5, seeded:
- `layer_norm-64k`: `packedenc[triton]` and `packedenc[cute]` (the op table's entries: Triton, and
  quack through kernels/cute/norms.py), and `quack` (quack-kernels' layernorm_fwd / layernorm_bwd
  called directly with the fp32 weight they require: the kernels alone).
- `add_layer_norm-64k`: (LayerNorm(x + r), x + r), both outputs used as in a pre-norm layer:
  `packedenc[triton]` (one fused kernel each way) and `packedenc[cute]` (torch's add, then quack's
  LayerNorm: the reference's rounding; quack's backward with the sum's gradient fused), and
  `quack[fused-add]` (quack's own fused residual, `_rmsnorm_fwd(residual=...)`: one kernel, but its
  statistics come from the unrounded fp32 sum, not the reference's semantics: what exactness costs).
Times: `fwd_ms` (no grad), `fwd_bwd_ms` (forward + autograd.grad of x[, r] and the weight), each one
call with its host launch (`cute_common.time_ms`), and `fwd_stream_ms` / `fwd_bwd_stream_ms`, the
same calls queued back to back (`stream_ms`: the device's time when the host runs ahead, as in a
model at 64k tokens). The `-4k` workloads time the forwards again at 4,096 rows (host-bound).
Checks on the whole workload, against the fp32 reference: `err` / `err_ratio` (the output) and
`err_dx` / `err_dx_ratio` (dx), each ratio over the plain bf16 reference's error (the 2x rule
wants <= 2); `sum_exact`: the returned sum equals torch's x + r bit for bit.
"""

from __future__ import annotations

import traceback
from typing import Any, Callable

import torch

from benchmarks.cute_common import BF16, D, T64K, cute_error, line, stream_ms, time_ms
from benchmarks.records import Run

EPS = 1e-5


def _quack_systems(x, r, w, dy, dy2) -> dict[str, dict[str, Callable[[], Any]]]:
    """{workload: {system: fwd, fwd_bwd, dx}} for quack called directly (fp32 weight, as it requires)."""
    from quack.rmsnorm import _rmsnorm_bwd, _rmsnorm_fwd, layernorm_bwd, layernorm_fwd
    from quack.rmsnorm_config import get_sm_count

    w32 = w.float()

    def ln_fwd_bwd():
        _, rstd, mean = layernorm_fwd(x, w32, None, EPS, return_rstd=True, return_mean=True)
        return layernorm_bwd(x, w32, dy, rstd, mean, has_bias=False)

    def fused_fwd(stats: bool):
        y, s = torch.empty_like(x), torch.empty_like(x)
        T = x.shape[0]
        rstd, mean = ((torch.empty(T, device="cuda"), torch.empty(T, device="cuda")) if stats else (None, None))
        _rmsnorm_fwd(x, w32, y, bias=None, rstd=rstd, mean=mean, residual=r, residual_out=s, eps=EPS,
                     is_layernorm=True)
        return y, s, rstd, mean

    def fused_fwd_bwd():
        y, s, rstd, mean = fused_fwd(True)
        P = get_sm_count(D, x.device)
        dx, dw_part = torch.empty_like(s), torch.empty(P, D, device="cuda")
        _rmsnorm_bwd(s, w32, dy, rstd, dx, dw_part, None, dy2, None, P, mean=mean, is_layernorm=True)
        return dx, dw_part.sum(0)

    return {
        "layer_norm-64k": {"quack": (lambda: layernorm_fwd(x, w32, None, EPS), ln_fwd_bwd, lambda: ln_fwd_bwd()[0])},
        "add_layer_norm-64k": {"quack[fused-add]": (lambda: fused_fwd(False)[:2], fused_fwd_bwd,
                                                    lambda: fused_fwd_bwd()[0])},
    }


def _table_systems(backend: str, x, r, w, dy, dy2) -> dict[str, dict[str, Callable[[], Any]]]:
    from packedenc.kernels import get_ops

    ops = get_ops(backend, "cuda")
    xl, rl, wl = (t.clone().requires_grad_() for t in (x, r, w))

    def ln_grads():
        return torch.autograd.grad(ops.layer_norm(xl, wl, None, EPS), (xl, wl), dy)

    def add_grads():
        return torch.autograd.grad(ops.add_layer_norm(xl, rl, wl, None, EPS), (xl, rl, wl), (dy, dy2))

    name = f"packedenc[{backend}]"
    return {
        "layer_norm-64k": {name: (lambda: ops.layer_norm(x, w, None, EPS), ln_grads, lambda: ln_grads()[0])},
        "add_layer_norm-64k": {name: (lambda: ops.add_layer_norm(x, r, w, None, EPS), add_grads,
                                      lambda: add_grads()[0])},
    }


def _references(x, r, w, dy, dy2) -> dict[str, dict[str, Any]]:
    """Per workload: the fp32 reference output and dx, the plain bf16 ones' errors, the rounded sum."""
    from packedenc.kernels import reference
    from packedenc.kernels.reference import backward as reference_bwd

    def bf16_dx(fn, *leaves_cots):
        leaves = [t.clone().requires_grad_() for t in leaves_cots[0]]
        out = fn(*leaves)
        return torch.autograd.grad(out, leaves[0], leaves_cots[1])[0]

    s = reference.add_layer_norm(x, r, w, None, EPS)[1]
    out = {}
    for wl, inp, dsum in (("layer_norm-64k", x, None), ("add_layer_norm-64k", s, dy2)):
        y32 = reference.layer_norm(inp.float(), w.float(), None, EPS)
        dx32 = reference_bwd.layer_norm_bwd(dy.float(), inp.float(), w.float(), EPS,
                                            None if dsum is None else dsum.float())[0]
        if dsum is None:
            y16 = reference.layer_norm(x, w, None, EPS)
            dx16 = bf16_dx(lambda x, w: reference.layer_norm(x, w, None, EPS), (x, w), dy)
        else:
            y16 = reference.add_layer_norm(x, r, w, None, EPS)[0]
            dx16 = bf16_dx(lambda x, r, w: reference.add_layer_norm(x, r, w, None, EPS), (x, r, w), (dy, dy2))
        out[wl] = dict(y32=y32, dx32=dx32, base=(y16.float() - y32).abs().max().item(),
                       base_dx=(dx16.float() - dx32).abs().max().item(), sum=s)
    return out


def part_norms(run: Run) -> list[dict[str, Any]]:
    g = torch.Generator(device="cuda").manual_seed(0)
    x, r, dy, dy2 = (torch.randn(T64K, D, device="cuda", generator=g).to(BF16) for _ in range(4))
    w = (1 + 0.1 * torch.randn(D, device="cuda", generator=g)).to(BF16)
    refs = _references(x, r, w, dy, dy2)
    systems: dict[str, dict[str, Any]] = {wl: {} for wl in refs}
    absent: list[tuple[str, str, str]] = []  # (workload, system, error)
    both = tuple(refs)
    sources = [  # (what it builds, the (workload, system) pairs it gives)
        (lambda: _table_systems("triton", x, r, w, dy, dy2), [(wl, "packedenc[triton]") for wl in both]),
        (lambda: _table_systems("cute", x, r, w, dy, dy2), [(wl, "packedenc[cute]") for wl in both]),
        (lambda: _quack_systems(x, r, w, dy, dy2), [(both[0], "quack"), (both[1], "quack[fused-add]")]),
    ]
    for build, pairs in sources:
        try:
            if pairs[0][1] == "packedenc[cute]" and cute_error() is not None:
                raise RuntimeError(cute_error())
            for wl, entries in build().items():
                systems[wl] |= entries
        except Exception as e:  # noqa: BLE001 - a missing or broken package: "absent" records say why
            absent += [(wl, n, f"{type(e).__name__}: {e}"[:300]) for wl, n in pairs]
    records = [run.record(n, workload=wl, status="absent", error=e, tokens=T64K, hidden=D) for wl, n, e in absent]
    for wl, entries in systems.items():
        ref = refs[wl]
        fields = dict(workload=wl, tokens=T64K, hidden=D)
        for name, (fwd, fwd_bwd, dx_fn) in entries.items():
            try:
                with torch.no_grad():
                    out = fwd()
                    y, s = out if isinstance(out, tuple) else (out, None)
                    e = (y.float() - ref["y32"]).abs().max().item()
                    f_ms = time_ms(fwd)
                e_dx = (dx_fn().float() - ref["dx32"]).abs().max().item()
                extra = {} if s is None else dict(sum_exact=bool(torch.equal(s, ref["sum"])))
                with torch.no_grad():
                    f_stream = stream_ms(fwd)
                rec = run.record(name, fwd_ms=f_ms, fwd_bwd_ms=time_ms(fwd_bwd), fwd_stream_ms=f_stream,
                                 fwd_bwd_stream_ms=stream_ms(fwd_bwd), err=e, err_ratio=e / ref["base"],
                                 err_dx=e_dx, err_dx_ratio=e_dx / ref["base_dx"], **extra, **fields)
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                rec = run.record(name, status="failed", error=f"{type(e).__name__}: {e}"[:300], **fields)
            records.append(rec)
            print(line(rec), flush=True)
    return records + _small(run, x[:T_SMALL], r[:T_SMALL], w, dy[:T_SMALL], dy2[:T_SMALL], [n for _, n, _ in absent])


T_SMALL = 4096  # a short batch (`query` packs ~3-4k tokens): host-bound, where launch cost decides


def _small(run: Run, x, r, w, dy, dy2, absent: list[str]) -> list[dict[str, Any]]:
    """The forwards again at T_SMALL rows, timed only (the 64k records checked the same kernels)."""
    records = []
    for build, name in ((lambda: _table_systems("triton", x, r, w, dy, dy2), "packedenc[triton]"),
                        (lambda: _table_systems("cute", x, r, w, dy, dy2), "packedenc[cute]")):
        if name in absent:
            continue
        for wl, entries in build().items():
            fwd = entries[name][0]
            with torch.no_grad():
                rec = run.record(name, workload=wl.replace("-64k", "-4k"), tokens=T_SMALL, hidden=D,
                                 fwd_ms=time_ms(fwd), fwd_stream_ms=stream_ms(fwd))
            records.append(rec)
            print(line(rec), flush=True)
    return records
