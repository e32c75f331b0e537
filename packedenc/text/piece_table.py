"""Token ids by table look-up: the lean twin's pieces found and matched with numpy.

The lean twin (`ascii_twin.py`) reduces a BERT-style tokenizer on clean ASCII texts to: lowercase,
cut into pieces (a run of letters / digits, or one punctuation character; whitespace between),
tokenize each piece on its own; the non-ASCII characters it takes (punctuation, CJK ideographs;
accents are folded before) are pieces of one character each, read here as their UTF-8 bytes. The pieces of a corpus repeat: English has a few tens of thousands
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
from typing import Any, Callable, Sequence

import numpy as np

from packedenc.text.token_ids import TokenIds, encodings

__all__ = ["PieceTable"]

_WORDS = 3                 # uint64 words of a key: pieces of up to 24 bytes live in the table
_KEY_BYTES = 8 * _WORDS
_CAPACITY = 1 << 18        # entries; at most 2^19 slots of 32 bytes
_PUNCT = b"!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"
_MASK = np.array([(1 << (8 * k)) - 1 for k in range(9)], dtype=np.uint64)  # the low k bytes
_MIX = np.array([0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93],
                dtype=np.uint64)


def _pieces(buf: bytes) -> tuple[np.ndarray, np.ndarray]:
    """(P,) start and (P,) length in bytes of every piece of `buf` (UTF-8 whose non-ASCII
    characters are each a piece of their own: punctuation, CJK; ending in 24 spaces of padding). Classes
    by uint8 compares (wrapping subtraction: one compare a range), several times faster than a
    256-entry table gathered by every byte."""
    b = np.frombuffer(buf, dtype=np.uint8)
    word = ((b | np.uint8(32)) - np.uint8(97) < 26) | (b - np.uint8(48) < 10)  # a-z, A-Z, 0-9
    punct = b - np.uint8(33) < 94  # printable, then less the letters and digits
    punct &= ~word
    start = word.copy()  # a letter after a non-letter, or punctuation
    start[1:] &= ~word[:-1]
    start |= punct
    end = word  # a letter before a non-letter, or punctuation
    end[:-1] &= ~word[1:]
    end |= punct
    if len(buf) and b.max() >= 0x80:  # a non-ASCII character: its lead byte starts it, its last byte ends it
        lead, cont = b >= 0xC0, (b & np.uint8(0xC0)) == 0x80
        start |= lead
        last = lead | cont
        last[:-1] &= ~cont[1:]
        end |= last
    s = np.flatnonzero(start)
    return s, np.flatnonzero(end) - s + 1


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


def _place(slots: np.ndarray, keys: np.ndarray, value: np.ndarray) -> int:
    """Write the entries (keys not in `slots` yet) into free slots, linear probing; return the
    longest probe distance used. In rounds: of the entries claiming one free slot, the first wins
    it, the others try the next slot."""
    S = len(slots)
    at = _home(keys, S.bit_length() - 1)
    pending, probes, dist = np.arange(len(value)), 0, 0
    while pending.size:
        cand = (at[pending] + dist) & (S - 1)
        free = np.flatnonzero(np.take(slots[:, 0], cand) == 0)
        won, first = np.unique(cand[free], return_index=True)
        winners = pending[free[first]]
        slots[won, :_WORDS] = keys[:, winners].T
        slots[won, _WORDS] = value[winners]
        if won.size:
            probes = dist
        placed = np.zeros(len(pending), dtype=bool)
        placed[free[first]] = True
        pending, dist = pending[~placed], dist + 1
    return probes


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
        bits = max(10, int(2 * max(len(value_E), 1) - 1).bit_length())  # at most half full
        slots = np.zeros((1 << bits, _WORDS + 1), dtype=np.uint64)  # 32-byte rows: one cache line a probe
        return _Table(keys_E, value_E, store, slots, _place(slots, keys_E, value_E))

    def added(self, keys: np.ndarray, value: np.ndarray, store: np.ndarray) -> "_Table":
        """This table with entries for new keys (none already in it), over `store` (this table's
        store extended): placed into a copy of the slots while the table stays at most half full,
        else rebuilt twice as large."""
        keys_E, value_E = np.concatenate((self.keys_E, keys), axis=1), np.concatenate((self.value_E, value))
        if 2 * len(value_E) > len(self.slots):
            return _Table.build(keys_E, value_E, store)
        slots = self.slots.copy()
        return _Table(keys_E, value_E, store, slots, max(self.probes, _place(slots, keys, value)))

    def find(self, keys: np.ndarray, length: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """((P,) uint64 value of each key, (P,) bool found): pieces longer than 24 bytes and keys
        not in the table are not found."""
        S = len(self.slots)
        home = _home(keys, S.bit_length() - 1)
        row = np.take(self.slots, home, axis=0)  # the first probe, every piece (take: far faster than [] on rows)
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

    def __init__(self, backend: Any, lower: bool, alone: Callable[[str], bool] = lambda c: False):
        """`alone(c)`: whether the non-ASCII character c is a piece of its own in the lean twin's
        texts (its wide punctuation and CJK ideographs); the vocabulary's such entries are seeds."""
        from tokenizers import models

        self._backend = backend
        self._lower = lower
        added = [t.content for t in backend.get_added_tokens_decoder().values()]
        # matched before the pieces are cut, in the text as normalised (lowercased or not)
        self._added: dict[bytes, list[bytes]] = {}  # by first byte: most texts hold none of them
        for c in added:
            if c:
                c = (c.lower() if lower else c).encode("utf-8")
                self._added.setdefault(c[:1], []).append(c)
        words, ids = [], []
        model = backend.model
        if isinstance(model, models.WordPiece):
            limit = min(_KEY_BYTES, model.max_input_chars_per_word)
            for w, i in backend.get_vocab().items():
                if 0 < len(w) <= limit and (not lower or w == w.lower()) and _one_piece(w, alone):
                    words.append(w)
                    ids.append(i)
        self._table = self._seeded(words, ids)

    @staticmethod
    def _seeded(words: Sequence[str], ids: Sequence[int]) -> _Table:
        """A table of the one-token pieces `words` (each at most 24 bytes)."""
        buf = (" ".join(words) + " " * _KEY_BYTES).encode("utf-8")
        start, length = _pieces(buf)
        assert len(start) == len(words) and (length <= _KEY_BYTES).all(), "every word is one short piece"
        store = np.asarray(ids, dtype=np.int64)
        value = (np.arange(len(words), dtype=np.uint64) << np.uint64(8)) | np.uint64(1)
        return _Table.build(_keys(buf, start, length), value, store)

    def encode(self, texts: Sequence[str]) -> Any:
        """`TokenIds` of the texts, no special tokens: the texts that hold an added token's text
        go to the tokenizer whole, the others through the table."""
        joined = " ".join(texts)
        if self._lower:
            joined = joined.lower()
        buf = (joined + " " * _KEY_BYTES).encode("utf-8")
        sizes = map(len, texts if len(buf) == len(joined) + _KEY_BYTES else map(str.encode, texts))  # in bytes
        text_len = np.fromiter(sizes, dtype=np.int64, count=len(texts))
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
            store, off[miss], count[miss] = self._misses(buf, start[miss], length[miss], keys[:, miss], table)
        ids = store[off] if (count == 1).all() else store[
            np.repeat(off - (np.cumsum(count) - count), count) + np.arange(int(count.sum()))]
        first_piece = np.searchsorted(start, text_start)
        tokens_cu = np.concatenate(([0], np.cumsum(count)))
        return TokenIds.from_lengths(ids, np.diff(tokens_cu[np.append(first_piece, len(start))]))

    def _misses(self, buf: bytes, start: np.ndarray, length: np.ndarray, keys: np.ndarray, table: _Table
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Tokenize the distinct pieces not in `table` and add the short ones to it. Return: (the
        store the offsets index, each missed piece's offset, its count)."""
        first: dict[str, int] = {}  # distinct piece -> its first miss
        text = [buf[s:s + n].decode("utf-8") for s, n in zip(start.tolist(), length.tolist())]
        for i, p in enumerate(text):
            first.setdefault(p, i)
        # the short pieces first: the table's store gets their ids only (not the long ones', which
        # no entry points at), and this call's store continues with the long ones'
        at = np.fromiter(first.values(), dtype=np.int64, count=len(first))
        short = length[at] <= _KEY_BYTES
        at = np.concatenate((at[short], at[~short]))
        distinct = [text[i] for i in at.tolist()]
        rank = {p: k for k, p in enumerate(distinct)}
        n_short = int(short.sum())
        ids_s, count_s = self._tokenize(distinct[:n_short])
        ids_l, count_l = self._tokenize(distinct[n_short:])
        count = np.concatenate((count_s, count_l))
        off = len(table.store) + np.cumsum(count) - count
        kept = np.concatenate((table.store, ids_s))
        if n_short and len(table.value_E) + n_short <= _CAPACITY and (count_s < 256).all():
            value = (off[:n_short] << 8 | count_s).astype(np.uint64)
            self._table = table.added(keys[:, at[:n_short]], value, kept)
        pick = np.fromiter(map(rank.__getitem__, text), dtype=np.int64, count=len(text))
        return np.concatenate((kept, ids_l)), off[pick], count[pick]

    def _tokenize(self, pieces: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(ids of the pieces back to back, (D,) ids per piece). The pieces go to the tokenizer
        joined by spaces, a few texts of many pieces (not one text each: the library's Python
        object per text costs more than the tokenizing), and each token's word index says which
        piece it came from: pieces are tokenized one by one either way."""
        D = len(pieces)
        # (a few texts, not one: the library spreads the texts of a batch over its threads)
        bounds = np.linspace(0, D, min(16, D // 256) + 2, dtype=np.int64)
        spans = [(a, z) for a, z in zip(bounds[:-1].tolist(), bounds[1:].tolist()) if z > a]
        encs = self._backend.encode_batch([" ".join(pieces[a:z]) for a, z in spans])
        ids = np.concatenate([np.asarray(e.ids, dtype=np.int64) for e in encs] + [np.zeros(0, dtype=np.int64)])
        count = np.concatenate([np.bincount(np.asarray(e.word_ids, dtype=np.int64), minlength=z - a)
                                for e, (a, z) in zip(encs, spans)] + [np.zeros(0, dtype=np.int64)])
        assert len(count) == D and count.sum() == len(ids), "one word index per piece"
        return ids, count


def _one_piece(word: str, alone: Callable[[str], bool]) -> bool:
    """Whether `word` is one piece: one punctuation character (ASCII, or one `alone` takes), or
    ASCII letters and digits."""
    if len(word) == 1 and (word.encode("utf-8") in _PUNCT or (not word.isascii() and alone(word))):
        return True
    return word.isascii() and word.isalnum()
