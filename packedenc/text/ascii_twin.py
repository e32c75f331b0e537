"""A faster twin of a BERT-style tokenizer for ASCII texts: the same ids, a cheaper normalizer.

`BertNormalizer` (BERT, MiniLM, bge, e5 and the other WordPiece models) runs, per character,
text cleaning, CJK spacing, NFD accent stripping and lowercasing; on the tokenizers library's
aligned strings that is about a third of the whole encode of a short English text. On an ASCII
character all of it reduces to: drop the control characters other than tab / newline / return
(`clean_text`; NUL included), turn those three into spaces, lowercase (`lowercase`): ASCII has
no CJK, no accents and no other whitespace. `BertPreTokenizer` (a whitespace pass, then a
punctuation pass) becomes one regex split. The twin is the same tokenizer (WordPiece, added
tokens, post-processor, truncation) with those two swapped, and `encode_batch` sends it only
the ASCII texts (`str.isascii` reads a flag CPython keeps: no scan), the others to the
original, and returns the encodings in input order.
"""

from __future__ import annotations

import json
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
    """The twin of a `tokenizers.Tokenizer` whose normalizer is one `BertNormalizer`, else None."""
    from tokenizers import Regex, normalizers
    from tokenizers import Tokenizer as _Tok

    spec = json.loads(backend.to_str())
    norm = spec.get("normalizer") or {}
    if norm.get("type") != "BertNormalizer":
        return None
    parts = []
    if norm.get("clean_text", True):
        parts += [normalizers.Replace(Regex(_CONTROL), ""), normalizers.Replace(Regex(_BREAKS), " ")]
    if norm.get("lowercase", True):
        parts.append(normalizers.Lowercase())
    twin = _Tok.from_str(backend.to_str())
    twin.normalizer = normalizers.Sequence(parts) if parts else None
    if (spec.get("pre_tokenizer") or {}).get("type") == "BertPreTokenizer":
        from tokenizers import pre_tokenizers

        # each piece is one punctuation character or a run of other non-space ones; the spaces go
        twin.pre_tokenizer = pre_tokenizers.Split(Regex(_PIECES), behavior="removed", invert=True)
    return twin


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
