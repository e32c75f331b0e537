"""Writing checkpoint files into a folder without ever destroying it.

`write_checkpoint` writes only the files it is given (weights, config.json, tokenizer files) and
touches nothing else in the folder. Each file is written to a temp file in the same folder
(`.NAME.packedenc-tmp-PID-RAND`), flushed to disk, and only when all of them are complete does a
small journal (`.packedenc-save.json`) list the swaps to come; then each temp replaces its file
with `os.replace` (atomic within a folder), weights first and config.json last, and the journal is
removed. A crash at any instant therefore leaves:
  - before the journal: the old checkpoint untouched (plus temp files, removed by the next write);
  - between two swaps: a journal that `check_complete` (called by `load`) reads to tell "nothing
    swapped yet" (the old checkpoint) and "all swapped" (the new one) apart from a half-swapped
    folder, which it reports by name instead of loading a mix;
  - after the last swap: the new checkpoint.
The next write to the folder finishes an interrupted one first (its temps are complete by then).

A folder already holding a checkpoint that packedenc did not write (no journal, no packedenc mark
in model.safetensors) is only overwritten with `overwrite=True`. One writer per folder at a time.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any, Callable

from packedenc.errors import CheckpointError

__all__ = ["write_checkpoint", "check_complete", "OWNER_KEY", "JOURNAL"]

JOURNAL = ".packedenc-save.json"
OWNER_KEY = "packedenc.saved_by"  # safetensors metadata key that marks a checkpoint packedenc wrote
_TMP = ".packedenc-tmp-"
# what makes a folder hold a checkpoint (pytorch_model*.bin is globbed as well)
_CHECKPOINT_FILES = ("config.json", "model.safetensors", "model.safetensors.index.json")
_INDEX = "model.safetensors.index.json"


def write_checkpoint(folder: Path, writers: dict[str, Callable[[Path], Any]], *, overwrite: bool = False,
                     shadows: tuple[str, ...] = ()) -> None:
    """Write each `writers[name](temp_path)` into `folder/name`, in order, without a window where the
    folder holds no checkpoint.

    Arguments:
        folder: the target folder (created if missing); other files in it are never touched.
        writers: final file name -> function writing that file's content to the path it is given.
            The first is swapped in first (the weights), the last last (config.json).
        overwrite: allow replacing a checkpoint that packedenc did not write.
        shadows: files the caller wants gone because they would hide the new ones (other tokenizer
            files); removed right after the first swap.
    """
    created = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    try:
        _prepare(folder, overwrite)
        steps = _plan(folder, list(writers), shadows)
        temps = _write_temps(folder, writers)
    except BaseException:
        if created:  # leave no empty folder behind a failed first save
            try:
                folder.rmdir()
            except OSError:
                pass
        raise
    journal = {"pid": os.getpid(),
               "steps": [[op, name, temps[name].name if op == "replace" else None] for op, name in steps]}
    try:
        _write_json_atomic(folder / JOURNAL, journal)
    except BaseException:
        for tmp in temps.values():
            tmp.unlink(missing_ok=True)
        raise
    try:
        _run_steps(folder, journal["steps"])
    except BaseException:
        try:  # an exception between swaps (Ctrl-C included): finish them; the temps are complete
            _run_steps(folder, journal["steps"])
            (folder / JOURNAL).unlink(missing_ok=True)
        except BaseException:
            pass  # the journal stays: load reports the half-swapped folder, the next write finishes it
        raise
    (folder / JOURNAL).unlink(missing_ok=True)
    _fsync(folder)


def _prepare(folder: Path, overwrite: bool) -> None:
    """Finish an interrupted save, drop stale temps, and refuse a foreign checkpoint."""
    _finish_interrupted(folder)
    _clean_stale(folder)
    found = _existing(folder)
    if found and not overwrite and not _ours(folder):
        raise CheckpointError(
            f"{folder} already holds a checkpoint that packedenc did not write ({', '.join(found)}); pass "
            "overwrite=True (--overwrite on the command line) to replace those files. Other files in the "
            "folder are kept either way"
        )


def _write_temps(folder: Path, writers: dict[str, Callable[[Path], Any]]) -> dict[str, Path]:
    """Every file's complete content in a temp beside it (all removed again if one fails)."""
    temps: dict[str, Path] = {}
    try:
        for name, write in writers.items():
            tmp = folder / f".{name}{_TMP}{os.getpid()}-{secrets.token_hex(4)}"
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))  # ours alone; fails early if read-only
            temps[name] = tmp
            write(tmp)
            _fsync(tmp)
    except BaseException:
        for tmp in temps.values():
            tmp.unlink(missing_ok=True)
        raise
    return temps


