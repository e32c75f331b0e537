"""Token ids of ASCII texts by table look-up: the lean twin's pieces found and matched with numpy.

The lean twin (`ascii_twin.py`) reduces a BERT-style tokenizer on clean ASCII texts to: lowercase,
cut into pieces (a run of letters / digits, or one punctuation character; whitespace between),
tokenize each piece on its own. The pieces of a corpus repeat: English has a few tens of thousands
of common words, and WordPiece gives a word that is itself in the vocabulary that one token. So
instead of handing every text to the tokenizers library (one `Encoding` Python object per text,
built under the GIL that `embed`'s device loop needs), `PieceTable.encode` joins the texts, finds
every piece's start and length with a few vectorised passes over the bytes, reads each piece's
first 24 bytes as three little-endian uint64 words (unaligned views of the byte string, one
gather per word) and looks the (words, length) key up in an open-addressing hash table. Keys are
compared whole, so a hit is exact; only pieces not in the table (longer than 24 bytes, or not seen
yet) go to the tokenizer, one call per distinct piece, and the short ones join the table.

Seeds: for a WordPiece model, every vocabulary entry that is itself one piece (`tokenize(word)` is
`[id(word)]`: greedy longest-match takes the whole word first). Other models start empty and fill
from their own output. An added token (`[CLS]`, `[MASK]`, a user's) is matched by the tokenizer in
the raw text before pieces are cut: when the text of one occurs in the texts, `encode` returns
None and the caller uses the tokenizer. The table only grows (to `_CAPACITY` entries, then misses
are tokenized every time), and a grown table replaces the old one in one assignment: a thread
reading the old one meanwhile still reads a consistent table.

Shapes: C bytes of the joined texts, P pieces, E table entries, S slots (a power of two, >= 2E).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

__all__ = ["PieceTable"]

_WORDS = 3                 # uint64 words of a key: pieces of up to 24 bytes live in the table
_KEY_BYTES = 8 * _WORDS
_CAPACITY = 1 << 17        # entries; at most 2^19 slots of 48 bytes
_PUNCT = b"!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"
# byte -> 0 whitespace (space, tab, newline, return: the lean twin's texts hold no other
# control), 1 letter / digit / other printable, 2 ASCII punctuation (a piece on its own)
_CLASS = np.zeros(256, dtype=np.uint8)
_CLASS[33:127] = 1
_CLASS[np.frombuffer(_PUNCT, dtype=np.uint8)] = 2
_MASK = np.array([(1 << (8 * k)) - 1 for k in range(9)], dtype=np.uint64)  # the low k bytes
_MIX = np.array([0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93],
                dtype=np.uint64)


def _pieces(buf: bytes) -> tuple[np.ndarray, np.ndarray]:
    """(P,) start and (P,) length of every piece of `buf` (ASCII; 24 zero bytes of padding at its
    end, which are whitespace)."""
    cls = _CLASS[np.frombuffer(buf, dtype=np.uint8)]
    word = cls == 1
    punct = cls == 2
    after = np.empty_like(word)  # the byte before is a letter
    after[0] = False
    after[1:] = word[:-1]
    before = np.empty_like(word)  # the byte after is a letter
    before[-1] = False
    before[:-1] = word[1:]
    start = np.flatnonzero(punct | (word & ~after))
    end = np.flatnonzero(punct | (word & ~before))
    return start, end - start + 1


def _keys(buf: bytes, start: np.ndarray, length: np.ndarray) -> np.ndarray:
    """(3, P) uint64: each piece's first 24 bytes, little-endian, the bytes past its end zeroed."""
    at = np.ndarray(shape=(len(buf) - 7,), dtype="<u8", buffer=buf, strides=(1,))  # 8 bytes from each offset
    keys = np.empty((_WORDS, len(start)), dtype=np.uint64)
    for w in range(_WORDS):
        keys[w] = at[start + 8 * w] & _MASK[np.clip(length - 8 * w, 0, 8)]
    return keys


def _hash(keys: np.ndarray, length: np.ndarray) -> np.ndarray:
    """(P,) uint64 hash of each (key, length); the table's slots are its top bits."""
    h = length.astype(np.uint64) * _MIX[3]
    for w in range(_WORDS):
        h = (h ^ keys[w]) * _MIX[w]
        h ^= h >> np.uint64(32)
    h ^= h >> np.uint64(29)
    return h * _MIX[1]


