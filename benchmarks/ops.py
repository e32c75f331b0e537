"""Fused ops alone, on the GPU: packedenc's Triton kernels vs plain torch: the `ops` family.

    python -m benchmarks ops                                  # H200: < ~5 min
    python -m benchmarks ops --workloads glu rotary --tokens 4096

Each op of the op table with a fused kernel, at ModernBERT-base shapes in bf16 (D=768, H=12,
K=64, F=1152; `linear_glu`: the MLP's Wi GEMM + GeGLU, 768 -> 2 x 1152; GELU at DeBERTa's 3072;
the MLM loss over 50,368 words on 30% of the rows), the graph readout (width 512) and
DeBERTa-v3-base's disentangled attention on a doc1k batch:
- systems: `triton` (the op table's "triton" function), `torch` (what a careful PyTorch user
  writes: F.layer_norm, x + r then LN, bf16 RoPE tables, F.gelu(a) * g, ...), `torch-compile`
  (torch.compile of that, at the largest token count only: compiling is slow), `reference`
  (`get_ops("reference")`, the plain-torch spec, run in bf16: the 2x rule's yardstick);
- passes: `fwd` (no autograd) and `fwd+bwd` (autograd to every floating input).
Metrics: `device_ms` and `host_ms` of one call (`common.host_device_ms` over up to 20 calls back
to back, as many as fit in ~2 ms: GPU time with the host ahead, and enqueue time), `gbps` (bytes a forward must move / device
time; H200 copies run at ~4.2 TB/s), `err` (max abs against the fp32 reference: outputs, or
gradients for fwd+bwd) and `err_ratio` (err / the bf16 reference's: <= 2 passes the 2x rule).

Records: `results/ops_<gpu>.json`, workload = "<op>-T<tokens>", `pass` = fwd / fwd+bwd.
Shapes: T tokens, D hidden, H heads, K head dim, F mlp width, V vocab, M scored rows, R relative slots.
"""

from __future__ import annotations

import dataclasses
import time
import traceback
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor

import packedenc as pe
from benchmarks import cli, common
from benchmarks.records import Run

EPS, THETA, BF16 = 1e-5, 10000.0, torch.bfloat16


@dataclasses.dataclass(frozen=True)
class Shapes:
    D: int = 768  # ModernBERT-base
    H: int = 12
    K: int = 64
    F: int = 1152
    FD: int = 3072  # DeBERTa-v3-base's FFN width (the biased GELU)
    V: int = 50368  # ModernBERT's vocabulary (the MLM loss)
    GD: int = 512  # the graph benchmark's width (readout)
    R: int = 512  # DeBERTa-v3's relative slots (256 log buckets each way)
    graph_len: tuple[int, int] = (90, 256)  # median, longest anchor sequence
    doc_len: tuple[int, int] = (300, 1024)  # DeBERTa doc1k


TINY = Shapes(D=32, H=2, K=16, F=48, FD=64, V=128, GD=16, R=16, graph_len=(8, 16), doc_len=(12, 32))
SYSTEMS = ("triton", "torch", "torch-compile", "reference")


@dataclasses.dataclass
class Case:
    op: str
    tokens: int
    leaves: list[Tensor]  # the floating inputs, bf16 (gradients flow to them in fwd+bwd)
    fns: dict[str, Callable[..., Any]]  # system -> fn(*leaves); "triton" and "reference" always
    nbytes: int  # bytes a forward must read and write


class Ctx:
    """What an op's builder needs: sizes, seeded bf16 tensors, the two op tables."""

    def __init__(self, T: int, dev: torch.device, sh: Shapes) -> None:
        self.T, self.dev, self.sh = T, dev, sh
        self.g = torch.Generator(device=dev).manual_seed(0)
        self.tri, self.ref = pe.get_ops("triton", dev), pe.get_ops("reference", dev)

    def rnd(self, *shape: int, scale: float = 1.0) -> Tensor:
        return (scale * torch.randn(*shape, device=self.dev, generator=self.g)).to(BF16)

    def ints(self, hi: int, n: int) -> Tensor:
        return torch.randint(0, hi, (n,), device=self.dev, generator=self.g)

    def table(self, op: str, *after: Any, before: tuple[Any, ...] = (), **kw: Any) -> dict[str, Callable[..., Any]]:
        """The "triton" and "reference" entries of `op`, called as op(*before, *leaves, *after, **kw)."""
        return {name: (lambda *x, f=getattr(t, op): f(*before, *x, *after, **kw))
                for name, t in (("triton", self.tri), ("reference", self.ref))}


