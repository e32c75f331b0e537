"""Text -> packed token ids, with the `tokenizers` library and nothing from `transformers`.

    tok = packedenc.tokenizer("path/to/model")          # reads tokenizer.json
    batch = packedenc.pack_texts(tok, ["a text", "another one"])   # Packed: ids, cu_seqlens, ...

Where the files come from, in order: `tokenizer.json` (what every fast tokenizer saves);
`vocab.txt` (a BERT WordPiece vocabulary, rebuilt as transformers' converter does); `spm.model`
(DeBERTa-v2/v3, rebuilt like transformers 5's `DebertaV2Tokenizer`, needs the optional
`sentencepiece` package: `pip install 'packedenc[sentencepiece]'`).

The length limit is, in order: an explicit `max_length`; sentence-transformers'
`sentence_bert_config.json` `max_seq_length`; `tokenizer_config.json` `model_max_length`; always
capped by the model's position table (`max_position_embeddings`, less RoBERTa's offset).
Padding and truncation settings stored inside `tokenizer.json` are ignored: packed batches are
never padded, and truncation is applied here so that it can be counted and reported.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import warnings
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from packedenc.errors import CheckpointError, InputError, InputTypeError
from packedenc.packing import Packed
from packedenc.text.ascii_twin import Lean, ascii_twin, encode_batch, lean_texts, lean_twin
from packedenc.text.token_ids import TokenIds

__all__ = ["Tokenizer", "TruncationWarning", "tokenizer", "pack_texts", "check_texts", "check_unicode"]

_HUGE = 10**8  # tokenizer_config's "no limit" is 1e30; anything this large means "not set"
_LEAN_TEXTS = 64  # a call of this many texts (or 4x in all) builds the lean twin


class TruncationWarning(UserWarning):
    """Some texts were longer than the model's limit and were cut (one warning per call)."""


@dataclasses.dataclass(frozen=True, eq=False)
class Tokenizer:
    """A `tokenizers.Tokenizer` bound to one model: its length limit and special tokens.

    Fields:
        backend: the `tokenizers.Tokenizer` (padding and truncation switched off).
        max_length: the longest sequence the model takes, special tokens included.
        source: the folder it came from (for messages).
    """

    backend: Any
    max_length: int | None
    source: str = ""
    _cache: dict = dataclasses.field(default_factory=dict, repr=False)
    _lock: Any = dataclasses.field(default_factory=threading.Lock, repr=False)

    @property
    def num_special_tokens(self) -> int:
        pp = self.backend.post_processor
        return 0 if pp is None else pp.num_special_tokens_to_add(False)

    def token_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def _truncating(self, max_length: int | None) -> tuple[Any, Any | None]:
        """A private copy of the backend that truncates to `max_length`, and its ASCII twin or
        None (`ascii_twin.py`). Thread-safe, cached: `enable_truncation` mutates, and `embed`
        tokenizes on a background thread."""
        with self._lock:
            pair = self._cache.get(max_length)
            if pair is None:
                from tokenizers import Tokenizer as _Tok

                t = _Tok.from_str(self.backend.to_str())
                t.no_padding()
                if max_length is None:
                    t.no_truncation()
                else:
                    t.enable_truncation(max_length)
                pair = self._cache[max_length] = (t, ascii_twin(t))
            return pair

    def encode(self, texts: Sequence[str], max_length: int | None = None) -> tuple[list[list[int]], list[int]]:
        """(token ids per text, indices of the texts that were truncated). No checks, no warning."""
        ids, cut = self.encode_ids(texts, max_length)
        return ids.tolist(), cut

    def _lean(self, texts: int = _LEAN_TEXTS) -> Lean | None:
        """The backend's lean twin (`ascii_twin.lean_twin`) or None; built once, thread-safe. Not
        built (None) before a call of `_LEAN_TEXTS` texts or that many in all: its set-up (probes,
        the piece table's seeds) costs more than a few texts take through the library."""
        with self._lock:
            if "lean" not in self._cache:
                seen = self._cache["seen"] = self._cache.get("seen", 0) + texts
                if texts < _LEAN_TEXTS and seen < 4 * _LEAN_TEXTS:
                    return None
                self._cache["lean"] = lean_twin(self.backend)
            return self._cache["lean"]

    def encode_ids(self, texts: Sequence[str], max_length: int | None = None) -> tuple[TokenIds, list[int]]:
        """`encode` as flat host arrays (`TokenIds`): what `embed` and `pack_texts` use. The texts
        a lean twin takes go through it (the special tokens added and the cut made here), the
        others through the full tokenizer; the ids are the same either way."""
        lean = self._lean(len(texts))
        if lean is None or not lean.takes(max_length):
            return self._encode_ids(texts, max_length)
        fast_N = lean_texts(texts, lean.refuse)
        fi = np.flatnonzero(fast_N)
        if fi.size == 0:
            return self._encode_ids(texts, max_length)
        every = fi.size == len(texts)
        ids, cut = lean.encode_ids(list(texts) if every else [texts[i] for i in fi.tolist()], max_length)
        if every:
            return ids, cut.tolist()
        si = np.flatnonzero(~fast_N)
        rest, rest_cut = self._encode_ids([texts[i] for i in si.tolist()], max_length)
        return (TokenIds.interleave(((fi, ids), (si, rest)), len(texts)),
                sorted(fi[cut].tolist() + si[rest_cut].tolist()))

    def _encode_ids(self, texts: Sequence[str], max_length: int | None) -> tuple[TokenIds, list[int]]:
        """`encode_ids` through the full tokenizer (or its ASCII twin)."""
        enc = encode_batch(*self._truncating(max_length), texts)
        ids = TokenIds.from_encodings(enc)
        # Only a text cut to exactly max_length tokens can have overflowed: ask just those.
        maybe = [] if max_length is None else np.flatnonzero(ids.lengths_N == max_length).tolist()
        return ids, [i for i in maybe if enc[i].overflowing]