@dataclasses.dataclass(frozen=True)
class _Table:
    """Entries (E keys, their lengths, where their ids sit in `store`) and their open-addressing
    slots (linear probing; slot length 0 = empty); `probes`: the longest probe distance used."""

    keys_E: np.ndarray
    length_E: np.ndarray
    off_E: np.ndarray
    count_E: np.ndarray
    store: np.ndarray
    slot_entry: np.ndarray
    slot_hash: np.ndarray
    slot_keys: np.ndarray
    slot_length: np.ndarray
    probes: int

    @staticmethod
    def build(keys_E, length_E, off_E, count_E, store) -> "_Table":
        E = len(length_E)
        bits = max(10, int(4 * max(E, 1) - 1).bit_length())  # at most a quarter full: short probes
        S = 1 << bits
        slot_entry = np.full(S, -1, dtype=np.int64)
        hash_E = _hash(keys_E, length_E)
        at = (hash_E >> np.uint64(64 - bits)).astype(np.int64)
        pending, probes, dist = np.arange(E), 0, 0
        while pending.size:  # place in rounds: the first of the pending claiming a free slot wins it
            cand = (at[pending] + dist) & (S - 1)
            free = slot_entry[cand] < 0
            slots, first = np.unique(cand[free], return_index=True)
            slot_entry[slots] = pending[free][first]
            placed = np.zeros(len(pending), dtype=bool)
            placed[np.flatnonzero(free)[first]] = True
            if placed.any():
                probes = dist
            pending, dist = pending[~placed], dist + 1  # the others try the next slot
        used = slot_entry >= 0
        slot_hash = np.zeros(S, dtype=np.uint64)
        slot_hash[used] = hash_E[slot_entry[used]]
        slot_keys = np.zeros((_WORDS, S), dtype=np.uint64)
        slot_keys[:, used] = keys_E[:, slot_entry[used]]
        slot_length = np.zeros(S, dtype=np.int64)
        slot_length[used] = length_E[slot_entry[used]]
        return _Table(keys_E, length_E, off_E, count_E, store, slot_entry, slot_hash, slot_keys,
                      slot_length, probes)

    def find(self, keys: np.ndarray, length: np.ndarray) -> np.ndarray:
        """(P,) entry of each key, -1 where it is not in the table. A slot's full hash is compared
        first, then the key and length themselves (so a hit is exact)."""
        S = len(self.slot_entry)
        h = _hash(keys, length)
        home = (h >> np.uint64(64 - (S.bit_length() - 1))).astype(np.int64)
        entry = np.full(len(length), -1, dtype=np.int64)
        todo = np.flatnonzero(length <= _KEY_BYTES)
        for d in range(self.probes + 1):
            if todo.size == 0:
                break
            every = todo.size == len(length)  # (the first probe of pieces all short: no gathers)
            slot = home if every else (home[todo] + d) & (S - 1)
            hit = self.slot_hash[slot] == (h if every else h[todo])
            hit &= self.slot_length[slot] == (length if every else length[todo])
            for w in range(_WORDS):
                hit &= self.slot_keys[w][slot] == (keys[w] if every else keys[w][todo])
            entry[todo[hit]] = self.slot_entry[slot[hit]]
            todo = todo[~hit & (self.slot_length[slot] > 0)]  # an empty slot ends the probe: a miss
        return entry


