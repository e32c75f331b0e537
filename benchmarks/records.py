"""Benchmark records: what each one holds, the files they live in, and the printed table.

A record is a flat JSON object for one (system, workload) of one run (plus `model` where a family
runs several models, `gpus` where it runs several GPU counts):
- what ran: `family`, `model`, `system`, `workload`, `status` ("ok", "skipped", "absent": an
  optional package is not installed, "failed") and `error` (why, for anything but "ok");
- the metrics, named by unit: `tokens_per_s` (real, unpadded tokens), `texts_per_s`,
  `ms_per_batch` / `step_ms` (wall time per batch), `host_ms` / `device_ms` (host enqueue time and
  GPU time of one batch, `common.host_device_ms`; the embed family's are of one whole call, see
  `benchmarks/embed.py`), `peak_reserved_gb`, and family extras;
- where and how: `gpu`, `commit`, `command`, `date`, `torch`, `triton`, `transformers`, `cuda`.

Files: `results/<family>_<gpu>.json` holds one JSON list. A run replaces the records with its
keys (`record_key`) and keeps the others, so a partial rerun updates its own rows; every record
names its commit, and the README table is drawn from one commit's (`benchmarks/report.py`).
Reduced runs (`--quick`, `--tiny`) go to `<family>_<gpu>_quick.json` / `_tiny.json`.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"
STATUSES = ("ok", "skipped", "absent", "failed")
KEY_FIELDS = ("model", "system", "workload", "gpus")  # what makes two records "the same row"


# ---- the facts of one run -----------------------------------------------------------------------


def gpu_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def gpu_slug(name: str) -> str:
    """'NVIDIA H200' -> 'h200' (the file-name part of a GPU)."""
    s = re.sub(r"^nvidia\s+", "", name.strip(), flags=re.I).lower()
    return re.sub(r"[^a-z0-9]+", "-", s).strip("-") or "unknown"


def git_commit() -> str:
    """Short commit of the repository, '-dirty' when tracked files differ from it.

    GIT_COMMIT, when set, wins: a snapshot (`git archive`) run inside another checkout would
    otherwise report the enclosing repository's commit.
    """
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    root = Path(__file__).resolve().parent.parent
    try:
        git = lambda *a: subprocess.run(["git", *a], cwd=root, capture_output=True, text=True,  # noqa: E731
                                        check=True).stdout.strip()
        sha = git("rev-parse", "--short=12", "HEAD")
        return sha + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def environment(device: torch.device) -> dict[str, Any]:
    """Versions and device facts, stored with every record of a run."""
    env: dict[str, Any] = {"gpu": gpu_name(device), "torch": torch.__version__, "cuda": torch.version.cuda}
    for mod in ("triton", "transformers"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - absent or broken: say so
            env[mod] = None
    if device.type == "cuda":
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability(device)))
    return env


@dataclasses.dataclass
class Run:
    """One invocation of a family: the facts every record of it carries."""

    family: str
    device: torch.device
    command: str
    commit: str
    env: dict[str, Any]
    date: str

    @classmethod
    def start(cls, family: str, device: torch.device, argv: Iterable[str], gpu: str | None = None) -> "Run":
        """The run's facts, printed; `gpu` names the GPU when this process does not use it."""
        cmd = f"python -m benchmarks {family} " + " ".join(shlex.quote(a) for a in argv)
        date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        env = {**environment(device), **({"gpu": gpu} if gpu else {})}
        run = cls(family, device, cmd.strip(), git_commit(), env, date)
        print(f"command: {run.command}")
        print("environment: " + ", ".join(f"{k}={v}" for k, v in run.env.items()) + f", commit={run.commit}")
        return run

    @property
    def gpu(self) -> str:
        return self.env["gpu"]

    def meta(self) -> dict[str, Any]:
        return {"family": self.family, "gpu": self.gpu, "commit": self.commit, "command": self.command,
                "date": self.date, **{k: self.env.get(k) for k in ("torch", "triton", "transformers", "cuda")}}

    def record(self, system: str, workload: str, status: str = "ok", **fields: Any) -> dict[str, Any]:
        return make_record(system, workload, status, **{**self.meta(), **fields})

    def path(self, out_dir: Path, suffix: str = "") -> Path:
        return Path(out_dir) / f"{self.family}_{gpu_slug(self.gpu)}{suffix}.json"


def make_record(system: str, workload: str, status: str = "ok", *, error: str | None = None,
                **fields: Any) -> dict[str, Any]:
    """One record: the identifying fields first, then metrics and facts."""
    assert status in STATUSES, status
    return {"system": system, "workload": workload, "status": status, "error": error, **fields}


def ok(rec: dict[str, Any] | None) -> bool:
    return rec is not None and rec.get("status", "ok") == "ok"