def check_texts(texts: Any) -> list[str]:
    """Raise a clear error unless `texts` is a non-empty list of non-blank, encodable strings."""
    if isinstance(texts, (str, bytes)):
        raise InputTypeError("texts must be a list of strings, not a single string: wrap it as [text]")
    try:
        texts = list(texts)
    except TypeError:
        raise InputTypeError(f"texts must be a list of strings, got {type(texts).__name__}") from None
    if not texts:
        raise InputError("texts is empty: pass at least one string")
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise InputTypeError(f"texts[{i}] is a {type(t).__name__}, not a str; convert it (or drop it) first")
        if not t.isascii():  # ASCII is always valid; only other texts can hold a lone surrogate
            check_unicode(f"texts[{i}]", t)
    blank = [i for i, t in enumerate(texts) if not t.strip()]
    if blank:
        raise InputError(
            f"{len(blank)} text(s) are empty or whitespace only (indices {blank[:10]}"
            f"{' ...' if len(blank) > 10 else ''}): drop them or replace them with a placeholder"
        )
    return texts


def check_unicode(name: str, t: str) -> None:
    """Raise InputError naming `name` when `t` holds a lone surrogate ("\ud800", or the "\udcff"
    Python makes of an undecodable byte in argv or a file name): no tokenizer can encode it."""
    try:
        t.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InputError(
            f"{name} holds {t[e.start:e.end]!r} at character {e.start}, a lone surrogate that is not valid "
            "Unicode (text decoded with errors='surrogateescape', or cut inside a surrogate pair); decode it "
            "with errors='replace' or drop it"
        ) from None


def _limit(tok: Tokenizer, max_length: int | None) -> int | None:
    if max_length is None:
        return tok.max_length
    if not isinstance(max_length, int) or isinstance(max_length, bool) or max_length <= tok.num_special_tokens:
        raise InputError(
            f"max_length must be an int larger than the {tok.num_special_tokens} special tokens, got {max_length!r}"
        )
    if tok.max_length is not None and max_length > tok.max_length:
        raise InputError(f"max_length={max_length} exceeds this model's limit of {tok.max_length} tokens")
    return max_length


