"""Output side of the `packedenc` command: atomic file writes (.npy / .npz / .jsonl) and the
similarity table / query ranking printed to the terminal. Arguments and commands: `cli.py`."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from packedenc.commands.errors import OutputError

__all__ = ["OutputError", "_write_atomic", "_save", "_print_similarities", "_print_ranking"]


def _write_atomic(path: str, write: Any) -> None:
    """Write via a temporary file in the same folder, then rename: no partial file on failure, and
    an OSError (read-only folder, disk full) becomes an OutputError naming the file."""
    p = Path(path).resolve()
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp" + p.suffix, dir=p.parent)
        os.close(fd)
        write(tmp)
        os.replace(tmp, p)
    except BaseException as e:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise OutputError(f"cannot write {path}: {e.strerror or e}") from None
        raise


def _save(path: str, texts: list[str], out: Any) -> None:
    import numpy as np

    from packedenc.text.embed import TokenEmbeddings

    suffix = Path(path).suffix
    if isinstance(out, TokenEmbeddings):
        if suffix == ".npz":
            def write_npz(t: str) -> None:
                with open(t, "wb") as f:
                    np.savez(f, values=out.values.numpy(), cu_seqlens=out.cu_seqlens.numpy())

            _write_atomic(path, write_npz)
            return
        rows = [{"text": t, "embeddings": e.tolist()} for t, e in zip(texts, out.unpack())]
    else:
        if suffix == ".npy":
            def write_npy(t: str) -> None:
                with open(t, "wb") as f:
                    np.save(f, out.numpy())

            _write_atomic(path, write_npy)
            return
        rows = [{"text": t, "embedding": e.tolist()} for t, e in zip(texts, out)]

    def write(t: str) -> None:
        with open(t, "w", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")

    _write_atomic(path, write)


def _short(text: str, n: int = 40) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 1] + "…"


def _print_similarities(texts: list[str], emb: Any) -> None:
    import torch

    e = torch.nn.functional.normalize(emb, dim=1)
    sim = e @ e.T
    w = min(40, max(len(_short(t)) for t in texts))
    print(f"\ncosine similarity ({len(texts)} texts):")
    print(" " * (w + 5) + "".join(f"{j:>7}" for j in range(len(texts))))
    for i, t in enumerate(texts):
        print(f"[{i:>2}] {_short(t, w):<{w}}" + "".join(f"{float(s):7.3f}" for s in sim[i]))
    if len(texts) > 1:
        off = sim - 2 * torch.eye(len(texts))
        i, j = divmod(int(off.argmax()), len(texts))
        print(f"\nmost similar pair: [{i}] and [{j}] (cosine {float(sim[i, j]):.3f})")


def _print_ranking(query: str, texts: list[str], q: Any, emb: Any) -> None:
    import torch

    scores = torch.nn.functional.normalize(emb, dim=1) @ torch.nn.functional.normalize(q, dim=1)[0]
    print(f"\nquery: {query}")
    for rank, i in enumerate(scores.argsort(descending=True).tolist(), 1):
        print(f"{rank:>3}. {float(scores[i]):.3f}  {_short(texts[i], 70)}")
