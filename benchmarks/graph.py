"""Graph transformer (GiGL's GraphTransformerEncoder math): the `graph` family.

    python -m benchmarks graph                         # H200: < ~4 min
    python -m benchmarks graph --readout anchor_only --workloads train-bf16

Model: 3 layers, width 512, 8 heads, GELU FFN (ratio 4), one node type with 128 input features,
random weights. Data: 4096 anchor sequences, lengths log-normal (median 90, sigma 0.6) clipped to
[1, 256], N(0, 1) node features, batches of 1024 sequences (`--batch`).

Systems (same params, same batches, one process):
- padded-sdpa: GiGL's layout: a (B, L, D) grid, SDPA with an additive float mask (finfo.min / 2 on
  padded keys), padded rows zeroed after each block; inputs arrive padded (padding not timed).
- packed-aten-efficient: packed tokens, plain torch ops, `aten._efficient_attention_forward` with
  cu_seqlens (CUDA only).
- packedenc: `packedenc.encode(params, x, cu_seqlens, max_seqlen)`, backend auto.
Workloads: fwd-fp32, fwd-bf16, train-fp32, train-bf16 (forward + backward to every params leaf);
params and inputs in the workload's dtype (no autocast), as GiGL users run fp32. A repetition is
one pass over every batch; only the measured system's own inputs sit on the GPU while it runs,
so a peak counts what that system needs. Each record's `probe_min_cos` compares its output on
the first batch with padded-sdpa's in fp32.

Records: `results/graph_<gpu>.json`. Shapes: T packed tokens, S sequences, B padded batch, L padded
length, D width, H heads, K head dim.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor

import packedenc as pe
from benchmarks import cli, common
from packedenc.packing import positions_from_cu_seqlens, segment_ids
from packedenc.pytree import tree_leaves, tree_map
from benchmarks.common import Batch, System, WorkloadSpec
from benchmarks.records import Run, rate_cell

WORKLOADS = ("fwd-fp32", "fwd-bf16", "train-fp32", "train-bf16")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
FEATS = 128
SPEC = WorkloadSpec("anchors", 4096, 90, 0.6, 1, 256, 1024)
TINY_SPEC, TINY_FEATS = WorkloadSpec("anchors", 32, 10, 0.6, 1, 32, 8), 8


# ---- the packed and padded forwards -------------------------------------------------------------


def _ffn(p, h: Tensor) -> Tensor:
    return F.linear(F.gelu(F.linear(h, p.ffn.linear_in.weight, p.ffn.linear_in.bias)),
                    p.ffn.linear_out.weight, p.ffn.linear_out.bias)


def _ln(n, h: Tensor, eps: float) -> Tensor:
    return F.layer_norm(h, (h.shape[-1],), n.weight, n.bias, eps)


def padded_sdpa(params: Any, x: Tensor, valid: Tensor) -> Tensor:
    """GiGL's padded forward (eval): float-mask SDPA on a (B, L, D) grid; x (B, L, F), valid (B, L)."""
    cfg = params.config
    B, L, _ = x.shape
    H, K, D = cfg.num_heads, cfg.head_dim, cfg.hid_dim
    vm = valid[..., None].to(x.dtype)
    lin = params.node_projection_dict[cfg.node_types[0]]
    h = F.linear(x, lin.weight, lin.bias) * vm
    bias = torch.zeros(B, 1, 1, L, dtype=x.dtype, device=x.device)
    bias = bias.masked_fill(~valid[:, None, None, :], torch.finfo(x.dtype).min / 2)
    n = len(params.encoder_layers)
    for i, p in enumerate(params.encoder_layers):
        Lq = 1 if (i == n - 1 and cfg.readout_mode == "anchor_only") else L
        hn = _ln(p.attention_norm, h, cfg.norm_eps)
        q = F.linear(hn[:, :Lq], p.query_projection.weight, p.query_projection.bias).view(B, Lq, H, K).transpose(1, 2)
        k = F.linear(hn, p.key_projection.weight, p.key_projection.bias).view(B, L, H, K).transpose(1, 2)
        v = F.linear(hn, p.value_projection.weight, p.value_projection.bias).view(B, L, H, K).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=bias).transpose(1, 2).reshape(B, Lq, D)
        h = (h[:, :Lq] + F.linear(o, p.output_projection.weight, p.output_projection.bias)) * vm[:, :Lq]
        h = (h + _ffn(p, _ln(p.ffn_norm, h, cfg.norm_eps))) * vm[:, :Lq]
    z = _ln(params.final_norm, h, cfg.norm_eps) * vm[:, : h.shape[1]]
    anchor = z[:, 0]
    if cfg.readout_mode == "anchor_neighbor_attention":
        nb, ok = z[:, 1:], valid[:, 1:, None]
        r = params.readout_attention
        s = F.linear(torch.cat([anchor[:, None].expand_as(nb), nb], -1), r.weight, r.bias)
        w = torch.nan_to_num(torch.softmax(s.masked_fill(~ok, torch.finfo(s.dtype).min), 1), nan=0.0) * ok
        anchor = anchor + (nb * w).sum(1)
    o = params.output_projection
    return F.linear(anchor, o.weight, o.bias)


