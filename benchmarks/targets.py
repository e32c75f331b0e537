"""The performance targets, by family: checked at the end of every family run and by `report`.

A target compares the best of `ours` with the best of `peers` on one workload (a ratio), or the
best of `ours` with a fixed bound (no peers). "Best" is the highest value for a `>=` target and
the lowest for a `<=` one (latency, memory). A missing, skipped, absent or failed record gives
"n/a". Each target names the issue it comes from; a met target stays as a regression check.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from benchmarks.records import ok, thousands

P, G = "packedenc", "packedenc+graphs"
PG = (P, G)
TP, DF, DFP = ("torch-packed",), ("disentangled-flash",), ("disentangled-flash-packed",)
MB, DB = (("model", "modernbert-base"),), (("model", "deberta-v3-base"),)
UNITS = {"tokens_per_s": "tokens/s", "texts_per_s": "texts/s", "ms_per_batch": "latency",
         "peak_reserved_gb": "peak reserved", "peak_allocated_gb": "peak allocated", "scaling": "scaling",
         "fwd_bwd_ms": "fwd+bwd ms", "fwd_ms": "fwd ms"}


@dataclasses.dataclass(frozen=True)
class Target:
    workload: str
    metric: str  # a record field
    ours: tuple[str, ...]  # systems, best of
    op: str  # ">=" or "<="
    value: float  # factor over the peers, or a bound when there are no peers
    peers: tuple[str, ...] = ()
    source: str = ""  # the issue
    peer_workload: str | None = None  # the peers' workload, when it differs (HF pads: no packs)
    where: tuple[tuple[str, Any], ...] = ()  # record fields that must match (model, gpus)

    @property
    def label(self) -> str:
        scope = " ".join(str(v) if k == "model" else f"{k}={v}" for k, v in self.where)
        what = f"{scope + ' ' if scope else ''}{self.workload} {UNITS.get(self.metric, self.metric)}: "
        what += "/".join(self.ours) + f" {self.op} "
        if not self.peers:
            return what + _fmt(self.metric, self.value) + (f" ({self.source})" if self.source else "")
        on = f" on {self.peer_workload}" if self.peer_workload else ""
        return what + f"{self.value:g}x {'/'.join(self.peers)}{on}" + (f" ({self.source})" if self.source else "")


def _fmt(metric: str, v: float) -> str:
    if metric.endswith("_per_s"):
        return thousands(v)
    if metric.endswith("_gb"):
        return f"{v:.2f} GB"
    if metric.endswith("_ms"):
        return f"{v:.2f} ms"
    return f"{v:.2f}"


_GRAPH_WORKLOADS = ("fwd-fp32", "fwd-bf16", "train-fp32", "train-bf16")
TARGETS: dict[str, tuple[Target, ...]] = {
    "modernbert": (
        Target("query", "tokens_per_s", PG, ">=", 2.0, TP, "issue 3"),
        Target("doc", "tokens_per_s", PG, ">=", 1.6, TP, "issue 3"),
        Target("long", "tokens_per_s", PG, ">=", 1.3, TP, "issue 3"),
        Target("doc-64k", "tokens_per_s", PG, ">=", 1.5e6, (), "issue 3"),
        Target("query", "tokens_per_s", (P,), ">=", 800e3, (), "issue 19"),
        Target("query", "tokens_per_s", (G,), ">=", 1.4e6, (), "issue 19"),
    ),
    "deberta": (
        Target("mnli", "tokens_per_s", PG, ">=", 2.5, DF, "issue 5"),
        Target("mnli", "tokens_per_s", (P,), ">=", 2.5, DF, "issue 19"),
        Target("doc1k", "tokens_per_s", PG, ">=", 1.5, DF, "issue 5"),
        Target("long", "ms_per_batch", PG, "<=", 0.8, DF, "issue 5"),
        Target("long", "ms_per_batch", PG, "<=", 1.0, ("flashdeberta",), "issue 5"),
        Target("long", "peak_allocated_gb", PG, "<=", 1.0, DF, "issue 5"),
    ),
    "train": (
        Target("doc-64k", "tokens_per_s", (P,), ">=", 1.5, TP, "issue 7", where=MB),
        Target("doc-64k", "tokens_per_s", (P,), ">=", 3.0, ("hf-sdpa",), "issue 7", "doc", MB),
        Target("doc-64k", "peak_reserved_gb", (P,), "<=", 0.7, ("hf-sdpa",), "issue 7", "doc", MB),
        Target("doc1k-64k", "tokens_per_s", (P,), ">=", 1.5, DFP, "issue 7", where=DB),
        Target("doc1k-64k", "tokens_per_s", (P,), ">=", 3.0, ("hf-eager",), "issue 7", "doc1k", DB),
        Target("doc1k-64k", "peak_reserved_gb", (P,), "<=", 1.0, DFP, "issue 7", where=DB),
        Target("doc", "tokens_per_s", PG, ">=", 1.8, TP, "issue 19", where=MB),
        Target("doc", "tokens_per_s", (P,), ">=", 1.0, TP, "issue 19", where=MB),
        Target("doc-b8", "tokens_per_s", PG, ">=", 2.0, TP, "issue 19", where=MB),
        Target("doc-b8", "tokens_per_s", PG, ">=", 280e3, (), "issue 19", where=MB),
        Target("query", "tokens_per_s", PG, ">=", 2.0, TP, "issue 19", where=MB),
        Target("doc1k", "tokens_per_s", PG, ">=", 2.0, DFP, "issue 19", where=DB),
    ),
    "graph": (
        Target("train-bf16", "tokens_per_s", (P,), ">=", 3.0, ("padded-sdpa",), "issue 6"),
        Target("train-bf16", "tokens_per_s", (P,), ">=", 1.3, ("packed-aten-efficient",), "issue 6"),
        Target("train-fp32", "tokens_per_s", (P,), ">=", 2.0, ("padded-sdpa",), "issue 6"),
        *(Target(w, "peak_reserved_gb", (P,), "<=", 0.5, ("padded-sdpa",), "issue 6") for w in _GRAPH_WORKLOADS),
    ),
    "embed": (
        Target("short", "texts_per_s", (P,), ">=", 200e3, (), "issue 19"),
        Target("passages", "texts_per_s", (P,), ">=", 25e3, (), "issue 19"),
    ),
    "attention": (
        Target("query-64k", "fwd_bwd_ms", (P,), "<=", 1.0, (), "issue 20"),
        Target("doc-64k", "fwd_bwd_ms", (P,), "<=", 1.7, (), "issue 20"),
        Target("doc-64k-window", "fwd_bwd_ms", (P,), "<=", 1.0, (), "issue 20"),
        Target("long", "fwd_bwd_ms", (P,), "<=", 3.2, (), "issue 20"),
    ),
    "cute": (  # the cute family: `auto` with the extra installed vs the Triton-only backend
        Target("modernbert-long", "tokens_per_s", (P,), ">=", 1.15, ("packedenc[triton]",), "issue 21"),
        Target("modernbert-doc-64k", "tokens_per_s", PG, ">=", 1.8e6, (), "issue 21"),
        # nothing auto chooses is slower than what it replaced, on the host-bound short batches too
        Target("modernbert-query", "tokens_per_s", (P,), ">=", 1.0, ("packedenc[auto,no-cute]",), "issue 21"),
    ),
    "ops": (
        Target("geglu-64k", "ms", ("packedenc[cute]",), "<=", 0.45, (), "issue 21"),
    ),
    "distributed": (
        Target("doc-x8", "scaling", ("embed",), ">=", 1.9, (), "issue 9", where=(("gpus", 2),)),
        Target("mlm-64k-per-gpu", "scaling", ("train",), ">=", 1.8, (), "issue 9", where=(("gpus", 2),)),
    ),
}


def _best(records: list[dict[str, Any]], t: Target, systems: tuple[str, ...],
          workload: str) -> tuple[float, str] | None:
    vals = [(float(r[t.metric]), r["system"]) for r in records
            if r.get("system") in systems and r.get("workload") == workload and ok(r)
            and r.get(t.metric) is not None and all(r.get(k) == v for k, v in t.where)]
    if not vals:
        return None
    return max(vals) if t.op == ">=" else min(vals)


def evaluate(t: Target, records: list[dict[str, Any]]) -> tuple[str, str]:
    """(verdict "ok" / "MISSED" / "n/a", what was measured) of one target on `records`."""
    ours = _best(records, t, t.ours, t.workload)
    if ours is None:
        return "n/a", f"no ok record of {'/'.join(t.ours)} with {t.metric}"
    value = ours[0]
    if t.peers:
        theirs = _best(records, t, t.peers, t.peer_workload or t.workload)
        if theirs is None or theirs[0] == 0:
            return "n/a", f"no ok record of {'/'.join(t.peers)} with {t.metric}"
        value, shown = ours[0] / theirs[0], f"{ours[0] / theirs[0]:.2f}x ({ours[1]} vs {theirs[1]})"
    else:
        shown = f"{_fmt(t.metric, value)} ({ours[1]})"
    met = value >= t.value if t.op == ">=" else value <= t.value
    return ("ok" if met else "MISSED"), shown


def applies(t: Target, records: list[dict[str, Any]]) -> bool:
    """Whether `records` hold the target's workload (for its model / GPU count): a run of other
    workloads or a tiny model gives no line instead of an n/a."""
    return any(r.get("workload") == t.workload and all(r.get(k) == v for k, v in t.where) for r in records)


def report(family: str, records: list[dict[str, Any]]) -> list[str]:
    """One line per target of `family` that applies to these records."""
    return [f"{v:<6} {t.label}: {shown}" for t in TARGETS.get(family, ()) if applies(t, records)
            for v, shown in [evaluate(t, records)]]