def encode_texts(tok: Tokenizer, texts: Sequence[str], max_length: int | None, truncate: bool
                 ) -> tuple[TokenIds, list[int], int | None]:
    """Tokenize checked texts: (their ids, truncated indices, the limit used). Raises on
    truncation when `truncate=False`; never warns (callers report once per job)."""
    limit = _limit(tok, max_length)
    ids, cut = tok.encode_ids(texts, limit)
    if cut and not truncate:
        raise InputError(
            f"{len(cut)} of {len(texts)} text(s) are longer than {limit} tokens (first: texts[{cut[0]}]); "
            "shorten them, or pass truncate=True to cut them to the model's limit"
        )
    empty = np.flatnonzero(ids.lengths_N == 0)[:10].tolist()
    if empty:
        raise InputError(f"texts {empty[:10]} produce no tokens with this tokenizer; drop them")
    return ids, cut, limit


def warn_truncated(n: int, total: int, limit: int | None, first: int, stacklevel: int = 3) -> None:
    warnings.warn(
        f"{n} of {total} text(s) were longer than {limit} tokens and were truncated (first: texts[{first}]); "
        "pass truncate=False to get an error instead",
        TruncationWarning,
        stacklevel=stacklevel,
    )


def packed_from_ids(ids: Sequence[Sequence[int]] | TokenIds, device: torch.device | str | None = None) -> Packed:
    """Token ids (lists, or flat `TokenIds`) -> `Packed` without a per-sequence tensor."""
    batch = (ids if isinstance(ids, TokenIds) else TokenIds.from_lists(ids)).packed()
    return batch if device is None else batch.to(device)


def pack_texts(tok: Any, texts: Sequence[str], max_length: int | None = None, truncate: bool = True,
               *, device: torch.device | str | None = None) -> Packed:
    """Tokenize texts into one padding-free batch.

    Arguments:
        tok: a `Tokenizer` (from `packedenc.tokenizer(...)`), a model folder, or a loaded
            sentence-transformers model (`packedenc.load_sentence_transformer`).
        texts: a list of non-empty strings.
        max_length: tokens per text, special tokens included (default: the model's limit).
        truncate: cut longer texts (one `TruncationWarning` with the count) or, when False,
            raise `InputError`.
        device: where the packed tensors go (default CPU).
    Return:
        `Packed` (ids (T,), cu_seqlens (S+1,), positions (T,), max_seqlen) in the texts' order.
    """
    tok = tokenizer(tok)
    texts = check_texts(texts)
    ids, cut, limit = encode_texts(tok, texts, max_length, truncate)
    if cut:
        warn_truncated(len(cut), len(texts), limit, cut[0])
    return packed_from_ids(ids, device)


# ---- loading ----------------------------------------------------------------------------------


