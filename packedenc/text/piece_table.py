"""Token ids of ASCII texts by table look-up: the lean twin's pieces found and matched with numpy.

The lean twin (`ascii_twin.py`) reduces a BERT-style tokenizer on clean ASCII texts to: lowercase,
cut into pieces (a run of letters / digits, or one punctuation character; whitespace between),
tokenize each piece on its own. The pieces of a corpus repeat: English has a few tens of thousands
of common words, and WordPiece gives a word that is itself in the vocabulary that one token. So
instead of handing every text to the tokenizers library (one `Encoding` Python object per text,
built under the GIL that `embed`'s device loop needs), `PieceTable.encode` joins the texts, finds
every piece's start and length with a few vectorised passes over the bytes, reads each piece's
first 24 bytes as three little-endian uint64 words (an unaligned view of the byte string, one
gather per word; a piece's bytes are never 0, so the words alone tell two pieces apart) and looks
the key up in an open-addressing hash table of 32-byte rows (key, value: one cache line a probe).
Keys are compared whole, so a hit is exact; only pieces not in the table (longer than 24 bytes,
or not seen yet) go to the tokenizer, one call per distinct piece, and the short ones join the
table. Gathers use `np.take`, several times faster than `[]` indexing on these shapes.

Seeds: for a WordPiece model, every vocabulary entry that is itself one piece (`tokenize(word)` is
`[id(word)]`: greedy longest-match takes the whole word first). Other models start empty and fill
from their own output. An added token (`[CLS]`, `[MASK]`, a user's) is matched by the tokenizer in
the raw text before pieces are cut: the texts in which the text of one occurs go to the
tokenizer whole. The table only grows (to `_CAPACITY` entries, then misses
are tokenized every time), and a grown table replaces the old one in one assignment: a thread
reading the old one meanwhile still reads a consistent table.

Shapes: C bytes of the joined texts, P pieces, E table entries, S slots (a power of two, >= 2E).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from packedenc.text.token_ids import TokenIds, encodings

__all__ = ["PieceTable"]

_WORDS = 3                 # uint64 words of a key: pieces of up to 24 bytes live in the table
_KEY_BYTES = 8 * _WORDS
_CAPACITY = 1 << 18        # entries; at most 2^19 slots of 32 bytes
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
    cls = np.take(_CLASS, np.frombuffer(buf, dtype=np.uint8))  # (take: a fraction of [] indexing's time)
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
    keys = np.zeros((_WORDS, len(start)), dtype=np.uint64)
    keys[0] = np.take(at, start) & np.take(_MASK, np.minimum(length, 8))
    longer = np.flatnonzero(length > 8)  # most pieces fit one word: the others' later words
    for w in range(1, _WORDS):
        if longer.size:
            keys[w, longer] = np.take(at, start[longer] + 8 * w) & np.take(_MASK, np.clip(length[longer] - 8 * w, 0, 8))
            longer = longer[length[longer] > 8 * (w + 1)]
    return keys


def _home(keys: np.ndarray, bits: int) -> np.ndarray:
    """(P,) int64 home slot of each key in a table of 2**bits slots: the top bits of a hash."""
    h = keys[0] * _MIX[3]
    for w in range(_WORDS):
        h = (h ^ keys[w]) * _MIX[w]
        h ^= h >> np.uint64(32)
    h ^= h >> np.uint64(29)
    return ((h * _MIX[1]) >> np.uint64(64 - bits)).astype(np.int64)


@dataclasses.dataclass(frozen=True)
class _Table:
    """Entries (E keys; each one's ids as `store[value >> 8:][:value & 255]`) and their
    open-addressing slots: (S, 4) uint64 rows (the key's three words, its value), linear probing,
    an empty slot's first word 0 (a piece's first byte never is). A piece's bytes are printable,
    never 0, so its key alone (without its length) tells it apart from every other piece of up to
    24 bytes. `probes`: the longest probe distance used."""

    keys_E: np.ndarray
    value_E: np.ndarray
    store: np.ndarray
    slots: np.ndarray
    probes: int

    @staticmethod
    def build(keys_E: np.ndarray, value_E: np.ndarray, store: np.ndarray) -> "_Table":
        E = len(value_E)
        bits = max(10, int(2 * max(E, 1) - 1).bit_length())  # at most half full
        S = 1 << bits
        slot_entry = np.full(S, -1, dtype=np.int64)
        at = _home(keys_E, bits)
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
        used = np.flatnonzero(slot_entry >= 0)
        rows = np.zeros((S, _WORDS + 1), dtype=np.uint64)  # one 32-byte row a slot: one cache line a probe
        rows[used, :_WORDS] = keys_E[:, slot_entry[used]].T
        rows[used, _WORDS] = value_E[slot_entry[used]]
        return _Table(keys_E, value_E, store, rows, probes)

    def find(self, keys: np.ndarray, length: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """((P,) uint64 value of each key, (P,) bool found): pieces longer than 24 bytes and keys
        not in the table are not found."""
        S = len(self.slots)
        home = _home(keys, S.bit_length() - 1)
        row = np.take(self.slots, home, axis=0)  # the first probe, every piece: (take: ~10x [] on rows)
        found = length <= _KEY_BYTES  # a longer piece's key is its first 24 bytes: never an entry's
        for w in range(_WORDS):
            found &= row[:, w] == keys[w]
        value = np.where(found, row[:, _WORDS], np.uint64(0))
        todo = np.flatnonzero(~found & (row[:, 0] != 0) & (length <= _KEY_BYTES))  # an empty slot: a miss
        for d in range(1, self.probes + 1):
            if todo.size == 0:
                break
            row = np.take(self.slots, (home[todo] + d) & (S - 1), axis=0)
            hit = row[:, 0] == keys[0, todo]
            for w in range(1, _WORDS):
                hit &= row[:, w] == keys[w, todo]
            value[todo[hit]] = row[hit, _WORDS]
            found[todo[hit]] = True
            todo = todo[~hit & (row[:, 0] != 0)]
        return value, found


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
        """`table` (None: an empty one) with the pieces `words` (each at most 24 bytes, fewer than
        256 ids) -> `ids` added."""
        buf = (" ".join(words) + " " * _KEY_BYTES).encode("ascii")
        start, length = _pieces(buf)
        assert len(start) == len(words) and (length <= _KEY_BYTES).all(), "every word added is one short piece"
        count = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        assert (count < 256).all(), "a value holds a count of up to 255 ids"
        old = np.zeros(0, dtype=np.int64) if table is None else table.store
        value = ((len(old) + np.cumsum(count) - count) << 8 | count).astype(np.uint64)
        store = np.concatenate((old, np.fromiter((i for x in ids for i in x), dtype=np.int64, count=int(count.sum()))))
        keys = _keys(buf, start, length)
        if table is None:
            return _Table.build(keys, value, store)
        return _Table.build(np.concatenate((table.keys_E, keys), axis=1), np.concatenate((table.value_E, value)),
                            store)

    def encode(self, texts: Sequence[str]) -> Any:
        """`TokenIds` of the texts, no special tokens: the texts that hold an added token's text
        go to the tokenizer whole, the others through the table."""
        joined = " ".join(texts)
        if self._lower:
            joined = joined.lower()
        buf = (joined + " " * _KEY_BYTES).encode("ascii")
        text_len = np.fromiter(map(len, texts), dtype=np.int64, count=len(texts))
        text_start = np.cumsum(text_len + 1) - text_len - 1
        held = self._holding_added(buf, text_start)
        if held.size == 0:
            return self._lookup(buf, text_start)
        rest = np.setdiff1d(np.arange(len(texts)), held)
        tokenized = TokenIds.from_encodings(encodings(self._backend, [texts[i] for i in held.tolist()]))
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

    def _lookup(self, buf: bytes, text_start: np.ndarray) -> Any:
        start, length = _pieces(buf)
        keys = _keys(buf, start, length)
        table = self._table
        value, found = table.find(keys, length)
        off, count = (value >> np.uint64(8)).astype(np.int64), (value & np.uint64(255)).astype(np.int64)
        store = table.store
        if not found.all():
            miss = np.flatnonzero(~found)
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
        text = [buf[s:s + n].decode("ascii") for s, n in zip(start.tolist(), length.tolist())]
        distinct = list(dict.fromkeys(text))
        got = [e.ids for e in encodings(self._backend, distinct)]
        where = {p: k for k, p in enumerate(distinct)}
        count_D = np.fromiter(map(len, got), dtype=np.int64, count=len(got))
        off_D = len(table.store) + np.cumsum(count_D) - count_D
        store = np.concatenate((table.store, np.fromiter((i for x in got for i in x), dtype=np.int64,
                                                         count=int(count_D.sum()))))
        pick = np.fromiter(map(where.__getitem__, text), dtype=np.int64, count=len(text))
        short = [k for k, p in enumerate(distinct) if len(p) <= _KEY_BYTES and len(got[k]) < 256]
        if short and len(table.value_E) + len(short) <= _CAPACITY:
            self._table = self._with(table, [distinct[k] for k in short], [got[k] for k in short])
        return store, off_D[pick], count_D[pick]


def _one_piece(word: str) -> bool:
    """Whether the ASCII `word` is one piece: one punctuation character, or letters and digits
    (the printable ASCII bytes that are neither whitespace nor punctuation)."""
    return word.isalnum() or (len(word) == 1 and word.encode("ascii") in _PUNCT)
