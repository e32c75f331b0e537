"""Byte-level BPE on the lean path (`packedenc/text/bpe_pieces.py`): the same ids as the tokenizer.

The tokenizers are trained here (no hub): GPT-2's pre-tokenizer (ByteLevel with its regex), a
BPE model, and the post-processors of ModernBERT ([CLS] $A [SEP]) and RoBERTa (<s> $A </s>);
one with GPT-NeoX's added runs of spaces (ModernBERT's vocabulary has them).
"""

import random

import numpy as np
import pytest

import packedenc as pe
from packedenc.text import bpe_pieces
from packedenc.text.bpe_pieces import SPLIT, BpePieces, bpe_twin
from tests.texts import BASE, ascii_fuzz, sentences

tokenizers = pytest.importorskip("tokenizers")
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers  # noqa: E402

WORDS = ("the quick brown fox jumps over lazy dog it's don't we've they're I'm you'll he'd "
         "tokenization packed encoders 2024 3.14159 e-mail https example com").split()


def _corpus(n=3000, seed=0):
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 30))) for _ in range(n)] + sentences()


def _train(post="bert", spaces=False, pre=None, normalizer=None, dropout=None):
    tok = tokenizers.Tokenizer(models.BPE(dropout=dropout))
    tok.pre_tokenizer = pre or pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    if normalizer is not None:
        tok.normalizer = normalizer
    specials = ["[CLS]", "[SEP]", "[MASK]", "<s>", "</s>"]
    tok.train_from_iterator(_corpus(), trainers.BpeTrainer(vocab_size=600, special_tokens=specials,
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if spaces:  # GPT-NeoX: runs of 2..24 spaces are added tokens
        tok.add_tokens([tokenizers.AddedToken(" " * k, normalized=False) for k in range(2, 25)])
    if post == "bert":
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", special_tokens=[("[CLS]", tok.token_to_id("[CLS]")), ("[SEP]", tok.token_to_id("[SEP]"))])
    elif post == "roberta":
        tok.post_processor = processors.RobertaProcessing(("</s>", tok.token_to_id("</s>")), ("<s>", tok.token_to_id("<s>")))
    return tok


def _ascii_clean(texts):
    """The lean path's texts: ASCII without control characters but tab, newline, return; non-blank."""
    out = ["".join(c for c in t if c in "\t\n\r" or 32 <= ord(c) < 127) for t in texts]
    return [t for t in out if t.strip()]


EDGE = ["a", " a", "a ", "  a", "a  ", "a   b", "a \t b", "a\t\tb", "x\n\ny", "x\r\n y", " \t x", "x \t",
        "it's", "IT'S", "it'S", "'s", "''s", "x.'s", " 's", "don't'll", "'re've'm'll'd", "rock'n'roll",
        "abc123def", "123 456  789", " 1", "1.5e-10", "!!!", " !!!", "a!!!b", "(x)", "[MASK] a", "a[MASK]b",
        "[CLS]", "x [SEP] y", "<s>hi</s>", "url https://a.b/c?d=e&f=g#h", "a" * 300, "ab " * 200,
        "trailing   ", "   ", "mixed\tws \n\r end", "~`@#$%^&*()_+-={}|[]\\:\";'<>?,./"]


@pytest.mark.parametrize("post", ["bert", "roberta"])
@pytest.mark.parametrize("spaces", [False, True])
@pytest.mark.parametrize("max_length", [None, 9])
def test_lean_bpe_ids_equal_the_tokenizer(post, spaces, max_length):
    backend = _train(post, spaces)
    tok = pe.tokenizer(backend)
    texts = _ascii_clean(ascii_fuzz(300, seed=5)) + _corpus(200, seed=9) + [t for t in EDGE if t.strip()] + BASE
    lean = tok._lean(len(texts))
    assert lean is not None and isinstance(lean.table, BpePieces)
    ids, cut = tok.encode_ids(texts, max_length)
    if max_length is not None:
        backend.enable_truncation(max_length)
    enc = backend.encode_batch(texts)
    assert ids.tolist() == [e.ids for e in enc]
    assert cut == [i for i, e in enumerate(enc) if e.overflowing]
    # again: every piece is a hit now
    size = len(lean.table)
    again, _ = tok.encode_ids(texts, max_length)
    assert np.array_equal(again.ids_T, ids.ids_T) and len(lean.table) == size


def _byte_map():
    """GPT-2's bytes -> unicode table (the ByteLevel alphabet's order)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + list(range(ord("\xae"), 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


_BYTE = _byte_map()


def test_the_split_is_gpt2s_on_ascii():
    """Piece by piece against the library's own ByteLevel pre-tokenizer."""
    pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    for text in _ascii_clean(ascii_fuzz(200, seed=2)) + [t for t in EDGE if t.strip()]:
        want = [p for p, _ in pre.pre_tokenize_str(text)]
        got = SPLIT.findall(text)
        mapped = ["".join(_BYTE[c] for c in p.encode()) for p in got]
        assert mapped == want, text


def test_non_ascii_and_added_tokens_take_the_tokenizer_with_order_kept():
    backend = _train("bert", spaces=True)
    tok = pe.tokenizer(backend)
    texts = ["plain text here", "café au lait", "two  spaces", "a [MASK] b", "Москва", "last one"] * 30
    ids, _ = tok.encode_ids(texts)
    assert ids.tolist() == [e.ids for e in backend.encode_batch(texts)]


def test_a_miss_is_tokenized_once_and_the_dict_stops_at_its_cap(monkeypatch):
    backend = _train("bert")
    lean = bpe_twin(backend)
    calls = []
    real = bpe_pieces.encodings
    monkeypatch.setattr(bpe_pieces, "encodings", lambda b, t: calls.append(list(t)) or real(b, t))
    texts = ["zebra zebra zebra", "zebra quokka"]
    want = [e.ids for e in backend.encode_batch(texts)]
    assert lean.encode_ids(texts, None)[0].tolist() == want
    assert sorted(calls[0]) == sorted({" zebra", "zebra", " quokka"})  # distinct pieces, once
    calls.clear()
    assert lean.encode_ids(texts, None)[0].tolist() == want and not calls
    monkeypatch.setattr(bpe_pieces, "MAX_ENTRIES", len(lean.table) + 1)
    more = ["xylophone yodel", "xylophone"]
    for _ in range(2):  # past the cap: the same ids, the misses asked each time
        assert lean.encode_ids(more, None)[0].tolist() == [e.ids for e in backend.encode_batch(more)]
    assert len(calls) == 2


@pytest.mark.parametrize("change", ["prefix_space", "no_regex", "dropout", "lowercase", "strip", "wordpiece_pre"])
def test_no_twin_where_the_reduction_is_not_exact(change):
    kw = {
        "prefix_space": dict(pre=pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True)),
        "no_regex": dict(pre=pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)),
        "dropout": dict(dropout=0.1),
        "lowercase": dict(normalizer=normalizers.Lowercase()),
        "strip": dict(normalizer=normalizers.Strip()),
        "wordpiece_pre": dict(pre=pre_tokenizers.Whitespace()),
    }[change]
    assert bpe_twin(_train("bert", **kw)) is None


def test_unicode_normalization_forms_keep_the_twin():
    backend = _train("bert", normalizer=normalizers.Sequence([normalizers.NFC()]))
    tok = pe.tokenizer(backend)
    texts = _corpus(50, seed=4)  # with non-ASCII sentences: those take the tokenizer
    assert isinstance(tok._lean(len(texts)).table, BpePieces)
    assert tok.encode_ids(texts)[0].tolist() == [e.ids for e in backend.encode_batch(texts)]