def tokenizer(model_or_folder: Any, *, max_length: int | None = None) -> Tokenizer:
    """The tokenizer of a model folder (or hub id), ready for `pack_texts`.

    Arguments:
        model_or_folder: a folder holding tokenizer.json (an HF or sentence-transformers model
            folder), a hub id, a loaded sentence-transformers model, a `tokenizers.Tokenizer`,
            or a `Tokenizer` (returned as is).
        max_length: override the model's length limit (never above the position table).
    Return:
        `Tokenizer`.
    """
    if max_length is not None and (not isinstance(max_length, int) or isinstance(max_length, bool) or max_length < 1):
        raise InputError(f"max_length must be a positive int or None, got {max_length!r}")
    if isinstance(model_or_folder, Tokenizer):
        limit = model_or_folder.max_length
        if max_length is not None and limit is not None and max_length > limit:
            raise InputError(f"max_length={max_length} exceeds this model's limit of {limit} tokens")
        return model_or_folder if max_length is None else dataclasses.replace(
            model_or_folder, max_length=max_length, _cache={}, _lock=threading.Lock())
    inner = getattr(model_or_folder, "tokenizer", None)
    if isinstance(inner, Tokenizer):
        return tokenizer(inner, max_length=max_length)
    if type(model_or_folder).__module__.startswith("tokenizers"):
        from tokenizers import Tokenizer as _Tok

        backend = _Tok.from_str(model_or_folder.to_str())  # a copy: the caller's object stays as it was
        backend.no_padding()
        backend.no_truncation()
        return Tokenizer(backend, max_length)
    if not isinstance(model_or_folder, (str, os.PathLike)):
        raise InputTypeError(
            f"tokenizer() needs a model folder, a hub id or a loaded model, got {type(model_or_folder).__name__}; "
            "a params tree does not carry its tokenizer: pass the folder it was loaded from"
        )
    from packedenc.hub import resolve

    root = resolve(model_or_folder)
    folder, st = _transformer_folder(root)
    backend = _load_backend(folder, root)
    if st.get("do_lower_case"):
        _add_lowercase(backend)
    limit = _model_limit(folder, st)
    if max_length is not None:
        if limit is not None and max_length > limit:
            raise InputError(f"max_length={max_length} exceeds this model's limit of {limit} tokens")
        limit = max_length
    return Tokenizer(backend, limit, str(root))


def _read_json(path: Path, kind: type = dict) -> Any:
    if not path.is_file():
        return kind()
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from e
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e.strerror or e}") from e
    if not isinstance(data, kind):
        want = "object" if kind is dict else "list"
        raise CheckpointError(f"{path} must hold a JSON {want}, got {type(data).__name__}")
    return data


def _transformer_folder(root: Path) -> tuple[Path, dict[str, Any]]:
    """(folder holding the backbone + tokenizer, its sentence_bert_config). Old ST saves keep
    them in `0_Transformer/`; current ones at the top."""
    modules = root / "modules.json"
    if modules.is_file():
        for m in _read_json(modules, list):
            if isinstance(m, dict) and str(m.get("type", "")).rsplit(".", 1)[-1] == "Transformer":
                sub = root / m.get("path", "")
                return sub, _read_json(sub / "sentence_bert_config.json")
    return root, _read_json(root / "sentence_bert_config.json")


def _load_backend(folder: Path, root: Path) -> Any:
    from tokenizers import Tokenizer as _Tok

    for f in (folder / "tokenizer.json", root / "tokenizer.json"):
        if f.is_file():
            try:
                t = _Tok.from_file(str(f))
            except Exception as e:
                raise CheckpointError(f"cannot read {f}: {e}") from e
            t.no_padding()
            t.no_truncation()
            return t
    if (folder / "vocab.txt").is_file():
        return _wordpiece(folder)
    if (folder / "spm.model").is_file():
        return _deberta_spm(folder)
    raise CheckpointError(
        f"no tokenizer in {folder}: expected tokenizer.json (or vocab.txt, or a DeBERTa spm.model). "
        "Copy the tokenizer files of the base model into the folder, or save them there once with "
        "transformers: AutoTokenizer.from_pretrained(base).save_pretrained(folder)"
    )


def _wordpiece(folder: Path) -> Any:
    """A BERT WordPiece tokenizer from vocab.txt, configured as transformers' BertConverter does."""
    from tokenizers.implementations import BertWordPieceTokenizer

    cfg = _read_json(folder / "tokenizer_config.json")
    t = BertWordPieceTokenizer(
        str(folder / "vocab.txt"),
        clean_text=True,
        handle_chinese_chars=cfg.get("tokenize_chinese_chars", True),
        strip_accents=cfg.get("strip_accents"),
        lowercase=cfg.get("do_lower_case", True),
    )
    return t._tokenizer  # the underlying tokenizers.Tokenizer


