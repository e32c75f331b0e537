"""A faster twin of a BERT-style tokenizer for ASCII texts: the same ids, a cheaper normalizer and pre-tokenizer.

`BertNormalizer` (BERT, MiniLM, bge, e5 and the other WordPiece models) runs, per character,
text cleaning, CJK spacing, NFD accent stripping and lowercasing; on the tokenizers library's
aligned strings that is about a third of the whole encode of a short English text. On an ASCII
character all of it reduces to: drop the control characters other than tab / newline / return
(`clean_text`; NUL included), turn those three into spaces, lowercase (`lowercase`): ASCII has
no CJK, no accents and no other whitespace. `BertPreTokenizer` (a whitespace pass, then a
punctuation pass) becomes one regex split. The twin is the same tokenizer (WordPiece, added
tokens, post-processor, truncation) with those two swapped, and `encode_batch` sends it only
the ASCII texts (`str.isascii` reads a flag CPython keeps: no scan), the others to the
original, and returns the encodings in input order. Unicode normalization forms (NFC, NFKC, ...:
DeBERTa's and BPE models' tokenizers) are the identity on ASCII, and the twin drops them too.

`lean_twin` goes further for BERT-style tokenizers (a BertNormalizer, alone or with Lowercase,
and the BertPreTokenizer) on ASCII texts with no control character other than tab, newline and
return (`lean_texts` finds them): there cleaning removes nothing, and turning tab / newline /
return into spaces changes no piece (the split drops all four alike), so lowercasing is the whole
normalizer. It also leaves out the post-processor and the truncation: the caller adds the special
tokens the post-processor puts around every text and cuts to the limit on flat arrays
(`TokenIds.wrapped`), cheaper than the library's per-text merges and overflow pieces
(benchmarks/NOTES.md, "lean twin"). It also takes texts whose only non-ASCII characters are common
punctuation (curly quotes, dashes, the ellipsis, ...: `_WIDE`): a BertNormalizer leaves each as it
is (no decomposition, no case) and the BertPreTokenizer makes it a piece of its own, so the twin's
split lists them with ASCII punctuation. Each is probed against the original tokenizer first;
`Lean.wide` holds those that passed. CJK ideographs likewise where the original spaces them out
(`handle_chinese_chars`; a sample probed): Chinese text takes the lean path too. Where the
original strips accents (uncased models: NFD, then the combining marks go), a Latin letter with
accents is its ASCII base letter and a combining mark is nothing (`_FOLD`, probed the same way):
`Lean.fold` holds them, and the lean path takes a text holding them after NFD and dropping the
marks, so "café" and "naïve" stay on it.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import unicodedata
from itertools import chain
from typing import Any, Sequence

import numpy as np

from packedenc.text.piece_table import PieceTable
from packedenc.text.token_ids import TokenIds, encodings

__all__ = ["ascii_twin", "encode_batch", "Lean", "lean_twin", "lean_texts"]

# BertNormalizer's clean_text on ASCII: these go (Cc other than \t \n \r), then \t \n \r -> " "
_CONTROL = "[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]"
_BREAKS = "[\t\n\r]"
# BertPreTokenizer on ASCII: split at whitespace (dropped) and around each ASCII punctuation
# character (kept alone: !"#$%&'()*+,-./ :;<=>?@ [\]^_` {|}~), in one regex pass instead of two
_PUNCT = r"!-/:-@\[-`{-~"


def _split_pieces(punct: str) -> Any:
    """A pre-tokenizer that keeps each character of the regex class `punct` alone and every run of
    other non-space characters whole; the spaces go (BertPreTokenizer on the texts a twin takes)."""
    from tokenizers import Regex, pre_tokenizers

    return pre_tokenizers.Split(Regex(f"[{punct}]|[^\\s{punct}]+"), behavior="removed", invert=True)


# Non-ASCII punctuation of English text: unchanged by NFD and lowercasing, split alone by BERT
_WIDE = "".join(c for c in chain("¡§«¶·»¿‐‑‒–—―‘’‚‛“”„‟†‡•…‰′″‹›", map(chr, range(0x3001, 0x3040)),
                                  map(chr, range(0xFF01, 0xFF66)))  # (CJK and fullwidth punctuation)
                if unicodedata.category(c).startswith("P") and unicodedata.normalize("NFD", c) == c == c.lower())
# CJK ideographs: a BertNormalizer with handle_chinese_chars puts spaces around each, so each is a
# piece of its own (BERT's ranges, less the compatibility ideographs, which NFD changes, and
# extension E, where the tokenizers library's range starts at 0x2B920, not BERT's 0x2B820)
_CJK_RANGES = ((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F), (0x2B740, 0x2B81F))
_CJK = "".join(f"{chr(a)}-{chr(b)}" for a, b in _CJK_RANGES)  # a regex class fragment


def is_cjk(c: str) -> bool:
    return any(a <= ord(c) <= b for a, b in _CJK_RANGES)


_MARKS = re.compile("[\u0300-\u036f]+")  # the combining diacritical marks (all Mn)


def _fold_candidates() -> dict[str, str]:
    """Latin letters whose NFD is an ASCII letter and combining marks (-> that letter), and the
    combining marks (-> nothing): what stripping accents does to them."""
    out = {}
    for c in map(chr, chain(range(0xC0, 0x250), range(0x1E00, 0x1F00))):
        d = unicodedata.normalize("NFD", c)
        if len(d) > 1 and d[0].isascii() and d[0].isalpha() and _MARKS.fullmatch(d[1:]):
            out[c] = d[0]
    out.update((chr(cp), "") for cp in range(0x300, 0x370) if unicodedata.category(chr(cp)) == "Mn")
    return out


_FOLD = _fold_candidates()


def ascii_twin(backend: Any) -> Any | None:
    """The twin of a `tokenizers.Tokenizer` for ASCII texts, or None when nothing in it gets cheaper."""
    from tokenizers import pre_tokenizers
    from tokenizers import Tokenizer as _Tok

    norm, changed = _ascii_normalizer(backend.normalizer)
    bert_pre = isinstance(backend.pre_tokenizer, pre_tokenizers.BertPreTokenizer)
    if not (changed or bert_pre):
        return None
    twin = _Tok.from_str(backend.to_str())
    twin.normalizer = norm
    if bert_pre:  # each piece is one punctuation character or a run of other non-space ones; spaces go
        twin.pre_tokenizer = _split_pieces(_PUNCT)
    return twin if _added_agree(backend, twin) else None


def _added_agree(backend: Any, twin: Any) -> bool:
    """Whether every normalised added token is looked for as the same text by both tokenizers: the
    original matches one as its normaliser makes it ('café' -> 'cafe' where accents are stripped),
    the twin as its own cheaper normaliser does."""
    def norm(tok: Any, text: str) -> str:
        return text if tok.normalizer is None else tok.normalizer.normalize_str(text)

    return all(norm(backend, t.content) == norm(twin, t.content)
               for t in backend.get_added_tokens_decoder().values() if t.normalized)


def _ascii_normalizer(n: Any) -> tuple[Any, bool]:
    """(a normalizer doing to ASCII text what `n` does, whether it is cheaper). Unicode
    normalization forms are the identity on ASCII and go; a BertNormalizer keeps its cleaning and
    lowercasing; a Sequence is simplified piece by piece; anything else is kept as it is."""
    from tokenizers import Regex, normalizers

    if isinstance(n, (normalizers.NFC, normalizers.NFD, normalizers.NFKC, normalizers.NFKD)):
        return None, True
    if isinstance(n, normalizers.BertNormalizer):
        parts = []
        if n.clean_text:
            parts += [normalizers.Replace(Regex(_CONTROL), ""), normalizers.Replace(Regex(_BREAKS), " ")]
        if n.lowercase:
            parts.append(normalizers.Lowercase())
        return (normalizers.Sequence(parts) if parts else None), True
    if isinstance(n, normalizers.Sequence):
        pieces = [_ascii_normalizer(c) for c in n]
        kept = [c for c, _ in pieces if c is not None]
        return (normalizers.Sequence(kept) if kept else None), any(ch for _, ch in pieces)
    return n, False


def encode_batch(backend: Any, twin: Any | None, texts: Sequence[str]) -> list[Any]:
    """`backend.encode_batch_fast(texts)`, with the ASCII texts encoded by `twin` when there is one."""
    texts = list(texts)
    if twin is None:
        return encodings(backend, texts)
    flags = [t.isascii() for t in texts]
    if all(flags):
        return encodings(twin, texts)
    if not any(flags):
        return encodings(backend, texts)
    fast = iter(encodings(twin, [t for t, f in zip(texts, flags) if f]))
    slow = iter(encodings(backend, [t for t, f in zip(texts, flags) if not f]))
    return [next(fast) if f else next(slow) for f in flags]


# ---- the lean twin ---------------------------------------------------------------------------

_PROBES = ("a", "hello world", "x.", "[CLS] z")  # texts whose full encodings show the specials' places


@dataclasses.dataclass(frozen=True)
class Lean:
    """A BERT-style tokenizer's lean twin: `backend` gives a text's ids without special tokens and
    uncut; the full encoding is `prefix + ids[:limit - len(prefix) - len(suffix)] + suffix`."""

    backend: Any = dataclasses.field(repr=False)
    prefix: tuple[int, ...]
    suffix: tuple[int, ...]
    table: Any = dataclasses.field(default=None, repr=False, compare=False)  # `PieceTable` of backend
    wide: frozenset = frozenset()  # the non-ASCII punctuation (`_WIDE`) this twin splits as the original
    cjk: bool = False  # whether CJK ideographs take the lean path (each a piece, as the original makes it)
    fold: dict = dataclasses.field(default_factory=dict, repr=False)  # code point -> its letter without accents

    @functools.cached_property
    def refuse(self) -> re.Pattern:
        """A character that keeps a text off the lean path: non-ASCII, neither wide nor folded."""
        taken = "".join(sorted(self.wide | set(map(chr, self.fold))))
        return re.compile(f"[^\\x00-\\x7f{taken}{_CJK if self.cjk else ''}]")

    def takes(self, max_length: int | None) -> bool:
        """Whether a limit leaves room for text between the special tokens."""
        return max_length is None or max_length > len(self.prefix) + len(self.suffix)

    def encode_ids(self, texts: list[str], max_length: int | None) -> tuple[Any, np.ndarray]:
        """(`TokenIds` of the full encodings, (C,) indices of the texts cut to `max_length`) for
        texts `lean_texts(texts, self.refuse)` accepts."""
        if self.fold:  # on these texts NFD then dropping the marks is `fold` (C speed; str.translate is not)
            texts = [t if t.isascii() else _MARKS.sub("", unicodedata.normalize("NFD", t)) for t in texts]
        bare = (TokenIds.from_encodings(encodings(self.backend, texts)) if self.table is None
                else self.table.encode(texts))
        keep = None if max_length is None else max_length - len(self.prefix) - len(self.suffix)
        return bare.wrapped(self.prefix, self.suffix, keep)


def lean_twin(backend) -> Lean | None:
    """The lean twin of a `tokenizers.Tokenizer` (padding and truncation off), or None where the
    reduction is not exact: another normalizer or pre-tokenizer, an added token with whitespace in
    it, or a post-processor that does not put the same ids before and after every text."""
    from tokenizers import normalizers, pre_tokenizers
    from tokenizers import Tokenizer as _Tok

    n = backend.normalizer
    parts = list(n) if isinstance(n, normalizers.Sequence) else [n]
    if not (isinstance(backend.pre_tokenizer, pre_tokenizers.BertPreTokenizer)
            and any(isinstance(p, normalizers.BertNormalizer) for p in parts)
            and all(isinstance(p, (normalizers.BertNormalizer, normalizers.Lowercase)) for p in parts)):
        return None
    if any(any(c.isspace() for c in t.content) for t in backend.get_added_tokens_decoder().values()):
        return None  # an added token matched after normalisation could span a tab the original made a space
    lower = any(isinstance(p, normalizers.Lowercase) or p.lowercase for p in parts)
    lean = _Tok.from_str(backend.to_str())
    lean.normalizer = normalizers.Lowercase() if lower else None
    lean.pre_tokenizer = _split_pieces(_PUNCT + _WIDE + _CJK)  # (no non-ASCII character is special in a class)
    lean.post_processor = None
    lean.no_truncation()
    lean.no_padding()
    around = set()
    for probe in _PROBES:
        full, bare = backend.encode(probe).ids, lean.encode(probe).ids
        at = [k for k in range(len(full) - len(bare) + 1) if full[k:k + len(bare)] == bare]
        if not at:
            return None
        around.add((tuple(full[:at[0]]), tuple(full[at[0] + len(bare):])))
    if len(around) != 1:
        return None
    prefix, suffix = around.pop()
    added = backend.get_added_tokens_decoder().values()
    if not _added_agree(backend, lean):
        return None
    if not all(t.content.isascii() for t in added):  # matched in the raw text, before accents fold:
        return Lean(lean, prefix, suffix, PieceTable(lean, lower))  # ASCII texts only
    wide = frozenset(c for c in _WIDE if _same_ids(backend, lean, prefix, suffix, c, c))
    cjk_sample = [chr(a + k * (b - a) // 7) for a, b in _CJK_RANGES for k in range(8)]
    cjk = (any(isinstance(p, normalizers.BertNormalizer) and p.handle_chinese_chars for p in parts)
           and all(_same_ids(backend, lean, prefix, suffix, c, c) for c in cjk_sample))
    # accents go where a BertNormalizer strips them (strip_accents, or lowercase when it is unset);
    # the probes check each letter too (alone they could agree by chance: both [UNK])
    strips = any(isinstance(p, normalizers.BertNormalizer)
                 and (p.strip_accents or (p.strip_accents is None and p.lowercase)) for p in parts)
    fold = {ord(c): b for c, b in _FOLD.items() if strips and _same_ids(backend, lean, prefix, suffix, c, b)}
    table = PieceTable(lean, lower, lambda c: c in wide or (cjk and is_cjk(c)))
    return Lean(lean, prefix, suffix, table, wide, cjk, fold)


def _same_ids(backend: Any, lean: Any, prefix: tuple, suffix: tuple, c: str, twin_c: str) -> bool:
    """Whether texts holding `c` encode in the original as the same texts with `twin_c` in its
    place do through the twin (with the specials around): alone, inside a word, repeated, after a
    space, after a capital."""
    probes = ("{}", "a{}b", "{}{} x{}", "E{}.", "the {} end")
    full = backend.encode_batch([p.format(c, c, c) for p in probes])
    twin = lean.encode_batch([p.format(twin_c, twin_c, twin_c) for p in probes])
    return all(f.ids == [*prefix, *t.ids, *suffix] for f, t in zip(full, twin))


def lean_texts(texts: Sequence[str], refuse: re.Pattern | None = None) -> np.ndarray:
    """(N,) bool: the texts a lean twin takes: ASCII, or with no character `refuse` (its
    `Lean.refuse`) finds; no control character but tab / newline / return."""
    ok = np.fromiter(map(str.isascii, texts), dtype=bool, count=len(texts))
    if refuse is not None and not ok.all():
        for i in np.flatnonzero(~ok).tolist():
            ok[i] = refuse.search(texts[i]) is None
    idx = np.flatnonzero(ok)
    if idx.size == 0:
        return ok
    picked = texts if idx.size == len(texts) else [texts[i] for i in idx.tolist()]
    joined = "".join(picked).encode("utf-8")
    b = np.frombuffer(joined, dtype=np.uint8)
    # the controls BertNormalizer's cleaning removes (_CONTROL: 0-8, 11, 12, 14-31, 127), by uint8
    # compares: a 256-entry table gathered by every byte takes several times longer (a non-ASCII
    # character is bytes >= 0x80 in UTF-8: never one of these)
    bad = (b - np.uint8(14) < 18) | (b < 9) | (b == 11) | (b == 12) | (b == 127)
    if bad.any():
        sizes = map(len, picked if len(joined) == sum(map(len, picked)) else map(str.encode, picked))
        ends = np.cumsum(np.fromiter(sizes, dtype=np.int64, count=len(picked)))
        seen = np.concatenate(([0], np.cumsum(bad)))
        ok[idx[seen[ends] != seen[np.concatenate(([0], ends[:-1]))]]] = False
    return ok
