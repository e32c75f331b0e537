"""Sharded, resumable embedding of a corpus: `embed_to_dir` under torchrun, then `merge`.

    torchrun --nproc_per_node 8 -m packedenc.cli embed -m MODEL -i corpus.txt --out-dir shards/
    packedenc merge shards/ vectors.npy

The input is cut into a fixed grid of chunks of `shard_size` texts (the grid depends only on the
input, never on the number of ranks, so a job stopped on 8 GPUs can finish on 2). Rank 0 reads
what is already done and the chunks still to do are split between ranks with `rank_range`; each
rank embeds its chunks with `packedenc.embed` (its own token-budget packing) and writes, per chunk:

    shard-<start>-<end>.npy   float32 (end - start, D), rows in the caller's order
    manifest-rank<r>.json     every shard rank r finished (range, shape, bytes, crc32)

Both are written to a temporary name, fsynced, then renamed, so a crash never leaves a half-written
shard that looks finished: a shard counts as done only when its file and its manifest entry exist
and agree. `job.json` holds the job's fingerprint (count and hash of the texts, model, options,
shard size); resuming with a different input is an `InputError`, never a silently mixed output.
`out_dir` must be visible to every rank (a shared file system on several nodes): checked at start.

Shapes: N texts, D output width.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import secrets
import time
import warnings
import zlib
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from packedenc.checks import as_device, float_dtype
from packedenc.train import distributed as pdist
from packedenc.errors import ConfigError, InputError
from packedenc.text.tokenizer import TruncationWarning, check_texts

__all__ = ["embed_to_dir", "merge", "ShardRun", "fingerprint"]

FORMAT = 1
SHARED_WAIT_S = 10.0  # how long a rank waits to see rank 0's files (network file systems lag)


@dataclasses.dataclass(frozen=True)
class ShardRun:
    """What one `embed_to_dir` call did (as seen by this rank).

    Fields:
        out_dir: the folder. shards: chunks in the whole job. done_before: chunks already finished
        when this run started (skipped). todo: chunks computed in this run by all ranks together.
        computed: the (start, end) ranges this rank computed.
    """

    out_dir: Path
    shards: int
    done_before: int
    todo: int
    computed: tuple[tuple[int, int], ...]


def embed_to_dir(model: Any, texts: Sequence[str], out_dir: str | os.PathLike, *, shard_size: int = 16384,
                 max_tokens: int = 65536, pooling: str | None = None, normalize: bool | None = None,
                 prompt: str | None = None, max_length: int | None = None, truncate: bool = True,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                 backend: str = "auto", progress: bool = True, model_id: str | None = None,
                 on_shard: Callable[[int, int], None] | None = None) -> ShardRun:
    """Embed `texts` into shard files under `out_dir`, skipping shards a previous run finished.

    Call it on every rank with the same full list of texts (under torchrun; a plain single process
    works too). It returns once every rank has finished, so rank 0 can `merge` right after.

    Arguments:
        model: a model folder / hub id or a `SentenceModel` (single-vector models only).
        texts: all the texts, identical on every rank; the split happens here.
        out_dir: the job folder (created); must be shared by all ranks.
        shard_size: texts per shard file. Larger shards pack better (each shard's last pack is
            partial); a crash loses at most one unfinished shard per rank.
        max_tokens, pooling, normalize, prompt, max_length, truncate, dtype, backend: as `embed`.
        device: default this rank's device (`cuda:LOCAL_RANK`, or the CPU).
        progress: a progress bar on rank 0. model_id: the model's name in the fingerprint
            (default: the model folder's name).
        on_shard: called as on_shard(start, end) after each shard is recorded (progress, tests).
    Return:
        a `ShardRun`.
    """
    from packedenc.text.embed import _as_model, _override, embed

    texts = check_texts(texts)
    if not isinstance(shard_size, int) or isinstance(shard_size, bool) or shard_size <= 0:
        raise InputError(f"shard_size must be a positive int, got {shard_size!r}")
    dev = pdist.init()
    model = _as_model(model, _rank_device(model, as_device(device), dev), float_dtype(dtype))
    if model.multi_vector:
        raise ConfigError("sharded output holds one vector per text; this is a multi-vector (ColBERT) model: "
                          "use packedenc.embed on slices of the input instead")
    _override(model, pooling, normalize)  # bad options fail now, not after the first shard
    options = dict(pooling=pooling, normalize=normalize, prompt=prompt, max_length=max_length, truncate=truncate)
    fp = fingerprint(model, texts, shard_size, options, model_id)
    out = Path(out_dir)
    chunks = [(s, min(s + shard_size, len(texts))) for s in range(0, len(texts), shard_size)]
    done = _agree_on_plan(out, fp, chunks)
    todo = [c for c in chunks if c not in done]
    mine = [todo[i] for i in pdist.rank_range(len(todo))]

    r = pdist.rank()
    manifest = out / f"manifest-rank{r}.json"
    entries = {(e["start"], e["end"]): e for e in _read_manifest(manifest, fp) if (e["start"], e["end"]) in done}
    from tqdm.auto import tqdm

    bar = tqdm(total=sum(e - s for s, e in mine), unit="text", desc=f"embed (rank {r})", leave=False,
               disable=not progress or r != 0)
    cut_shards: list[str] = []
    try:
        for s, e in mine:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", TruncationWarning)
                emb = embed(model, texts[s:e], max_tokens=max_tokens, pooling=pooling, normalize=normalize,
                            prompt=prompt, max_length=max_length, truncate=truncate, backend=backend,
                            progress=False)
            for w in caught:  # one summary at the end instead of a warning per shard
                if issubclass(w.category, TruncationWarning):
                    cut_shards.append(f"[{s}, {e}): {w.message}")
                else:
                    warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
            entries[(s, e)] = _write_shard(out, s, e, emb.numpy())
            _write_json(manifest, {"format": FORMAT, "fingerprint": fp, "rank": r,
                                   "shards": [entries[k] for k in sorted(entries)]})
            bar.update(e - s)
            if on_shard is not None:
                on_shard(s, e)
    finally:
        bar.close()
    if cut_shards:
        warnings.warn(f"rank {r}: {len(cut_shards)} of {len(mine)} shard(s) had truncated texts; first: "
                      f"{cut_shards[0]}", TruncationWarning, stacklevel=2)
    pdist.host_barrier()
    return ShardRun(out, len(chunks), len(done), len(todo), tuple(mine))


def merge(out_dir: str | os.PathLike, out_path: str | os.PathLike | None = None) -> np.ndarray:
    """The finished job's embeddings, row i for texts[i].

    Arguments:
        out_dir: a folder written by `embed_to_dir`.
        out_path: also write them to this .npy file (atomically, without holding a second copy in
            memory) and return it memory-mapped.
    Return:
        (N, D) float32 array. Raises `InputError` naming the missing ranges if the job is unfinished.
    """
    out = Path(out_dir)
    fp = _read_job(out)
    if fp is None:
        raise InputError(f"{out} holds no sharded embedding job (no job.json): run embed_to_dir / "
                         "`packedenc embed --out-dir` first")
    n, size, dim = fp["texts"]["count"], fp["shard_size"], fp["model"]["dim"]
    chunks = [(s, min(s + size, n)) for s in range(0, n, size)]
    done = _done_shards(out, fp)
    missing = [c for c in chunks if c not in done]
    if missing:
        ranges = ", ".join(f"[{s}, {e})" for s, e in missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise InputError(f"the job in {out} is unfinished: {len(missing)} of {len(chunks)} shard(s) missing "
                         f"(texts {ranges}); rerun the same embed command to compute them")
    if out_path is None:
        result = np.empty((n, dim), dtype=np.float32)
        _fill(out, chunks, done, result)
        return result
    dst = Path(out_path)
    tmp = dst.with_name(f".{dst.name}.tmp{os.getpid()}")
    try:
        mm = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float32, shape=(n, dim))
        _fill(out, chunks, done, mm)
        mm.flush()
        del mm
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)
    return np.load(dst, mmap_mode="r")


def fingerprint(model: Any, texts: Sequence[str], shard_size: int, options: dict[str, Any],
                model_id: str | None = None) -> dict[str, Any]:
    """What must not change between a job and its resumption (plain JSON)."""
    h = hashlib.sha256()
    for i in range(0, len(texts), 65536):  # lengths, then text: ["ab", "c"] and ["a", "bc"] differ
        part = texts[i:i + 65536]
        h.update(np.fromiter(map(len, part), dtype=np.int64, count=len(part)).tobytes())
        h.update("".join(part).encode("utf-8", "surrogatepass"))
    cfg = json.dumps(model.params.config.to_hf(), sort_keys=True, default=str)
    leaf = next(t for t in torch.utils._pytree.tree_leaves(model.params) if isinstance(t, torch.Tensor))
    return {
        "format": FORMAT,
        "texts": {"count": len(texts), "sha256": h.hexdigest()},
        "model": {"id": model_id or Path(model.folder).name, "config_sha256": hashlib.sha256(cfg.encode()).hexdigest(),
                  "modules": [_describe(m) for m in model.modules], "dim": model.dim,
                  "dtype": str(leaf.dtype).replace("torch.", "")},
        "options": dict(sorted(options.items())),
        "shard_size": shard_size,
    }


# ---- the plan: one view of what is done, agreed by every rank -----------------------------------


def _agree_on_plan(out: Path, fp: dict[str, Any], chunks: list[tuple[int, int]]) -> set[tuple[int, int]]:
    """Rank 0 checks / writes job.json, clears stale temporaries and reads which shards are done;
    every rank gets that one answer (so they split the same to-do list), checks that its own
    fingerprint equals rank 0's, and that it sees rank 0's files. Any rank's error ends all ranks."""
    plan: dict[str, Any] = {}
    if pdist.rank() == 0:
        try:
            nonce = secrets.token_hex(8)
            _prepare_dir(out, fp, nonce)
            plan = {"fingerprint": fp, "nonce": nonce, "done": sorted(_done_shards(out, fp))}
        except (InputError, ConfigError, OSError) as e:
            plan = {"error": _err(e)}
    plan = pdist.broadcast_object(plan)
    err = plan.get("error")
    if err is None and pdist.rank() != 0:
        try:
            if plan["fingerprint"] != fp:
                raise InputError(f"rank {pdist.rank()} got a different input than rank 0 "
                                 f"({_diff(plan['fingerprint'], fp)}): pass the same full list of texts and "
                                 "options on every rank; the split happens inside")
            _check_shared(out, plan["nonce"])
        except (InputError, ConfigError) as e:
            err = _err(e)
    errors = [e for e in pdist.all_gather_objects(err) if e is not None]
    if errors:
        kind, msg = errors[0]
        raise (InputError if kind == "InputError" else ConfigError)(msg)
    return {tuple(c) for c in plan["done"]}


def _prepare_dir(out: Path, fp: dict[str, Any], nonce: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    old = _read_job(out)
    if old is not None and old != fp:
        raise InputError(f"{out} holds a different job ({_diff(old, fp)}); resuming would mix two inputs. "
                         "Pass the same texts, model and options to resume, or use a new (or emptied) out_dir")
    if old is None:
        _write_json(out / "job.json", {"format": FORMAT, "fingerprint": fp})
    for tmp in out.glob(".*.tmp*"):  # half-written files of a crashed run; no rank writes yet
        tmp.unlink(missing_ok=True)
    _write_json(out / ".run.json", {"nonce": nonce})


def _check_shared(out: Path, nonce: str) -> None:
    deadline = time.monotonic() + SHARED_WAIT_S
    while True:
        try:
            if json.loads((out / ".run.json").read_text())["nonce"] == nonce:
                return
        except (OSError, ValueError, KeyError):
            pass
        if time.monotonic() > deadline:
            raise ConfigError(f"rank {pdist.rank()} does not see rank 0's files in {out}: out_dir must be on a file "
                              "system shared by every rank (or run one job per node with its own input)")
        time.sleep(0.2)


def _done_shards(out: Path, fp: dict[str, Any]) -> dict[tuple[int, int], dict[str, Any]]:
    """Shards whose manifest entry (any rank's) matches a complete file of the right shape."""
    done: dict[tuple[int, int], dict[str, Any]] = {}
    for manifest in sorted(out.glob("manifest-rank*.json")):
        for e in _read_manifest(manifest, fp):
            key = (e["start"], e["end"])
            if key not in done and _valid(out, e, fp["model"]["dim"]):
                done[key] = e
    return done


def _read_manifest(path: Path, fp: dict[str, Any]) -> list[dict[str, Any]]:
    try:
        m = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    return m.get("shards", []) if m.get("fingerprint") == fp else []


def _valid(out: Path, e: dict[str, Any], dim: int) -> bool:
    p = out / e["file"]
    try:
        if p.stat().st_size != e["bytes"]:
            return False
        a = np.load(p, mmap_mode="r")
    except (OSError, ValueError):
        return False
    return a.dtype == np.float32 and a.shape == (e["end"] - e["start"], dim)


def _read_job(out: Path) -> dict[str, Any] | None:
    try:
        return json.loads((out / "job.json").read_text())["fingerprint"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError) as e:
        raise InputError(f"{out / 'job.json'} is unreadable ({e}): delete the folder and start again") from None


def _fill(out: Path, chunks: list[tuple[int, int]], done: dict[tuple[int, int], dict[str, Any]],
          dst: np.ndarray) -> None:
    for s, e in chunks:
        a = np.load(out / done[(s, e)]["file"])
        if zlib.crc32(a.tobytes()) != done[(s, e)]["crc32"]:
            raise InputError(f"{out / done[(s, e)]['file']} does not match its checksum (the file changed after "
                             "it was written): delete it and rerun the embed command to recompute it")
        dst[s:e] = a


# ---- files and collectives ----------------------------------------------------------------------


def _write_shard(out: Path, s: int, e: int, emb_ND: np.ndarray) -> dict[str, Any]:
    name = f"shard-{s}-{e}.npy"
    _atomic(out / name, lambda f: np.save(f, np.ascontiguousarray(emb_ND, dtype=np.float32)))
    return {"start": s, "end": e, "file": name, "rows": e - s, "dim": int(emb_ND.shape[1]),
            "bytes": (out / name).stat().st_size, "crc32": zlib.crc32(emb_ND.astype(np.float32).tobytes())}


def _write_json(path: Path, obj: Any) -> None:
    _atomic(path, lambda f: f.write(json.dumps(obj, indent=1).encode()))


def _atomic(path: Path, write: Callable[[Any], Any]) -> None:
    """Temporary name in the same folder, fsync, rename: readers see the old file or the new one."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


# ---- small helpers ------------------------------------------------------------------------------


def _rank_device(model: Any, device: torch.device | str | None, rank_device: torch.device
                 ) -> torch.device | str | None:
    """One process per GPU: a bare "cuda" means this rank's GPU; so does no device for a model
    folder, or for a loaded model that sits on another rank's GPU. Otherwise the caller's choice."""
    if device is not None:
        return rank_device if str(device) == "cuda" and pdist.is_initialized() else device
    if isinstance(model, (str, os.PathLike)):
        return rank_device
    d = getattr(model, "device", None)  # anything else: _as_model raises the TypeError
    on_other_gpu = isinstance(d, torch.device) and d.type == "cuda" and d != rank_device
    return rank_device if on_other_gpu and pdist.is_initialized() else None


def _describe(m: Any) -> str:
    name = type(m).__name__
    if hasattr(m, "modes"):
        return f"{name}({'+'.join(m.modes)})"
    return name


def _short(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 40 else r[:16] + "..."


def _err(e: BaseException) -> tuple[str, str]:
    return ("InputError" if isinstance(e, InputError) else "ConfigError", str(e) if not isinstance(e, OSError)
            else f"cannot use {getattr(e, 'filename', '') or 'out_dir'}: {e.strerror or e}")


def _diff(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> str:
    """The first fields that differ, e.g. 'texts.count: 40 then 41'."""
    out = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            sub = _diff(a, b, f"{prefix}{k}.")
            if sub:
                out.append(sub)
        elif a != b:
            out.append(f"{prefix}{k}: {_short(a)} then {_short(b)}")
    return "; ".join(out[:3])