def _deberta_spm(folder: Path) -> Any:
    """DeBERTa-v2/v3's spm.model as a `tokenizers` Unigram, built as transformers 5's
    `DebertaV2Tokenizer.__init__` builds it (normalizers, Metaspace, [CLS] x [SEP], [MASK] added
    after the pieces). Reading the .model file needs the optional `sentencepiece` package."""
    try:
        import sentencepiece
    except ImportError:
        raise CheckpointError(
            f"{folder} ships only spm.model (no tokenizer.json); reading it needs sentencepiece: "
            "pip install 'packedenc[sentencepiece]'"
        ) from None
    from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
    from tokenizers import Tokenizer as _Tok
    from tokenizers.models import Unigram

    sp = sentencepiece.SentencePieceProcessor(model_file=str(folder / "spm.model"))
    cfg = _read_json(folder / "tokenizer_config.json")
    vocab = [(sp.id_to_piece(i), float(sp.get_score(i))) for i in range(sp.get_piece_size())]
    t = _Tok(Unigram(vocab, unk_id=sp.unk_id(), byte_fallback=False))
    norms = [normalizers.Lowercase()] if cfg.get("do_lower_case", False) else []
    norms += [normalizers.Replace(Regex(r"\s{2,}|[\n\r\t]"), " "), normalizers.NFC(),
              normalizers.Strip(left=False, right=True)]
    t.normalizer = normalizers.Sequence(norms)
    pre = [pre_tokenizers.Punctuation(behavior="isolated")] if cfg.get("split_by_punct", False) else []
    scheme = "always" if cfg.get("add_prefix_space", True) else "first"
    t.pre_tokenizer = pre_tokenizers.Sequence(pre + [pre_tokenizers.Metaspace(replacement="\u2581",
                                                                              prepend_scheme=scheme)])
    t.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme=scheme)
    names = {k: str(cfg.get(f"{k}_token") or f"[{k.upper()}]") for k in ("pad", "unk", "cls", "sep", "mask")}
    # Control pieces and the special names become unsplittable special tokens; [MASK] (not an
    # spm piece in DeBERTa-v3) gets the next id, as transformers adds it.
    specials = [sp.id_to_piece(i) for i in range(sp.get_piece_size()) if sp.is_control(i) or sp.is_unknown(i)]
    t.add_special_tokens([AddedToken(w, normalized=False, special=True)
                          for w in dict.fromkeys(specials + list(names.values()))])
    cls, sep = names["cls"], names["sep"]
    t.post_processor = processors.TemplateProcessing(
        single=f"{cls}:0 $A:0 {sep}:0", pair=f"{cls}:0 $A:0 {sep}:0 $B:1 {sep}:1",
        special_tokens=[(cls, t.token_to_id(cls)), (sep, t.token_to_id(sep))],
    )
    return t


def _add_lowercase(backend: Any) -> None:
    """sentence-transformers' `do_lower_case`: prepend Lowercase unless the normalizer has it."""
    from tokenizers import normalizers

    n = backend.normalizer
    parts = list(n) if isinstance(n, normalizers.Sequence) else ([n] if n is not None else [])
    if any(isinstance(p, normalizers.Lowercase) for p in parts):
        return
    if isinstance(n, normalizers.BertNormalizer) and json.loads(backend.to_str())["normalizer"].get("lowercase"):
        return
    backend.normalizer = normalizers.Sequence([normalizers.Lowercase(), *parts])


def _model_limit(folder: Path, st: dict[str, Any]) -> int | None:
    cfg = _read_json(folder / "config.json")
    positions = cfg.get("max_position_embeddings")
    if isinstance(positions, int) and positions > 0:
        if cfg.get("model_type") in ("roberta", "xlm-roberta", "camembert") and cfg.get("pad_token_id") is not None:
            positions -= cfg["pad_token_id"] + 1
    else:
        positions = None
    limit = st.get("max_seq_length")
    if limit is None:
        m = _read_json(folder / "tokenizer_config.json").get("model_max_length")
        limit = int(m) if isinstance(m, (int, float)) and m < _HUGE else None
    if limit is None:
        return positions
    return int(limit) if positions is None else min(int(limit), positions)