def _segment_readout(params, z: Tensor, cu: Tensor) -> Tensor:
    T, D = z.shape
    S = cu.numel() - 1
    seg = segment_ids(cu, T)
    first = positions_from_cu_seqlens(cu, T) == 0
    w = params.readout_attention.weight.reshape(2, D)
    anchor = z[cu[:-1].long()]
    s = (z @ w[1] + (anchor @ w[0])[seg] + params.readout_attention.bias).float().masked_fill(first, -math.inf)
    m = torch.full((S,), -math.inf, device=z.device).scatter_reduce(0, seg, s.detach(), "amax")
    e = torch.exp(s - torch.where(m.isfinite(), m, 0)[seg])
    den = torch.zeros(S, device=z.device).index_add(0, seg, e).clamp_min(1e-30)
    weighted_TD = ((e / den[seg])[:, None] * z).to(z.dtype)
    pooled = torch.zeros(S, D, device=z.device, dtype=z.dtype).index_add(0, seg, weighted_TD)
    return anchor + pooled


def packed_aten_efficient(params: Any, x: Tensor, cu: Tensor, M: int) -> Tensor:
    """Packed tokens through plain torch ops and aten's memory-efficient varlen attention."""
    cfg = params.config
    T, H, K, D = x.shape[0], cfg.num_heads, cfg.head_dim, cfg.hid_dim
    lin = params.node_projection_dict[cfg.node_types[0]]
    h = F.linear(x, lin.weight, lin.bias)
    lse = torch.is_grad_enabled()
    for p in params.encoder_layers:
        hn = _ln(p.attention_norm, h, cfg.norm_eps)
        q, k, v = (F.linear(hn, w.weight, w.bias).view(1, T, H, K)
                   for w in (p.query_projection, p.key_projection, p.value_projection))
        o = torch.ops.aten._efficient_attention_forward(q, k, v, None, cu, cu, M, M, 0.0, 0, lse, scale=K**-0.5)[0]
        h = h + F.linear(o.reshape(T, D), p.output_projection.weight, p.output_projection.bias)
        h = h + _ffn(p, _ln(p.ffn_norm, h, cfg.norm_eps))
    z = _ln(params.final_norm, h, cfg.norm_eps)
    out = _segment_readout(params, z, cu) if cfg.readout_mode == "anchor_neighbor_attention" else z[cu[:-1].long()]
    o = params.output_projection
    return F.linear(out, o.weight, o.bias)


def packedenc_encode(params: Any, x: Tensor, cu: Tensor, M: int) -> Tensor:
    return pe.encode(params, x, cu, M)


# ---- systems ------------------------------------------------------------------------------------