class PieceTable:
    """Pieces -> token ids for one lean twin (`backend`: no normalizer but lowercasing, no
    post-processor, no truncation). `encode(texts)` -> `TokenIds` without special tokens."""

    def __init__(self, backend: Any, lower: bool):
        from tokenizers import models

        self._backend = backend
        self._lower = lower
        added = [t.content for t in backend.get_added_tokens_decoder().values()]
        # matched before the pieces are cut, in the text as normalised (lowercased or not)
        self._added: dict[bytes, list[bytes]] = {}  # by first byte: most texts hold none of them
        for c in added:
            if c and c.isascii():
                c = (c.lower() if lower else c).encode("ascii")
                self._added.setdefault(c[:1], []).append(c)
        words, ids = [], []
        model = backend.model
        if isinstance(model, models.WordPiece):
            limit = min(_KEY_BYTES, model.max_input_chars_per_word)
            for w, i in backend.get_vocab().items():
                if w.isascii() and 0 < len(w) <= limit and (not lower or w == w.lower()) and _one_piece(w):
                    words.append(w)
                    ids.append(i)
        self._table = self._with(None, words, [[i] for i in ids])

    @staticmethod
    def _with(table: _Table | None, words: Sequence[str], ids: Sequence[Sequence[int]]) -> _Table:
        """`table` (None: an empty one) with the pieces `words` -> `ids` added."""
        buf = (" ".join(words) + " " * _KEY_BYTES).encode("ascii")
        start, length = _pieces(buf)
        assert len(start) == len(words), "every word added is one piece"
        count = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        new_store = np.fromiter((i for x in ids for i in x), dtype=np.int64, count=int(count.sum()))
        keys = _keys(buf, start, length)
        if table is None:
            return _Table.build(keys, length, np.cumsum(count) - count, count, new_store)
        return _Table.build(np.concatenate((table.keys_E, keys), axis=1), np.concatenate((table.length_E, length)),
                            np.concatenate((table.off_E, len(table.store) + np.cumsum(count) - count)),
                            np.concatenate((table.count_E, count)), np.concatenate((table.store, new_store)))

    def encode(self, texts: Sequence[str]) -> Any:
        """`TokenIds` of the texts, no special tokens: the texts that hold an added token's text
        go to the tokenizer whole, the others through the table."""
        from packedenc.text.ascii_twin import _encode
        from packedenc.text.token_ids import TokenIds

        joined = " ".join(texts)
        if self._lower:
            joined = joined.lower()
        buf = (joined + " " * _KEY_BYTES).encode("ascii")
        text_len = np.fromiter(map(len, texts), dtype=np.int64, count=len(texts))
        text_start = np.cumsum(text_len + 1) - text_len - 1
        held = self._holding_added(buf, text_start)
        if held.size == 0:
            return self._encode(buf, text_start)
        rest = np.setdiff1d(np.arange(len(texts)), held)
        tokenized = TokenIds.from_encodings(_encode(self._backend, [texts[i] for i in held.tolist()]))
        return TokenIds.interleave(((rest, self.encode([texts[i] for i in rest.tolist()])),
                                    (held, tokenized)), len(texts))

    def _holding_added(self, buf: bytes, text_start: np.ndarray) -> np.ndarray:
        """Sorted indices of the texts in which an added token's text occurs (none hold a space,
        so an occurrence never spans two texts)."""
        at = []
        for first, group in self._added.items():
            if first in buf:  # (bytes.__contains__ and .find: fast searches in C)
                for a in group:
                    k = buf.find(a)
                    while k >= 0:
                        at.append(k)
                        k = buf.find(a, k + 1)
        if not at:
            return np.zeros(0, dtype=np.int64)
        return np.unique(np.searchsorted(text_start, np.asarray(at), side="right") - 1)

    def _encode(self, buf: bytes, text_start: np.ndarray) -> Any:
        from packedenc.text.token_ids import TokenIds

        start, length = _pieces(buf)
        keys = _keys(buf, start, length)
        table = self._table
        entry = table.find(keys, length)
        miss = np.flatnonzero(entry < 0)
        if miss.size == 0:
            off, count, store = table.off_E[entry], table.count_E[entry], table.store
        else:
            hit = np.flatnonzero(entry >= 0)
            off, count = np.zeros(len(entry), dtype=np.int64), np.zeros(len(entry), dtype=np.int64)
            off[hit], count[hit] = table.off_E[entry[hit]], table.count_E[entry[hit]]
            store, off[miss], count[miss] = self._misses(buf, start[miss], length[miss], table)
        ids = store[off] if (count == 1).all() else store[
            np.repeat(off - (np.cumsum(count) - count), count) + np.arange(int(count.sum()))]
        first_piece = np.searchsorted(start, text_start)
        tokens_cu = np.concatenate(([0], np.cumsum(count)))
        return TokenIds.from_lengths(ids, np.diff(tokens_cu[np.append(first_piece, len(start))]))

    def _misses(self, buf: bytes, start: np.ndarray, length: np.ndarray, table: _Table
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Tokenize the distinct pieces not in `table`, add the short ones to it; (the store the
        offsets index, each missed piece's offset, its count)."""
        from packedenc.text.ascii_twin import _encode

        text = [buf[s:s + n].decode("ascii") for s, n in zip(start.tolist(), length.tolist())]
        distinct = list(dict.fromkeys(text))
        got = [e.ids for e in _encode(self._backend, distinct)]
        where = {p: k for k, p in enumerate(distinct)}
        count_D = np.fromiter(map(len, got), dtype=np.int64, count=len(got))
        off_D = len(table.store) + np.cumsum(count_D) - count_D
        store = np.concatenate((table.store, np.fromiter((i for x in got for i in x), dtype=np.int64,
                                                         count=int(count_D.sum()))))
        pick = np.fromiter(map(where.__getitem__, text), dtype=np.int64, count=len(text))
        short = [k for k, p in enumerate(distinct) if len(p) <= _KEY_BYTES]
        if short and len(table.length_E) + len(short) <= _CAPACITY:
            self._table = self._with(table, [distinct[k] for k in short], [got[k] for k in short])
        return store, off_D[pick], count_D[pick]


def _one_piece(word: str) -> bool:
    """Whether the ASCII `word` is one piece: one punctuation character, or letters and digits
    (the printable ASCII bytes that are neither whitespace nor punctuation)."""
    return word.isalnum() or (len(word) == 1 and word.encode("ascii") in _PUNCT)
