"""Byte-level BPE tokenizers (GPT-2's pre-tokenizer: ModernBERT, Ettin, gte-modernbert, RoBERTa) on ASCII texts.

A byte-level BPE tokenizer splits a text with GPT-2's regex (contractions, a letter run, a digit
run or a punctuation run with at most one leading space, whitespace runs), then merges bytes
inside each piece: a piece's ids never depend on its neighbours. So a text's ids are its pieces'
ids back to back, and a corpus repeats its pieces: `BpePieces` keeps a dict from piece to ids,
splits a whole batch with one `re.findall` (C) over the texts joined by NUL, and reads the ids
with `map(dict.get)` (C) and one numpy gather: no per-text Python. Pieces it has not seen go to
the tokenizer once, together, and join the table (up to `MAX_ENTRIES`; later misses go to the
tokenizer each time).

The regex is GPT-2's on ASCII: \\p{L} is [A-Za-z], \\p{N} [0-9], \\s the six ASCII white-space
characters. The texts it takes are the lean path's (`ascii_twin.lean_texts`): ASCII with no
control character but tab, newline and return, so no text holds the NUL separator, and
`\\s+(?!\\S)` treats NUL as the end of the text it is. A text holding an added token's text
(special tokens, and the runs of spaces GPT-NeoX-style vocabularies add) goes to the tokenizer
whole: the library cuts those out before the regex runs.

`bpe_twin(backend)` builds the lean twin (`ascii_twin.Lean`) around a table for a tokenizer
whose JSON says exactly this: pre-tokenizer ByteLevel with its regex and without an added prefix
space, a BPE model without dropout, a normalizer that is the identity on ASCII (none, or Unicode
normalization forms). The special tokens around every text are read from probes, as for the
BERT-style twin, and probe texts (contractions, whitespace runs, digits, punctuation) must encode
to the original's ids, or there is no twin.
"""

from __future__ import annotations

import json
import re
import threading
from itertools import chain, repeat
from typing import Any, Sequence

import numpy as np

from packedenc.text.token_ids import TokenIds, encodings

__all__ = ["BpePieces", "bpe_twin", "MAX_ENTRIES"]

MAX_ENTRIES = 1 << 18  # pieces kept; a corpus of many unseen words stops growing the dict here
_WS = "\t\n\x0b\x0c\r "
# GPT-2's pre-tokenizer regex on ASCII, with NUL (the separator) a piece of its own that no
# other alternative takes, and seen as the end of a text by the white-space lookahead
SPLIT = re.compile(
    rf"'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^{_WS}A-Za-z0-9\x00]+|[{_WS}]+(?![^{_WS}\x00])|[{_WS}]+|\x00")
_SEP: tuple = ()  # the separator's ids: none (every real piece has at least one)
_PROBES = ("Hello world, it's 2024!", "don't 'S 'll x's we've I'm they're 'd", " leading", "trailing ",
           "a  b   c\t\td\n\ne\r\nf", "tabs\t x \n y", "numbers 12345 67 8.9e10", "punct!!! ... ??? --- (a)",
           "mixed123abc ABC123", "x   ", "'''s ''t", "emails a@b.co, urls https://x.y/z?q=1&r=2")