def _layer_norm(c: Ctx) -> tuple[list[Tensor], dict[str, Callable[..., Any]], int]:
    D = c.sh.D
    torch_fn = lambda x, w: F.layer_norm(x, (D,), w, None, EPS)  # noqa: E731
    leaves = [c.rnd(c.T, D), 1 + c.rnd(D, scale=0.1)]
    return leaves, {**c.table("layer_norm", None, EPS), "torch": torch_fn}, 4 * c.T * D


def _add_layer_norm(c: Ctx) -> tuple[list[Tensor], dict[str, Callable[..., Any]], int]:
    D = c.sh.D

    def plain(x: Tensor, r: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
        s = x + r
        return F.layer_norm(s, (D,), w, None, EPS), s
    leaves = [c.rnd(c.T, D), c.rnd(c.T, D), 1 + c.rnd(D, scale=0.1)]
    return leaves, {**c.table("add_layer_norm", None, EPS), "torch": plain}, 8 * c.T * D


def _embed_layer_norm(c: Ctx) -> tuple[list[Tensor], dict[str, Callable[..., Any]], int]:
    D, ids = c.sh.D, c.ints(c.sh.V, c.T)
    torch_fn = lambda t, w: F.layer_norm(F.embedding(ids, t), (D,), w, None, EPS)  # noqa: E731
    fns = {**c.table("embed_layer_norm", None, EPS, before=(ids,)), "torch": torch_fn}
    return [c.rnd(c.sh.V, D), 1 + c.rnd(D, scale=0.1)], fns, 4 * c.T * D


def _rotary(c: Ctx) -> tuple[list[Tensor], dict[str, Callable[..., Any]], int]:
    H, K, pos = c.sh.H, c.sh.K, c.ints(2048, c.T)
    f = torch.arange(2048, device=c.dev).float()[:, None] / THETA ** (torch.arange(0, K, 2, device=c.dev) / K)
    cos, sin = torch.cat((f, f), -1).cos().to(BF16), torch.cat((f, f), -1).sin().to(BF16)

    def plain(qkv: Tensor) -> tuple[Tensor, Tensor]:  # bf16 tables gathered by position
        co, si = cos[pos][:, None], sin[pos][:, None]
        rot = lambda x: x * co + torch.cat((-x[..., K // 2:], x[..., : K // 2]), -1) * si  # noqa: E731
        return rot(qkv[:, 0]), rot(qkv[:, 1])
    return [c.rnd(c.T, 3, H, K)], {**c.table("rotary", pos, THETA), "torch": plain}, 8 * c.T * H * K


def _glu(c: Ctx) -> tuple[list[Tensor], dict[str, Callable[..., Any]], int]:
    def plain(u: Tensor) -> Tensor:
        a, b = u.chunk(2, -1)
        return F.gelu(a) * b
    return [c.rnd(c.T, 2 * c.sh.F)], {**c.table("glu", "gelu"), "torch": plain}, 6 * c.T * c.sh.F


def _linear_glu(c: Ctx) -> tuple[list[Tensor], dict[str, Callable[..., Any]], int]:
    # ModernBERT-base's MLP input: x (T, 768) @ Wi (2 x 1152, 768), exact-GELU gate (no bias in base)
    def plain(x: Tensor, w: Tensor) -> Tensor:
        a, b = F.linear(x, w).chunk(2, -1)
        return F.gelu(a) * b
    D, Fm = c.sh.D, c.sh.F
    leaves = [c.rnd(c.T, D), c.rnd(2 * Fm, D, scale=D ** -0.5)]
    return leaves, {**c.table("linear_glu", None, "gelu"), "torch": plain}, 2 * (c.T * D + 2 * Fm * D + c.T * Fm)


def _activation(c: Ctx) -> tuple[list[Tensor], dict[str, Callable[..., Any]], int]:
    # the FFN-in bias moved into the activation (DeBERTa, BERT, the graph transformer)
    fns = {name: (lambda x, b, f=t.activation: f(x, "gelu", bias=b))
           for name, t in (("triton", c.tri), ("reference", c.ref))}
    fns["torch"] = lambda x, b: F.gelu(x + b)
    return [c.rnd(c.T, c.sh.FD), c.rnd(c.sh.FD, scale=0.1)], fns, 4 * c.T * c.sh.FD


def _linear_cross_entropy(c: Ctx) -> tuple[list[Tensor], dict[str, Callable[..., Any]], int]:
    D, V, tgt = c.sh.D, c.sh.V, c.ints(c.sh.V, c.T * 3 // 10)  # MLM: 30% of the rows scored
    torch_fn = lambda x, w, b: F.cross_entropy(F.linear(x, w, b).float(), tgt, reduction="none")  # noqa: E731
    leaves = [c.rnd(tgt.numel(), D), c.rnd(V, D, scale=D ** -0.5), c.rnd(V, scale=0.1)]
    return leaves, {**c.table("linear_cross_entropy", tgt), "torch": torch_fn}, 2 * (tgt.numel() + V) * D


def _ragged(c: Ctx, median: int, hi: int) -> tuple[Tensor, int]:
    n = max(1, c.T // median)
    lengths = common.sample_lengths(common.WorkloadSpec("ops", n, median, 0.6, 1, hi, n))
    cu = torch.zeros(n + 1, dtype=torch.int32)
    cu[1:] = lengths.cumsum(0)
    return cu.to(c.dev), int(lengths.max())


def _graph_readout(c: Ctx) -> tuple[list[Tensor], dict[str, Callable[..., Any]], int]:
    cu, L = _ragged(c, *c.sh.graph_len)  # GiGL's anchor + attention-weighted neighbours
    n, GD = int(cu[-1]), c.sh.GD
    return [c.rnd(n, GD), c.rnd(1, 2 * GD, scale=GD ** -0.5), c.rnd(1)], c.table("graph_readout", cu, L), 2 * n * GD


def _deberta_attention(c: Ctx) -> tuple[list[Tensor], dict[str, Callable[..., Any]], int]:
    cu, L = _ragged(c, *c.sh.doc_len)  # DeBERTa-v3: log buckets, c2p + p2c, on doc1k-like lengths
    n, H, K, R = int(cu[-1]), c.sh.H, c.sh.K, c.sh.R
    kw = dict(pos_att_type=("c2p", "p2c"), position_buckets=R // 2, max_relative_positions=R, scale=(3 * K) ** -0.5)
    fns = {name: (lambda q, k, v, pk, pq, f=t.deberta_attention: f(q, k, v, cu, L, pk, pq, **kw))
           for name, t in (("triton", c.tri), ("reference", c.ref))}
    return [c.rnd(n, H, K) for _ in range(3)] + [c.rnd(R, H, K), c.rnd(R, H, K)], fns, 8 * n * H * K


BUILDERS = {"layer_norm": _layer_norm, "add_layer_norm": _add_layer_norm, "embed_layer_norm": _embed_layer_norm,
            "rotary": _rotary, "glu": _glu, "linear_glu": _linear_glu, "activation": _activation,
            "linear_cross_entropy": _linear_cross_entropy,
            "graph_readout": _graph_readout, "deberta_attention": _deberta_attention}


def cases(op: str, T: int, dev: torch.device, sh: Shapes) -> Case:
    """One op's inputs at about T tokens and its function per system."""
    if op not in BUILDERS:
        raise SystemExit(f"unknown op {op!r}; choose from {list(BUILDERS)}")
    leaves, fns, nbytes = BUILDERS[op](Ctx(T, dev, sh))
    return Case(op, leaves[0].shape[0] if op in ("graph_readout", "deberta_attention") else T, leaves, fns, nbytes)


def _outputs(out: Any) -> list[Tensor]:
    outs = out if isinstance(out, (tuple, list)) else [out]
    return [o for o in outs if isinstance(o, Tensor) and o.is_floating_point()]


def _call(fn: Callable[..., Any], leaves: list[Tensor], train: bool, cots: list[Tensor] | None) -> list[Tensor]:
    """fwd: the outputs; fwd+bwd: the gradients of every leaf against `cots`."""
    if not train:
        with torch.no_grad():
            return _outputs(fn(*leaves))
    xs = [t.detach().requires_grad_() for t in leaves]
    outs = _outputs(fn(*xs))
    grads = torch.autograd.grad(outs, xs, [c.to(o.dtype) for c, o in zip(cots, outs)], allow_unused=True)
    return [torch.zeros_like(x) if gr is None else gr for x, gr in zip(xs, grads)]


def _err(got: list[Tensor], want: list[Tensor]) -> float:
    return max(float((a.float() - b.float()).abs().max()) for a, b in zip(got, want))


def measure(case: Case, systems: list[str], train: bool, run: Run, device: torch.device) -> list[dict[str, Any]]:
    """Records of every system on one (op, pass): error against fp32, device and host ms."""
    pas = "fwd+bwd" if train else "fwd"
    f32 = [t.float() for t in case.leaves]
    want32 = _call(case.fns["reference"], f32, False, None)
    cots = [torch.randn_like(o) for o in want32]
    if train:
        want32 = _call(case.fns["reference"], f32, True, cots)
    base = _err(_call(case.fns["reference"], case.leaves, train, cots), want32)
    records = []
    for name in systems:
        fn = case.fns.get(name)
        fields = dict(workload=f"{case.op} T={case.tokens} {pas}", op=case.op, tokens=case.tokens, **{"pass": pas})
        if fn is None:
            records.append(run.record(name, status="skipped", error="no such implementation here", **fields))
            continue
        try:
            err = _err(_call(fn, case.leaves, train, cots), want32)
            common.sync(device)
            t0 = time.perf_counter()
            _call(fn, case.leaves, train, cots)
            common.sync(device)
            n = max(1, min(20, int(2e-3 / (time.perf_counter() - t0))))  # short ops: n calls per timing
            hd = common.host_device_ms([lambda: [_call(fn, case.leaves, train, cots) for _ in range(n)]] * 5, device)
            dev_ms = None if hd["device_ms"] is None else hd["device_ms"] / n
            gbps = case.nbytes / dev_ms / 1e6 if dev_ms and not train else None
            records.append(run.record(name, device_ms=dev_ms, host_ms=hd["host_ms"] / n, gbps=gbps, err=err,
                                      err_ratio=err / base if base else None, **fields))
        except Exception as e:  # noqa: BLE001 - one failing implementation is recorded, not fatal
            traceback.print_exc()
            records.append(run.record(name, "failed", error=f"{type(e).__name__}: {e}"[:300], **fields))
    return records


def main(argv: list[str] | None = None) -> int:
    ap = cli.parser("ops", __doc__)
    ap.add_argument("--tokens", type=int, nargs="*", help="token counts (default 4096 32768; tiny 64)")
    args = ap.parse_args(argv)
    device = cli.device_of(args)
    if device is None:
        return 2
    run = Run.start("ops", device, argv or [])
    Ts = args.tokens or ([64] if args.tiny else [4096, 32768])
    names = args.systems or list(SYSTEMS)
    if set(names) - set(SYSTEMS):
        raise SystemExit(f"unknown system(s) {sorted(set(names) - set(SYSTEMS))}; choose from {SYSTEMS}")
    records, t0 = [], time.perf_counter()
    for op in args.workloads or BUILDERS:
        for T in Ts:
            case = cases(op, T, device, TINY if args.tiny else Shapes())
            systems = [s for s in names if device.type == "cuda" or s in ("torch", "reference")]  # CPU: no kernels
            if "torch" in case.fns and T == max(Ts) and "torch-compile" in systems:
                case.fns["torch-compile"] = torch.compile(case.fns["torch"], dynamic=False)
            for train in (False, True):
                records += measure(case, systems, train, run, device)
    over = [f"{r['system']} {r['workload']} {r['err_ratio']:.2f}" for r in records if (r.get("err_ratio") or 0) > 2]
    print("\n2x rule (error / the bf16 reference's error <= 2) broken by: " + (", ".join(over) or "none"))
    title = f"fused ops ({time.perf_counter() - t0:.0f}s); time per call (fwd: achieved GB/s)"
    return cli.finish(run, records, args, title, fmt=cell, rows=("workload",), col="system")


def cell(r: dict[str, Any]) -> str:
    """'12.3 us, 3,800 GB/s' (device time; host time where there is no device)."""
    if r.get("device_ms") is None:
        return f"{r['host_ms'] * 1e3:.1f} us host"
    return f"{r['device_ms'] * 1e3:.1f} us" + (f", {r['gbps']:,.0f} GB/s" if r.get("gbps") else "")
