"""The README's performance tables and the charts, drawn from one commit's records: `report`.

    python -m benchmarks report                          # Markdown on stdout; refuses to mix commits
    python -m benchmarks report --commit 1a2b3c4         # only that commit's records
    python -m benchmarks report --readme README.md       # write between the two marker lines
    python -m benchmarks report --mixed                  # each family at its newest commit, said in its header
    python -m benchmarks report --charts benchmarks/results --targets
    python -m benchmarks report --merge gpu_out          # first fold a GPU session's records into results

Reads `<results>/<family>_<gpu>.json` (never the `_quick` / `_tiny` files). Each family's table
names its GPU, commit, versions and command, so a figure can be traced to the run that made it.
In the README the tables go between `<!-- benchmarks:begin -->` and `<!-- benchmarks:end -->`.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from pathlib import Path
from typing import Any, Callable

from benchmarks import targets
from benchmarks.records import (RESULTS_DIR, cell_text, gpu_slug, host_device_cell, load_records, ok, rate_cell,
                                replace_text, write_records)

BEGIN, END = "<!-- benchmarks:begin -->", "<!-- benchmarks:end -->"


class ReportError(Exception):
    """What stops a report (mixed commits, no records, no markers): printed, exit code 2."""


@dataclasses.dataclass(frozen=True)
class View:
    title: str
    unit: str
    cell: Callable[[dict[str, Any]], str] = rate_cell
    rows: tuple[str, ...] = ("system",)
    col: str = "workload"
    metric: str = "tokens_per_s"  # what the chart shows
    host_device: bool = False  # a second table: host / device ms per batch
    split: str | None = None  # one table per value of this field (models with their own workloads)


def _latency_or_rate(r: dict[str, Any]) -> str:
    if r.get("workload") == "long" and r.get("ms_per_batch") is not None:  # one sequence: its latency
        mem = r.get("peak_allocated_gb")
        return f"{r['ms_per_batch']:.1f} ms" + ("" if mem is None else f", {mem:.2f} GiB peak")
    return rate_cell(r)


def _millions(r: dict[str, Any]) -> str:
    mem = r.get("peak_reserved_gb")
    return f"{r['tokens_per_s'] / 1e6:.3f}M" + ("" if mem is None else f" ({mem:.1f} GB)")


VIEWS: dict[str, View] = {
    "modernbert": View("ModernBERT-base inference (random weights, bf16)", "real tokens/s (peak reserved GB)",
                       host_device=True),
    "deberta": View("DeBERTa-v3-base inference (random weights, fp16)",
                    "real tokens/s (peak reserved GB); long: latency of one 8192-token sequence",
                    _latency_or_rate, host_device=True),
    "bert": View("BERT-base inference (random weights, bf16)", "real tokens/s (peak reserved GB)", host_device=True),
    "train": View("Training step: MLM forward + backward + AdamW (bf16 compute, fp32 master weights)",
                  "real tokens/s (peak reserved GB)", host_device=True, split="model"),
    "embed": View("Texts to embeddings, all-MiniLM-L6-v2", "texts/s",
                  lambda r: f"{r['texts_per_s'] / 1e3:,.1f}k", metric="texts_per_s"),
    "graph": View("Graph transformer (GiGL's math)", "M real tokens/s (peak reserved GB)", _millions),
    "attention": View("Varlen attention, bf16, 12 heads x 64", "ms forward / forward + backward",
                      lambda r: f"{r['fwd_ms']:.2f} / {r['fwd_bwd_ms']:.2f}", metric="fwd_bwd_ms"),
    "distributed": View("Data parallel, ModernBERT-base", "real tokens/s (scaling over one GPU)",
                        lambda r: f"{r['tokens_per_s'] / 1e3:,.0f}k ({r['scaling']:.2f}x)", rows=("system", "workload"),
                        col="gpus"),
    "ops": View("Fused ops alone", "device time per call", lambda r: f"{r['device_ms'] * 1e3:.1f} us",
                rows=("workload",), col="system", metric="device_ms"),
}
# Micro-benchmarks stay out of the README; so does data-parallel scaling, which needs a machine of
# several GPUs and so cannot come from the single-GPU session that makes the rest of the table.
DEFAULT_FAMILIES = tuple(f for f in VIEWS if f not in ("ops", "distributed"))


# ---- which records --------------------------------------------------------------------------------


def load(results: Path, gpu: str | None, families: tuple[str, ...]) -> tuple[str, dict[str, list[dict[str, Any]]]]:
    """(gpu slug, family -> records) of `<family>_<gpu>.json` files under `results`."""
    files = {m.group(1, 2): p for p in sorted(Path(results).glob("*.json"))
             if (m := re.fullmatch(r"([a-z0-9]+)_([a-z0-9-]+)\.json", p.name)) and m.group(1) in families
             and not m.group(2).endswith(("-quick", "-tiny"))}
    slugs = sorted({g for _, g in files})
    if gpu is None and len(slugs) > 1:
        raise ReportError(f"records for several GPUs ({', '.join(slugs)}) in {results}: pick one with --gpu")
    slug = gpu_slug(gpu) if gpu else (slugs[0] if slugs else "")
    out = {f: load_records(files[(f, slug)]) for f in families if (f, slug) in files}
    if not out:
        raise ReportError(f"no records for {', '.join(families)} on {slug or 'any GPU'} in {results}")
    return slug, out


def merge(src: Path, results: Path) -> None:
    """Fold `src/<family>_<gpu>.json` files into `results`, record by record (`write_records`)."""
    files = [p for p in sorted(Path(src).glob("*.json")) if re.fullmatch(r"[a-z0-9]+_[a-z0-9-]+\.json", p.name)]
    if not files:
        raise ReportError(f"no <family>_<gpu>.json records in {src}")
    for p in files:
        write_records(load_records(p), Path(results) / p.name)
        print(f"merged {p.name}", file=sys.stderr)


def _commits(records: list[dict[str, Any]]) -> list[str]:
    """Distinct commits, newest last (by record date; file order for records without one)."""
    order = sorted(range(len(records)), key=lambda i: (records[i].get("date") or "", i))
    return list(dict.fromkeys(str(records[i].get("commit")) for i in order))


def pick(by_family: dict[str, list[dict[str, Any]]], commit: str | None,
         mixed: bool) -> dict[str, list[dict[str, Any]]]:
    """The records the report shows: one commit for every family, unless `mixed`."""
    if commit:
        out = {f: [r for r in rs if str(r.get("commit")).startswith(commit)] for f, rs in by_family.items()}
        out = {f: rs for f, rs in out.items() if rs}
        if not out:
            raise ReportError(f"no records of commit {commit}; commits here: " + _listing(by_family))
        return out
    if mixed:
        return {f: [r for r in rs if str(r.get("commit")) == _commits(rs)[-1]] for f, rs in by_family.items()}
    every = {c for rs in by_family.values() for c in _commits(rs)}
    if len(every) > 1:
        raise ReportError("the records come from several commits: " + _listing(by_family)
                          + "; pass --commit C for one commit's records, or --mixed to show each family's newest")
    return by_family


def _listing(by_family: dict[str, list[dict[str, Any]]]) -> str:
    return "; ".join(f"{f}: " + ", ".join(f"{c} ({sum(str(r.get('commit')) == c for r in rs)})" for c in _commits(rs))
                     for f, rs in by_family.items())


# ---- Markdown -------------------------------------------------------------------------------------


def markdown_table(records: list[dict[str, Any]], cell: Callable[[dict[str, Any]], str], rows: tuple[str, ...],
                   col: str) -> list[str]:
    """Rows by `rows` fields, a column per `col` value; rows whose records were all skipped are left out."""
    keys = list(dict.fromkeys(tuple(r.get(k) for k in rows) for r in records))
    keys = [k for k in keys if any(r.get("status") != "skipped" for r in records
                                   if tuple(r.get(f) for f in rows) == k)]
    cols = list(dict.fromkeys(r.get(col) for r in records))
    at = {(tuple(r.get(k) for k in rows), r.get(col)): r for r in records}
    lines = ["| " + " | ".join([*rows, *map(str, cols)]) + " |", "|" + "---|" * (len(rows) + len(cols))]
    for k in keys:
        cells = [cell_text(at.get((k, c)), cell) or "-" for c in cols]
        lines.append("| " + " | ".join([*map(str, k), *cells]) + " |")
    return lines


def section(family: str, records: list[dict[str, Any]], with_targets: bool) -> list[str]:
    view = VIEWS.get(family, View(family, "tokens/s"))
    first = records[0]
    commits = ", ".join(_commits(records))
    versions = ", ".join(f"{k} {first[k]}" for k in ("torch", "triton", "transformers") if first.get(k))
    commands = "; ".join(f"`{c}`" for c in dict.fromkeys(str(r.get("command") or "command not recorded")
                                                          for r in records))
    out = [f"### {view.title}", "", f"{first.get('gpu')}, commit {commits}, {versions}: {commands}. {view.unit}:"]
    parts = {None: records} if view.split is None else \
        {v: [r for r in records if r.get(view.split) == v] for v in dict.fromkeys(r.get(view.split) for r in records)}
    for name, part in parts.items():
        out += [""] + ([f"{name}:", ""] if name is not None else [])
        out += markdown_table(part, view.cell, view.rows, view.col)
    hd = [r for r in records if r.get("host_ms") is not None]
    if view.host_device and hd:
        out += ["", "Host enqueue / device ms per batch (host above device: the batch is host-bound):", ""]
        out += markdown_table(hd, host_device_cell, (view.split, *view.rows) if view.split else view.rows, view.col)
    if with_targets:
        lines = targets.report(family, records)
        out += ["", "Targets:", ""] + [f"- {x}" for x in lines] if lines else []
    return out + [""]


def render(chosen: dict[str, list[dict[str, Any]]], with_targets: bool = False) -> str:
    return "\n".join(line for f, rs in chosen.items() for line in section(f, rs, with_targets)).rstrip() + "\n"


def write_between_markers(path: Path, text: str) -> None:
    doc = Path(path).read_text()
    if doc.count(BEGIN) != 1 or doc.count(END) != 1 or doc.index(BEGIN) > doc.index(END):
        raise ReportError(f"{path} needs one '{BEGIN}' line and, after it, one '{END}' line where the tables go")
    head, rest = doc.split(BEGIN)
    replace_text(Path(path), head + BEGIN + "\n" + text + END + rest.split(END, 1)[1])


# ---- charts ---------------------------------------------------------------------------------------


def chart(family: str, records: list[dict[str, Any]], path: Path) -> Path | None:
    """Grouped bars of the view's metric: columns across, one bar per row. None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    view = VIEWS.get(family, View(family, "tokens/s"))
    label = lambda r: " ".join(str(r.get(k)) for k in view.rows)  # noqa: E731
    bars = list(dict.fromkeys(label(r) for r in records if ok(r)))
    cols = list(dict.fromkeys(r.get(view.col) for r in records))
    val = {(label(r), r.get(view.col)): r.get(view.metric) for r in records if ok(r)}
    width = 0.8 / max(1, len(bars))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(cols) + 2), 4.5))
    for k, b in enumerate(bars):
        xs = [i + (k - (len(bars) - 1) / 2) * width for i in range(len(cols))]
        ax.bar(xs, [val.get((b, c)) or 0 for c in cols], width, label=b)
    ax.set_xticks(range(len(cols)), [str(c) for c in cols], fontsize=7)
    ax.set_ylabel(view.metric)
    ax.set_title(f"{view.title}: {records[0].get('gpu')}, commit {', '.join(_commits(records))}", fontsize=8)
    ax.legend(fontsize=6)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return Path(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks report", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", type=Path, default=RESULTS_DIR)
    ap.add_argument("--gpu", help="which GPU's records (default: the only one there)")
    ap.add_argument("--families", nargs="*", choices=sorted(VIEWS), help=f"default: {' '.join(DEFAULT_FAMILIES)}")
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--commit", help="only this commit's records (a prefix is enough)")
    which.add_argument("--mixed", action="store_true", help="each family at its newest commit")
    ap.add_argument("--readme", type=Path, help="write the tables between the markers of this file")
    ap.add_argument("--charts", type=Path, help="also draw <family>_<gpu>.png here (needs matplotlib)")
    ap.add_argument("--targets", action="store_true", help="list each family's targets under its table")
    ap.add_argument("--merge", type=Path, help="first fold the records of this folder (a GPU session's $OUT) "
                                               "into --results, replacing those with the same key")
    args = ap.parse_args(argv)
    try:
        if args.merge:
            merge(args.merge, args.results)
        slug, by_family = load(args.results, args.gpu, tuple(args.families or DEFAULT_FAMILIES))
        chosen = pick(by_family, args.commit, args.mixed)
        text = render(chosen, args.targets)
        if args.readme:
            write_between_markers(args.readme, text)
            print(f"wrote {len(chosen)} table(s) into {args.readme}")
        else:
            print(text, end="")
    except ReportError as e:
        print(f"report: {e}", file=sys.stderr)
        return 2
    for f, rs in chosen.items() if args.charts else ():
        png = chart(f, rs, args.charts / f"{f}_{slug}.png")
        print(f"wrote {png}" if png else f"note: matplotlib is not installed; no chart for {f}", file=sys.stderr)
    return 0