class BpePieces:
    """Piece -> ids for a byte-level BPE tokenizer without its post-processor (`bare`).

    The ids live in one flat array: piece k's are `store[start[k]:start[k] + length[k]]`, and a
    dict maps each piece's text to k (0 is the separator, no ids). A batch's ids are then one
    gather. The four are replaced together, never changed in place: a call reads one snapshot,
    so `embed`'s tokenizer thread and another caller may share a table."""

    def __init__(self, bare: Any, added: Sequence[str] = ()):
        self._bare = bare
        self._added = tuple(sorted({a for a in added if a}))
        self._state = ({"\x00": 0}, np.zeros(1, np.int64), np.zeros(1, np.int64), np.zeros(0, np.int64))
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._state[0]) - 1

    def encode(self, texts: Sequence[str]) -> TokenIds:
        """`TokenIds` of the texts, no special tokens. The texts are the lean path's (ASCII
        without other control characters than tab / newline / return)."""
        texts = list(texts)
        held = self._holding_added(texts)
        if not held:
            return self._lookup(texts)
        held_N = np.array(held, dtype=np.int64)
        rest_N = np.setdiff1d(np.arange(len(texts)), held_N)
        whole = TokenIds.from_encodings(encodings(self._bare, [texts[i] for i in held]))
        if rest_N.size == 0:
            return whole
        return TokenIds.interleave(((rest_N, self._lookup([texts[i] for i in rest_N.tolist()])), (held_N, whole)),
                                   len(texts))

    def _holding_added(self, texts: list[str]) -> list[int]:
        """Indices of the texts holding an added token's text (a C search of the joined batch
        first: most batches hold none)."""
        if not self._added:
            return []
        joined = "\x00".join(texts)
        if not any(a in joined for a in self._added):
            return []
        return [i for i, t in enumerate(texts) if any(a in t for a in self._added)]

    def _lookup(self, texts: list[str]) -> TokenIds:
        pieces = SPLIT.findall("\x00".join(texts) + "\x00")
        index, start, length, store = self._state
        k = np.fromiter(map(index.get, pieces, repeat(-1)), dtype=np.int64, count=len(pieces))
        if (k < 0).any():
            (index, start, length, store), k = self._misses(pieces, k)
        lens = length[k]
        ends = np.cumsum(lens)
        total = int(ends[-1])
        # piece j's ids: store[start[k_j] + (t - its first output slot)] for its output slots t
        ids_T = store[np.repeat(start[k] - (ends - lens), lens) + np.arange(total)]
        ends_N = ends[k == 0]  # each text's end: its separator, the one piece without ids
        assert ends_N.size == len(texts), (ends_N.size, len(texts))
        return TokenIds.from_lengths(ids_T, np.diff(ends_N, prepend=0))

    def _misses(self, pieces: list[str], k: np.ndarray) -> tuple[tuple, np.ndarray]:
        """(the state with the unseen pieces in it, k with their entries): the tokenizer encodes
        the distinct unseen pieces once; past `MAX_ENTRIES` they stay out of the table's dict and
        live in this call's state only."""
        miss = np.flatnonzero(k < 0)
        new = list(dict.fromkeys(pieces[i] for i in miss.tolist()))
        enc = [e.ids for e in encodings(self._bare, new)]
        if not all(enc):  # never for byte-level BPE; an empty one would read as a separator
            raise RuntimeError(f"bpe_pieces: a piece without ids: {[p for p, e in zip(new, enc) if not e][:3]}")
        with self._lock:  # copy on write: calls reading the old state keep it whole
            index, start, length, store = self._state
            first = len(start)
            grown = dict(index)
            grown.update(zip(new, range(first, first + len(new))))
            new_len = np.fromiter(map(len, enc), dtype=np.int64, count=len(enc))
            state = (grown, np.concatenate((start, len(store) + np.cumsum(new_len) - new_len)),
                     np.concatenate((length, new_len)),
                     np.concatenate((store, np.fromiter(chain.from_iterable(enc), np.int64, int(new_len.sum())))))
            if len(grown) <= MAX_ENTRIES:
                self._state = state
        k = k.copy()
        k[miss] = np.fromiter(map(state[0].__getitem__, (pieces[i] for i in miss.tolist())), np.int64, miss.size)
        return state, k


def _identity_on_ascii(normalizer: dict | None) -> bool:
    if normalizer is None:
        return True
    kind = normalizer.get("type")
    if kind == "Sequence":
        return all(_identity_on_ascii(n) for n in normalizer.get("normalizers", ()))
    return kind in ("NFC", "NFD", "NFKC", "NFKD")


def bpe_twin(backend: Any) -> Any:
    """The lean twin (`ascii_twin.Lean`) of a byte-level BPE `tokenizers.Tokenizer`, with a
    `BpePieces` table, or None where the reduction is not exact (see the module docstring)."""
    from tokenizers import Tokenizer as _Tok

    from packedenc.text.ascii_twin import Lean, probe_specials

    spec = json.loads(backend.to_str())
    pre, model = spec.get("pre_tokenizer") or {}, spec.get("model") or {}
    if not (pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space")):
        return None
    if model.get("type") != "BPE" or model.get("dropout") or not _identity_on_ascii(spec.get("normalizer")):
        return None
    bare = _Tok.from_str(backend.to_str())
    bare.post_processor = None
    bare.no_truncation()
    bare.no_padding()
    specials = probe_specials(backend, bare)
    if specials is None:
        return None
    prefix, suffix = specials
    table = BpePieces(bare, [t.content for t in backend.get_added_tokens_decoder().values()])
    lean = Lean(bare, prefix, suffix, table)
    full = [e.ids for e in backend.encode_batch(list(_PROBES))]
    ours, _ = lean.encode_ids(list(_PROBES), None)
    return lean if ours.tolist() == full else None
