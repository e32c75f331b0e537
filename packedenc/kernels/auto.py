"""backend="auto" on a CUDA device: which implementation serves each op, and the measurement behind it.

`AUTO_CUDA[op]` lists rows in order of preference. A row names a backend, optionally a shape
class (`shape`, a rule in `SHAPES` over the op's arguments: host values only, no device sync),
and the committed benchmark record that shows it beats what it replaces (`evidence`: a file in
benchmarks/results/, the metric, the two systems, the workloads). The op table
(`kernels/__init__.py`) takes the rows that have evidence (or are fallbacks), in order, among the
backends that load on this machine; a row with a shape class or a partial backend (a `covers`
rule) serves only its calls and hands the rest to the next row.

A row without evidence is listed and never chosen (`why_not` says why): the place for an
implementation that exists but has not been measured, or that lost. A fallback row needs no
record: it only replaces the plain-torch reference, a dense spec that no GPU run should reach.
`tests/kernels/test_cute.py` reads every cited record and checks that it shows the win.
Ops with no row use `DEFAULT`.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

__all__ = ["Evidence", "Row", "AUTO_CUDA", "DEFAULT", "SHAPES", "rows", "LONG_SEQLEN", "LARGE_PACK", "MEAN_SEQLEN", "TRAIN_MEAN_SEQLEN",
           "inference", "long_global", "large_global", "train_global", "large_pack", "uncaptured",
           "SMALL_PACK", "small_uncaptured"]


@dataclasses.dataclass(frozen=True)
class Evidence:
    """A committed record showing `system` beats `rival` on `metric` (each of them, for a tuple)
    for every one of `workloads`."""

    file: str  # in benchmarks/results/
    metric: str | tuple[str, ...]  # record fields: *_ms and ms_per_batch lower is better, *_per_s higher
    system: str  # the record's name for this row's implementation
    rival: str  # what it replaces
    workloads: tuple[str, ...]

    @property
    def metrics(self) -> tuple[str, ...]:
        return (self.metric,) if isinstance(self.metric, str) else tuple(self.metric)

    def __str__(self) -> str:
        return (f"{self.file}: {self.system} beats {self.rival} on {' and '.join(self.metrics)} "
                f"({', '.join(self.workloads)})")


@dataclasses.dataclass(frozen=True)
class Row:
    backend: str
    evidence: Evidence | None = None
    shape: str | None = None  # a key of SHAPES; None: every call the backend covers
    fallback: bool = False  # replaces only the reference: chosen without a record
    why_not: str = ""  # for a row without evidence: why it is not chosen

    @property
    def chosen(self) -> bool:
        return self.evidence is not None or self.fallback

    @property
    def name(self) -> str:
        """The name in `Ops.chosen` chains: "cute[long-global]" for a shaped row, else the backend."""
        return self.backend if self.shape is None else f"{self.backend}[{self.shape}]"


# ---- shape classes (same arguments as the op; host values only) --------------------------------

# The longest sequence from which FA4 takes global layers: FA4 beats the Triton kernel forward and
# forward + backward on doc-64k (longest 2048) and long (8192) and loses on query-64k (longest 128)
# by 4-8x and on mid-64k (longest 866, mean 189) by 1.2-1.6x (cute_h200.json). FA4 tiles each
# sequence alone, so what decides is how many of its tiles a pack's sequences fill; the longest is
# a host value that tracks it on these workloads, and the threshold stays at the shortest measured win.
# The longest alone is not enough: one long sequence among many short ones (cute_h200.json,
# mixed-query-16k) makes FA4 several times slower on the device, FA4 paying a tile per short
# sequence, so the class also asks for MEAN_SEQLEN on average, as the large-pack class does (below).
# In a CUDA graph `max_seqlen` is the bucket's bound, the next power of two (cudagraphs/buckets.py),
# so a graphed batch whose longest sequence exceeds 1024 takes this row as well; on such packs (the
# TRAIN packs of cute_h200.json, means 253-448) FA4 wins on the device too, and in a graph the
# device time is all there is.
LONG_SEQLEN = 2048


def long_global(q_THK: Tensor, k_THK: Tensor, v_THK: Tensor, cu_seqlens: Tensor, max_seqlen: int,
                window: tuple[int, int] = (-1, -1), scale: float | None = None, **_) -> bool:
    """varlen_attention of a global layer over long sequences (the longest at least LONG_SEQLEN, the
    mean at least MEAN_SEQLEN), inference or training."""
    return tuple(window) == (-1, -1) and max_seqlen >= LONG_SEQLEN and _long_on_average(q_THK, cu_seqlens)


# The packed tokens from which the CuteDSL GeGLU GEMM takes the MLP input projection. On 3.6k-token
# `query` batches, eager and host-bound, ModernBERT-base ran slower with it than with the Triton
# entry (history/modernbert_h200_c9c855a_query_cute.json: 801k / 719k vs 846k / 829k tokens/s, host
# 4.6-4.8 vs 4.1 ms a batch) although the op alone is faster at 4k rows (ops_h200.json geglu-4k);
# it wins at 64k (geglu-64k) and in the long and doc-64k models. Batches in between are unmeasured:
# the threshold stays below the smallest measured win (long's 33.8k-token batches).
LARGE_PACK = 32768


def large_pack(x_TD: Tensor, *args: object, **kwargs: object) -> bool:
    """An op call over a pack of at least LARGE_PACK tokens (its first argument's rows)."""
    return x_TD.shape[0] >= LARGE_PACK


# The packed tokens below which an eager batch of ModernBERT-base waits for the host rather than
# the GPU, so that one launch fewer a layer is worth more than a slightly slower kernel: the Triton
# GEMM with the GeGLU gate in its epilogue takes 31.2 vs 30.3 us of device time at 3.6k rows (cuBLAS
# then the gate kernel) and 90.0 vs 86.6 at 11.3k, and saves one launch a layer. Eager, it won on
# `query` (3.5k tokens a batch: 808k vs 695k tokens/s, host 4.27 vs 4.69 ms a batch) and `doc-b8`
# (3.0k: 607k vs 555k), tied on `doc-b16` (7.3k, where host and device time meet: 5.2-5.5 ms), and
# lost on `doc` (13.4k, device-bound: 1490k vs 1514k) and in CUDA graphs (query: 1417k vs 1433k;
# history/linear_glu_probe_h100_5346266.json). The line sits at the tie.
SMALL_PACK = 8192


def small_uncaptured(x_TD: Tensor, *args: object, **kwargs: object) -> bool:
    """An op call over fewer than SMALL_PACK tokens (its first argument's rows), outside CUDA-graph
    capture and torch.compile (`uncaptured`)."""
    return x_TD.shape[0] < SMALL_PACK and uncaptured(x_TD)


# The mean sequence length from which FA4 also takes the global layers of large packs (at least
# LARGE_PACK tokens) whose longest sequence is under LONG_SEQLEN: a 64k pack's device time is what
# its forward waits for (the host enqueues ahead), and it follows how full FA4's per-sequence tiles
# are, which the mean (T / S: host values) tracks better than the longest. FA4 loses on mid-64k
# (mean 189) and wins on doc-64k (505) and on the doc-like packs in between from this mean
# (cute_h200.json: doc200-64k, doc250-64k, doc300-64k, means 258 / 310 / 390).
MEAN_SEQLEN = 384


def _long_on_average(q_THK: Tensor, cu_seqlens: Tensor, mean: int = MEAN_SEQLEN) -> bool:
    """T / S >= mean, from the shapes alone (no device read)."""
    return q_THK.shape[0] >= mean * (cu_seqlens.shape[0] - 1)


def large_global(q_THK: Tensor, k_THK: Tensor, v_THK: Tensor, cu_seqlens: Tensor, max_seqlen: int,
                 window: tuple[int, int] = (-1, -1), scale: float | None = None, **_) -> bool:
    """varlen_attention of a global layer over a large pack of sequences MEAN_SEQLEN long on average."""
    return tuple(window) == (-1, -1) and q_THK.shape[0] >= LARGE_PACK and _long_on_average(q_THK, cu_seqlens)


# The mean sequence length from which FA4 would take the global layers of a training step's packs
# of any size (`train_global`, a row listed and not chosen: see its why_not): its backward beats
# the Triton kernel's on doc-like packs by more than its forward does (cute_h200.json: the doc-like
# 64k packs from a mean of ~260, and the training-size TRAIN packs on the device), while training
# batches are a few thousand to ~16k tokens, below LARGE_PACK. The threshold is the lowest doc-like
# 64k pack's mean whose forward + backward FA4 wins.
TRAIN_MEAN_SEQLEN = 256


def train_global(q_THK: Tensor, k_THK: Tensor, v_THK: Tensor, cu_seqlens: Tensor, max_seqlen: int,
                 window: tuple[int, int] = (-1, -1), scale: float | None = None, **kwargs: object) -> bool:
    """varlen_attention of a global layer that computes gradients, over sequences TRAIN_MEAN_SEQLEN
    long on average, whatever the pack's size."""
    return (tuple(window) == (-1, -1) and _long_on_average(q_THK, cu_seqlens, TRAIN_MEAN_SEQLEN)
            and not inference(q_THK, k_THK, v_THK))


def inference(*args: object, **kwargs: object) -> bool:
    """Any op's call with no gradient to compute (no tensor argument requires one, or grad is off)."""
    if not torch.is_grad_enabled():
        return True
    return not any(isinstance(t, Tensor) and t.requires_grad for t in (*args, *kwargs.values()))


def uncaptured(*args: object, **kwargs: object) -> bool:
    """A call outside CUDA-graph capture: its host time is paid on every batch, not once at capture.
    Inside a torch.compile trace: False (the compiled code's launches are not this eager call's;
    the capture query itself cannot be traced)."""
    if torch.compiler.is_compiling():
        return False
    t = next((a for a in args if isinstance(a, Tensor)), None)
    return t is None or not t.is_cuda or not torch.cuda.is_current_stream_capturing()


SHAPES = {"long-global": long_global, "large-global": large_global, "train-global": train_global, "inference": inference, "uncaptured": uncaptured, "large-pack": large_pack,
          "small-uncaptured": small_uncaptured}


# ---- the table ---------------------------------------------------------------------------------

_RESULTS = ("query-64k", "query-64k-window", "doc-64k", "doc-64k-window", "long", "long-window")
# The fused ops in a whole model (plain torch: F.layer_norm, torch's flash varlen attention, ...).
# Not `query`: there eager ModernBERT is host-bound and slower than plain torch; `packedenc+graphs` wins.
_MODEL = Evidence("modernbert_h200.json", "tokens_per_s", "packedenc", "torch-packed",
                  ("doc", "long", "query-64k", "doc-64k", "long-64k"))

AUTO_CUDA: dict[str, tuple[Row, ...]] = {
    # cute: quack's LayerNorm (kernels/cute/norms.py); add_layer_norm adds with torch first (the
    # reference's rounding), so its forward is two kernels where triton's is one
    "layer_norm": (  # quack's kernel alone is faster (raw `quack` rows); the fp32 weight cast and the
        # partial-sum reduction around it cost what it saves
        Row("cute", None, why_not="measured, not faster: cute_h200.json layer_norm-64k fwd 0.114 vs 0.115 ms, "
                                  "fwd+bwd 0.552 vs 0.499 (packedenc[cute] vs packedenc[triton])"),
        Row("triton", _MODEL),
    ),
    "add_layer_norm": (  # quack: torch's add, then its LayerNorm (two kernels); the backward loses
        Row("cute", None, "inference",
            why_not="not shown faster: its win (cute_h200.json add_layer_norm-64k fwd 0.147 vs 0.242 ms) "
                    "timed one call with its host launch; on the GPU the Triton kernel takes 0.097 ms "
                    "(4.1 TB/s, norm_probe_h200.json) where this path moves 25% more bytes in two "
                    "kernels. cute_norms' fwd_stream_ms (device) and -4k (host-bound) records decide"),
        Row("triton", _MODEL),
    ),
    "varlen_attention": (
        # FA4; windowed and short: triton wins. Judged on device time: a single call also pays FA4's
        # host launch, about twice Triton's, which makes the 16k mixed pack a tie in one call and
        # doc-64k's one-call forward a win or a loss by lease (cute_h200.json; history/cute_h200_b7500e3.json)
        Row("cute", Evidence("cute_h200.json", ("fwd_device_ms", "fwd_bwd_device_ms"), "packedenc[cute]",
                             "packedenc[triton]", ("long", "doc-64k", "mixed-doc-16k", "mixed-doc-64k")),
            "long-global"),
        Row("cute", Evidence("cute_h200.json", ("fwd_device_ms", "fwd_bwd_device_ms"), "packedenc[cute]",
                             "packedenc[triton]", ("doc300-64k", "doc-64k")), "large-global"),
        Row("cute", None, "train-global",
            why_not="measured, not faster: on training-size packs FA4 wins on the device and loses a call "
                    "(cute_h200.json doc-16k fwd_bwd_device_ms 0.399 vs 0.597, fwd_bwd_ms 1.087 vs 0.693: "
                    "its host launch), so eager steps slowed (history/train_cute_h200_74b33b6.json doc 293k "
                    "vs 346k tokens/s) and graphed ones did not move (427k vs 426k: there the long-global "
                    "row already takes a bucketed doc batch)"),
        Row("triton", Evidence("attention_h200.json", "fwd_ms", "packedenc", "torch-flash", _RESULTS)),
        Row("flash", fallback=True),
    ),
    "graph_attention": (  # triton: full layers' fp16 / bf16 fused qkv; flash: the anchor-only layer and fp32
        Row("triton", Evidence("graph_h200.json", "tokens_per_s", "packedenc", "packedenc[attn=efficient]",
                               ("fwd-bf16", "train-bf16"))),
        Row("flash", Evidence("graph_h200.json", "tokens_per_s", "packed-aten-efficient", "padded-sdpa",
                              ("fwd-fp32", "train-fp32"))),
    ),
    "deberta_attention": (
        Row("triton", Evidence("deberta_h200.json", "tokens_per_s", "packedenc", "disentangled-flash",
                               ("mnli", "doc1k", "long"))),
    ),
    "linear_glu": (  # cute: one GEMM with the gate in its epilogue, inference only (its covers rule), on
        # large packs (LARGE_PACK says why not below)
        Row("cute", Evidence("ops_h200.json", "ms", "packedenc[cute]", "packedenc[triton]", ("geglu-64k",)), "large-pack"),
        # triton: one GEMM with the gate in its epilogue, eager inference only (its covers rule), on
        # the small packs where an eager batch is host-bound (SMALL_PACK says why not elsewhere); the
        # rest runs the op's parts: cuBLAS, then the gate kernel
        Row("triton", Evidence("history/linear_glu_probe_h100_5346266.json", "tokens_per_s", "packedenc[glu-gemm-n128]",
                               "packedenc[glu-parts]", ("query", "doc-b8", "doc-b16")), "small-uncaptured"),
    ),
    "layer_norm_linear_glu": (  # triton: the linear_glu GEMM normalising x's rows on their way in
        # (one launch and one (T, D) write fewer a layer), eager inference on small packs as linear_glu's row
        Row("triton", None, "small-uncaptured",
            why_not="its device time is 1.5x that of the LayerNorm kernel + fused GEMM (54.9 vs 36.2 us at 3.6k "
                    "rows, with the column sums kept), so it wins only while the host is slower than the device: "
                    "two H100 runs of one commit gave query 767k / 837k vs 758k / 802k tokens/s and doc-b8 584k / "
                    "611k vs 550k / 598k, but doc-b16 848k / 1225k vs 838k / 1398k (lost where the host was "
                    "faster), doc and graphed query lost (history/linear_glu_probe_h100_debc2a6.json, _run2)"),
    ),
    "layer_norm_linear": (  # triton: the same GEMM without the gate, normalising x's rows before Wqkv
        # (one launch fewer a layer), eager inference on small packs
        Row("triton", None, "small-uncaptured",
            why_not="its device time is 1.9x the parts' (49.6 vs 26.7 us at 3.6k rows: cuBLAS beats this GEMM "
                    "without the norm too, 37.0 us); with both norms fused, eager tokens/s vs the norm in Wi's "
                    "GEMM only: query 830k / 789k vs 767k / 837k, doc-b8 613k / 650k vs 584k / 611k, doc-b16 "
                    "924k / 1053k vs 848k / 1225k, so it loses on a host fast enough to keep up "
                    "(history/linear_glu_probe_h100_debc2a6.json, _run2)"),
    ),
    "rotary_attention": (  # RoPE inside the attention forward: eager inference, sequences <= 128 tokens.
        # One launch and one (T, H, K) write fewer per layer on the host-bound short batches; the
        # GPU pays ~14 us a layer for the in-tile rotation (2.90 vs 2.59 ms a query batch). Not in
        # a CUDA graph, where the host cost is gone and only the device's remains: the graphed query
        # batch took 2.73 vs 2.40 ms with it (history/modernbert_h200_6fe82d3_vs_cf8d4b8_query.txt)
        Row("triton", Evidence("history/modernbert_h200_4fe8f5d_query.json", "tokens_per_s", "packedenc[triton]",
                               "packedenc[triton,rope-unfused]", ("query",)), "uncaptured"),
    ),
}
DEFAULT: tuple[Row, ...] = (Row("triton", _MODEL),)


def rows(op: str) -> tuple[Row, ...]:
    return AUTO_CUDA.get(op, DEFAULT)
