"""Benchmark records and their presentation: JSON files, the printed table, the PNG chart.

A record is a dict with `system`, `workload`, `tokens_per_s`, `peak_reserved_gb`, `gpu`, `commit`
(None where a system was skipped or failed, with `status` and `error` saying why), plus extras.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import torch


# ---- records, files, table, chart ---------------------------------------------------------------


def make_record(system: str, workload: str, tokens_per_s: float | None, peak_reserved_gb: float | None,
                *, gpu: str, commit: str, **extra: Any) -> dict[str, Any]:
    """One JSON record: the fields every benchmark writes, then any extras."""
    rec = {"system": system, "workload": workload, "tokens_per_s": tokens_per_s,
           "peak_reserved_gb": peak_reserved_gb, "gpu": gpu, "commit": commit}
    rec.update(extra)
    return rec


def gpu_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def gpu_slug(name: str) -> str:
    """'NVIDIA H200' -> 'h200' (file-name part of the results)."""
    s = re.sub(r"^nvidia\s+", "", name.strip(), flags=re.I).lower()
    return re.sub(r"[^a-z0-9]+", "-", s).strip("-") or "unknown"


def git_commit() -> str:
    """Short commit of the repo, with '-dirty' when tracked files differ from it.

    GIT_COMMIT, when set, wins: a snapshot (`git archive`) run inside another checkout would
    otherwise report the enclosing repository's commit.
    """
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    root = Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("GIT_COMMIT", "unknown")


def environment(device: torch.device) -> dict[str, Any]:
    """Versions and device facts printed at the top of a run (and stored with the records)."""
    env: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": gpu_name(device)}
    for mod in ("triton", "transformers"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - absent or broken: say so
            env[mod] = None
    if device.type == "cuda":
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability(device)))
    return env


def write_records(records: list[dict[str, Any]], path: Path) -> list[dict[str, Any]]:
    """Write `records` to `path`, keeping earlier records of (system, workload) pairs not rerun."""
    path.parent.mkdir(parents=True, exist_ok=True)
    new = {(r["system"], r["workload"]) for r in records}
    old: list[dict[str, Any]] = []
    if path.exists():
        try:
            old = [r for r in json.loads(path.read_text()) if (r["system"], r["workload"]) not in new]
        except (json.JSONDecodeError, KeyError, TypeError):
            print(f"note: {path} was not a list of records; overwriting it")
    merged = old + list(records)
    path.write_text(json.dumps(merged, indent=1) + "\n")
    if old:
        print(f"note: kept {len(old)} earlier record(s) in {path} for pairs not rerun now")
    return merged


def format_table(records: list[dict[str, Any]], cos: dict[str, float | None] | None = None) -> str:
    """Systems down, workloads across: k tokens/s and peak reserved GB (or skipped / FAILED)."""
    systems = list(dict.fromkeys(r["system"] for r in records))
    workloads = list(dict.fromkeys(r["workload"] for r in records))
    cell = {(r["system"], r["workload"]): r for r in records}
    head = ["system"] + workloads + (["min cos"] if cos else [])
    rows = [head]
    for s in systems:
        row = [s]
        for w in workloads:
            r = cell.get((s, w))
            if r is None:
                row.append("")
            elif r.get("status") == "skipped":
                row.append("skipped")
            elif r["tokens_per_s"] is None:
                row.append("FAILED")
            else:
                mem = "" if r["peak_reserved_gb"] is None else f" ({r['peak_reserved_gb']:.1f} GB)"
                row.append(f"{r['tokens_per_s'] / 1e3:,.0f}k{mem}")
        if cos:
            c = cos.get(s)
            row.append("n/a" if c is None else f"{c:.5f}")
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    failed: dict[tuple[str, str], list[str]] = {}  # one line per (system, error), not per workload
    for r in records:
        if r.get("status") == "failed":
            failed.setdefault((r["system"], str(r.get("error"))), []).append(r["workload"])
    lines += [f"FAILED {s} ({', '.join(ws)}): {err}" for (s, err), ws in failed.items()]
    return "\n".join(lines)


def plot(records: list[dict[str, Any]], path: Path, title: str) -> Path | None:
    """Grouped bar chart of real tokens/s (workloads across, one bar per system). Needs matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed; skipping the chart (pip install matplotlib)")
        return None
    systems = list(dict.fromkeys(r["system"] for r in records))
    workloads = list(dict.fromkeys(r["workload"] for r in records))
    cell = {(r["system"], r["workload"]): r.get("tokens_per_s") for r in records}
    skipped = {(r["system"], r["workload"]) for r in records if r.get("status") == "skipped"}
    width = 0.8 / max(1, len(systems))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(workloads) + 2), 4.5))
    for k, s in enumerate(systems):
        xs = [i + (k - (len(systems) - 1) / 2) * width for i in range(len(workloads))]
        ys = [(cell.get((s, w)) or 0) / 1e3 for w in workloads]
        bars = ax.bar(xs, ys, width, label=s)
        for b, y, w in zip(bars, ys, workloads):
            status = "" if y > 0 else ("skip" if (s, w) in skipped else "fail" if (s, w) in cell else "")
            ax.annotate(f"{y:,.0f}" if y > 0 else status, (b.get_x() + b.get_width() / 2, y), ha="center",
                        va="bottom", fontsize=6, rotation=90, xytext=(0, 2), textcoords="offset points")
    ax.set_xticks(range(len(workloads)), workloads)
    ax.set_ylabel("real tokens/s (thousands)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    ax.margins(y=0.15)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path