class GraphSystem(System):
    """One forward (`fwd-*`) or forward + backward to every params leaf (`train-*`) per batch."""

    def __init__(self, name: str, fn: Callable[..., Tensor], params32: Any, workload: str, padded: bool) -> None:
        self.name, self.fn, self.params32, self.padded = name, fn, params32, padded
        self.train, self.dtype = workload.startswith("train"), DTYPES[workload.split("-")[1]]
        self.grad = self.train
        self.params: Any = None

    def setup(self) -> None:
        p = pe.tree_cast(self.params32, self.dtype)
        self.params = tree_map(lambda t: t.detach().requires_grad_(), p) if self.train else p

    def skip_reason(self, workload: Any) -> str | None:
        dev = self.params32.final_norm.weight.device
        if self.fn is packed_aten_efficient and dev.type != "cuda":
            return "aten's efficient varlen attention needs CUDA"
        return None

    def prepare(self, b: Batch) -> tuple[Any, ...]:
        dev = self.params32.final_norm.weight.device
        if self.padded:
            xp, valid = pe.pad(b.ids, b.cu_seqlens)
            return xp.to(dev, self.dtype), valid.to(dev)
        return b.ids.to(dev, self.dtype), b.cu_seqlens.to(dev), b.max_seqlen

    def run(self, inputs: tuple[Any, ...]) -> Any:
        out = self.fn(self.params, *inputs)
        if not self.train:
            return out
        return torch.autograd.grad(out.float().square().mean(), tree_leaves(self.params),
                                   allow_unused=True)

    def probe(self, inputs: tuple[Any, ...]) -> Tensor:
        if self.skip_reason(None):
            return torch.empty(0)  # no probe where it cannot run (no cosine either)
        return self.fn(self.params, *inputs)

    def close(self) -> None:
        self.params = None


def systems(params32: Any, workload: str) -> list[GraphSystem]:
    return [GraphSystem("padded-sdpa", padded_sdpa, params32, workload, padded=True),
            GraphSystem("packed-aten-efficient", packed_aten_efficient, params32, workload, padded=False),
            GraphSystem("packedenc", packedenc_encode, params32, workload, padded=False)]


# ---- the run ------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = cli.parser("graph", __doc__)
    ap.add_argument("--batch", type=int, help="sequences per batch (default 1024; tiny 8)")
    ap.add_argument("--readout", default="anchor_neighbor_attention",
                    choices=("anchor_neighbor_attention", "anchor_only"))
    args = ap.parse_args(argv)
    device = cli.device_of(args)
    if device is None:
        return 2
    run = Run.start("graph", device, argv or [])
    from packedenc.models.graph_transformer import GraphTransformerConfig, init

    feats = TINY_FEATS if args.tiny else FEATS
    size = dict(hid_dim=32, num_heads=2, num_layers=2, out_dim=16) if args.tiny else \
        dict(hid_dim=512, num_heads=8, num_layers=3, out_dim=128)
    cfg = GraphTransformerConfig(node_type_to_feat_dim_map={"node": feats}, readout_mode=args.readout, **size)
    params32 = pe.tree_to(init(cfg, torch.Generator().manual_seed(0)), device)
    spec = TINY_SPEC if args.tiny else SPEC
    w = common.make_workload(spec, 0, args.seed, batch_size=args.batch, features=feats)
    padded = sum(len(b) * max(w.lengths[i] for i in b) for b in w.batches)
    print(f"# {len(w.lengths)} sequences, {w.num_tokens:,} tokens ({w.num_tokens / padded:.0%} of the padded grid), "
          f"{len(w.batches)} batches, readout {args.readout}")
    bench = cli.bench_config(args, device)
    bench.target_tokens = args.target_tokens or w.num_tokens  # a repetition: one pass over every batch
    first = w.batch(0)
    with torch.no_grad():
        ref = padded_sdpa(params32, *[t.to(device) for t in pe.pad(first.ids, first.cu_seqlens)]).float().cpu()
    fields = dict(model=f"gigl-{cfg.num_layers}x{cfg.hid_dim}", readout=args.readout, batch=len(w.batches[0]),
                  config=f"{cfg.num_layers} layers, width {cfg.hid_dim}, {cfg.num_heads} heads, gelu ffn x4, "
                         f"{feats} input features",
                  num_seqs=len(w.lengths), num_tokens=w.num_tokens, padded_tokens=padded)
    records = []
    t0 = time.perf_counter()
    for name in args.workloads or WORKLOADS:
        if name not in WORKLOADS:
            raise SystemExit(f"unknown workload {name!r}; choose from {WORKLOADS}")
        for s in cli.select(systems(params32, name), args.systems):
            recs, out = common.run_system(s, [dataclasses.replace(w, name=name)], bench, run, first, **fields)
            same = out is not None and out.shape == ref.shape
            cos = float(F.cosine_similarity(out, ref, dim=-1).min()) if same else None
            records += [{**r, "probe_min_cos": cos} for r in recs]
    title = f"graph transformer ({time.perf_counter() - t0:.0f}s); real tokens/s (peak reserved GB)"
    return cli.finish(run, records, args, title, fmt=rate_cell)