# ---- files --------------------------------------------------------------------------------------


def record_key(rec: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(rec.get(k) for k in KEY_FIELDS)


def load_records(path: Path) -> list[dict[str, Any]]:
    """The records of one results file; `family` defaults to the file name's first part.

    A file may also be an object whose "records" list holds them, with the run's facts (gpu,
    commit, command, ...) beside it: those fill the records' missing fields."""
    data = json.loads(Path(path).read_text())
    if isinstance(data, dict) and isinstance(data.get("records"), list):
        facts = {k: v for k, v in data.items() if not isinstance(v, (list, dict))}
        data = [{**facts, **r} if isinstance(r, dict) else r for r in data["records"]]
    if not isinstance(data, list) or not all(isinstance(r, dict) and "system" in r and "workload" in r
                                             for r in data):
        raise ValueError(f"{path} is not a list of benchmark records (objects with system and workload)")
    family = Path(path).stem.split("_")[0]
    for r in data:
        r.setdefault("family", family)
        r.setdefault("status", "ok" if r.get("error") is None else "failed")
        if r["status"] not in STATUSES:  # older files wrote "oom" / "error"
            r["status"] = "failed"
    return data


def replace_text(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file in the same folder and a rename: a crash
    at any instant leaves the old file or the new one, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_records(records: list[dict[str, Any]], path: Path) -> list[dict[str, Any]]:
    """Write `records` to `path`, replacing earlier records with the same key, keeping the rest."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    new = {record_key(r) for r in records}
    old: list[dict[str, Any]] = []
    if path.exists():
        try:
            old = [r for r in load_records(path) if record_key(r) not in new]
        except (ValueError, json.JSONDecodeError) as e:
            print(f"note: {e}; overwriting it")
    merged = old + list(records)
    replace_text(path, json.dumps(merged, indent=1) + "\n")
    if old:
        print(f"note: kept {len(old)} earlier record(s) in {path} for rows not rerun now")
    return merged


# ---- the printed table --------------------------------------------------------------------------


def cell_text(rec: dict[str, Any] | None, fmt: Callable[[dict[str, Any]], str]) -> str:
    """A table cell: `fmt(rec)` for an ok record, else its status."""
    if rec is None:
        return ""
    if not ok(rec):
        return "FAILED" if rec.get("status") == "failed" else str(rec.get("status"))
    try:
        return fmt(rec)
    except (KeyError, TypeError, ValueError):  # a metric this record does not have
        return "-"


def columns(rows: list[list[str]], sep: str = "  ") -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [sep.join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, sep.join("-" * w for w in widths))
    return lines


def format_table(records: list[dict[str, Any]], fmt: Callable[[dict[str, Any]], str],
                 rows: tuple[str, ...] = ("system",), col: str = "workload") -> str:
    """Rows by `rows` fields, a column per `col` value, `fmt` in each cell; failures listed below."""
    row_keys = list(dict.fromkeys(tuple(r.get(k) for k in rows) for r in records))
    cols = list(dict.fromkeys(r.get(col) for r in records))
    cell = {(tuple(r.get(k) for k in rows), r.get(col)): r for r in records}
    table = [[*rows, *map(str, cols)]]
    table += [[*map(str, rk), *(cell_text(cell.get((rk, c)), fmt) for c in cols)] for rk in row_keys]
    lines = columns(table)
    failed: dict[tuple[str, str], list[str]] = {}  # one line per (system, error), not per workload
    for r in records:
        if r.get("status") == "failed":
            failed.setdefault((r["system"], str(r.get("error"))), []).append(str(r.get(col)))
    lines += [f"FAILED {s} ({', '.join(ws)}): {err}" for (s, err), ws in failed.items()]
    return "\n".join(lines)


def thousands(v: float) -> str:
    """1234567 -> '1,235k', 12345 -> '12.3k'; small rates (CPU smoke runs): 9.391 -> '9.39'."""
    if v >= 1e5:
        return f"{v / 1e3:,.0f}k"
    return f"{v / 1e3:.3g}k" if v >= 1e3 else f"{v:.3g}"


def rate_cell(rec: dict[str, Any], key: str = "tokens_per_s") -> str:
    """'1,234k (1.2 GB)': thousands per second and peak reserved memory where measured."""
    mem = rec.get("peak_reserved_gb")
    return thousands(rec[key]) + ("" if mem is None else f" ({mem:.1f} GB)")


def host_device_cell(rec: dict[str, Any]) -> str:
    """'12.3 / 4.5': host enqueue ms / device ms of one batch ('-' where not measured)."""
    h, d = rec.get("host_ms"), rec.get("device_ms")
    f = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    return f"{f(h)} / {f(d)}"