def _plan(folder: Path, names: list[str], shadows: tuple[str, ...]) -> list[tuple[str, str]]:
    """The ordered swaps and removals: weights, then what would hide them (an old sharded index,
    the caller's shadows), then the other files, config last, then the old index's shards."""
    steps = [("replace", names[0])]
    index = folder / _INDEX
    old_shards: list[str] = []
    if index.is_file() and _INDEX not in names:
        steps.append(("remove", _INDEX))
        try:
            wm = json.loads(index.read_text()).get("weight_map", {})
            old_shards = sorted({f for f in wm.values() if isinstance(f, str) and "/" not in f and f not in names})
        except (OSError, ValueError, AttributeError):
            old_shards = []  # a damaged index: its shards are left where they are
    steps += [("remove", s) for s in shadows if s not in names and (folder / s).exists()]
    steps += [("replace", n) for n in names[1:]]
    steps += [("remove", s) for s in old_shards if (folder / s).is_file()]
    return steps


def _run_steps(folder: Path, steps: list[list[Any]]) -> None:
    for op, name, tmp in steps:
        if op == "replace":
            if (folder / tmp).exists():
                os.replace(folder / tmp, folder / name)
        else:
            (folder / name).unlink(missing_ok=True)
    _fsync(folder)


def _done(folder: Path, step: list[Any]) -> bool:
    op, name, tmp = step
    return not (folder / tmp).exists() if op == "replace" else not (folder / name).exists()


def _read_journal(folder: Path) -> dict[str, Any] | None:
    path = folder / JOURNAL
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        steps = data["steps"]
        assert all(isinstance(s, list) and len(s) == 3 and s[0] in ("replace", "remove") for s in steps)
        return data
    except (OSError, ValueError, KeyError, TypeError, AssertionError) as e:
        raise CheckpointError(f"{path}, the journal of an interrupted save, is unreadable ({e}); the folder "
                              "may hold a mix of two checkpoints: save it again") from e


def check_complete(folder: Path) -> None:
    """Raise CheckpointError, naming the files, when an interrupted save left `folder` half-swapped.

    A journal whose swaps all happened (or none did) means a complete checkpoint: the new one (or
    the old one) loads as it is.
    """
    data = _read_journal(folder)
    if data is None:
        return
    steps = data["steps"]
    last = max(i for i, s in enumerate(steps) if s[0] == "replace")
    done = [_done(folder, s) for s in steps[: last + 1]]
    if all(done) or not any(done):
        return
    new = [s[1] for s, d in zip(steps, done) if s[0] == "replace" and d]
    old = [s[1] for s, d in zip(steps, done) if s[0] == "replace" and not d]
    pid = data.get("pid")
    state = "is still writing it" if isinstance(pid, int) and pid != os.getpid() and _alive(pid) else \
        "stopped between two file swaps"
    raise CheckpointError(
        f"{folder} holds a half-finished save (process {pid} {state}): "
        f"{', '.join(new)} {'is' if len(new) == 1 else 'are'} from the new save, {', '.join(old)} from the "
        "old checkpoint. Saving to this folder again finishes the interrupted save (its files are complete "
        f"in the {_TMP}* temp files); or save the params once more"
    )


def _finish_interrupted(folder: Path) -> None:
    data = _read_journal(folder)
    if data is None:
        return
    _run_steps(folder, data["steps"])
    (folder / JOURNAL).unlink(missing_ok=True)


def _clean_stale(folder: Path) -> None:
    """Remove temp files of writers that no longer run (a SIGKILL leaves them behind)."""
    for p in folder.iterdir():
        if _TMP not in p.name or not p.is_file():
            continue
        try:
            pid = int(p.name.rsplit(_TMP, 1)[1].split("-", 1)[0])
        except ValueError:
            continue
        if pid != os.getpid() and _alive(pid):
            continue  # another process is writing here right now
        p.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _existing(folder: Path) -> list[str]:
    found = [n for n in _CHECKPOINT_FILES if (folder / n).exists()]
    return found + sorted(p.name for p in folder.glob("pytorch_model*.bin"))


def _ours(folder: Path) -> bool:
    from packedenc.convert.reader import safetensors_metadata

    weights = folder / "model.safetensors"
    return weights.is_file() and OWNER_KEY in safetensors_metadata(weights)


def _fsync(path: Path) -> None:
    """Flush a file's (or a folder's entries') data to disk; a no-op where the OS refuses."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(f"{path.name}{_TMP}{os.getpid()}-{secrets.token_hex(4)}")
    try:
        tmp.write_text(json.dumps(obj) + "\n")
        _fsync(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
