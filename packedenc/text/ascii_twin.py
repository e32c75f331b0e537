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
"""

from __future__ import annotations

from typing import Any, Sequence

__all__ = ["ascii_twin", "encode_batch"]

# BertNormalizer's clean_text on ASCII: these go (Cc other than \t \n \r), then \t \n \r -> " "
_CONTROL = "[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]"
_BREAKS = "[\t\n\r]"
# BertPreTokenizer on ASCII: split at whitespace (dropped) and around each ASCII punctuation
# character (kept alone: !"#$%&'()*+,-./ :;<=>?@ [\]^_` {|}~), in one regex pass instead of two
_PUNCT = r"!-/:-@\[-`{-~"
_PIECES = f"[{_PUNCT}]|[^\\s{_PUNCT}]+"


def ascii_twin(backend: Any) -> Any | None:
    """The twin of a `tokenizers.Tokenizer` for ASCII texts, or None when nothing in it gets cheaper."""
    from tokenizers import Regex, pre_tokenizers
    from tokenizers import Tokenizer as _Tok

    norm, changed = _ascii_normalizer(backend.normalizer)
    bert_pre = isinstance(backend.pre_tokenizer, pre_tokenizers.BertPreTokenizer)
    if not (changed or bert_pre):
        return None
    twin = _Tok.from_str(backend.to_str())
    twin.normalizer = norm
    if bert_pre:  # each piece is one punctuation character or a run of other non-space ones; spaces go
        twin.pre_tokenizer = pre_tokenizers.Split(Regex(_PIECES), behavior="removed", invert=True)
    return twin


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


def _encode(backend: Any, texts: list[str]) -> list[Any]:
    return (backend.encode_batch_fast if hasattr(backend, "encode_batch_fast") else backend.encode_batch)(texts)


def encode_batch(backend: Any, twin: Any | None, texts: Sequence[str]) -> list[Any]:
    """`backend.encode_batch_fast(texts)`, with the ASCII texts encoded by `twin` when there is one."""
    texts = list(texts)
    if twin is None:
        return _encode(backend, texts)
    flags = [t.isascii() for t in texts]
    if all(flags):
        return _encode(twin, texts)
    if not any(flags):
        return _encode(backend, texts)
    fast = iter(_encode(twin, [t for t, f in zip(texts, flags) if f]))
    slow = iter(_encode(backend, [t for t, f in zip(texts, flags) if not f]))
    return [next(fast) if f else next(slow) for f in flags]
