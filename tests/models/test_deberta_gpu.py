"""DeBERTa-v3 on the GPU (issue 5, item 4), `gpu` marker: the whole model on the auto backend (the
Triton disentangled-attention kernel) against transformers' eager DebertaV2 in fp32, classifier
decisions against transformers fp32 on 4096 random inputs, and the CUDA-graphed encode.

The kernel alone (ragged packs, isolation, determinism) and the whole model against packedenc's
fp32 reference are in tests/kernels/test_deberta_attention.py.

All models here are DeBERTa-v3-base-shaped (width 768, 12 heads of 64, FFN 3072, 256 log buckets
over 512 positions, shared position projections) with random weights; only the depth and the
vocabulary (1000 ids: the table size changes no numerics) are cut where said.
"""

import dataclasses
import functools

import pytest
import torch

import packedenc as pe
from benchmarks import common
from packedenc.convert.hf import to_state_dict
from packedenc.cudagraphs import graphed, pad_batch
from packedenc.models import deberta

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.gpu

VOCAB = 1000
THREE_LABELS = ((0, "entailment"), (1, "neutral"), (2, "contradiction"))  # MNLI's head
# The attention lengths, each at a bucket / tile edge, and the 8192-token maximum.
LENGTHS = (1, 2, 37, 127, 128, 129, 255, 256, 257, 511, 512, 513, 2048, 8192)


def v3_base_params(layers, heads=(), seed=0, noise=0.02):
    """Random v3-base-shaped params: packedenc's init (normal(0, 0.02), unit norms, zero biases),
    then every leaf perturbed by N(0, noise) so biases and norms matter too."""
    cfg = dataclasses.replace(deberta.PRESETS["v3-base"], num_hidden_layers=layers, vocab_size=VOCAB,
                              id2label=THREE_LABELS if "classifier" in heads else ())
    params = deberta.init(cfg, torch.Generator().manual_seed(seed), heads=heads)
    g = torch.Generator().manual_seed(seed + 1)
    return torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t + noise * torch.randn(t.shape, generator=g),
                                             params)


def hf_model(params, cls, dtype):
    """transformers' eager model holding exactly `params` (packedenc's export, loaded key for key)."""
    sd, cfg_dict = to_state_dict(params)
    cfg = transformers.DebertaV2Config.from_dict(cfg_dict)
    with torch.device("cuda"):
        model = cls._from_config(cfg, attn_implementation="eager", dtype=dtype)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not missing and not unexpected, (missing[:4], unexpected[:4])
    return model.eval()


def random_batch(lengths, seed=0, device="cuda"):
    g = torch.Generator().manual_seed(seed)
    return pe.pack([torch.randint(0, VOCAB, (n,), generator=g) for n in lengths], device=device)


def cosine_rows(a, b):
    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1)


# ---- the whole model against transformers ------------------------------------------------------


def _hf_rows(model, batch):
    """HF last hidden state of every real token, packed order; one sequence per call (no padding:
    a padded 8192 x 8192 grid for 14 sequences would be ~40 GB in fp32)."""
    out = []
    with torch.inference_mode():
        for s in pe.unpack(batch.ids, batch.cu_seqlens):
            out.append(model(input_ids=s[None]).last_hidden_state[0])
    return torch.cat(out)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_encode_matches_hf_eager_fp32(dtype):
    """fp16 / bf16 packed encode (auto: the Triton kernel) vs transformers eager in fp32: cosine >=
    0.999 on every real token, and the max error at most twice that of transformers itself run in
    the same dtype (the design's 2x rule, here against the oracle rather than our reference)."""
    assert dict(pe.get_ops("auto", "cuda").chosen)["deberta_attention"] == "triton"
    params = v3_base_params(layers=2)
    batch = random_batch(LENGTHS)
    want = _hf_rows(hf_model(params, transformers.DebertaV2Model, torch.float32), batch)
    lowp = _hf_rows(hf_model(params, transformers.DebertaV2Model, dtype), batch)
    low = pe.tree_to(pe.tree_cast(params, dtype), "cuda")
    with torch.inference_mode():
        got = pe.encode(low, batch.ids, batch.cu_seqlens, batch.max_seqlen, backend="auto")
    assert got.dtype == dtype and got.shape == want.shape and torch.isfinite(got).all()
    cos = cosine_rows(got, want)
    worst = int(cos.argmin())
    assert cos.min() >= 0.999, f"min cos {cos.min():.5f} at token {worst} (mean {cos.mean():.6f})"
    e, base = (got.float() - want).abs().max().item(), (lowp.float() - want).abs().max().item()
    atol = 1e-3 * want.abs().max().item()
    assert e <= 2 * base + atol, f"max err {e:.3g} > 2 x {base:.3g} (transformers in {dtype}) + {atol:.3g}"
    print(f"{dtype}: min cos {cos.min():.5f}, max err {e:.3g} (transformers {dtype}: {base:.3g})")


# ---- classifier decisions ----------------------------------------------------------------------


def _decisions(fn, workload):
    out = []
    with torch.inference_mode():
        for i in range(len(workload.batches)):
            out.append(fn(workload.batch(i)).float().argmax(-1).cpu())
    return torch.cat(out)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_classifier_decisions_match_hf_fp32(dtype):
    """A random v3-base-shaped MNLI classifier (pooler + 3 labels) on the issue's `mnli` workload
    (4096 random-id sequences, median 36 tokens): packedenc in fp16 takes transformers fp32's
    decision on >= 99.9% of them.

    Why 2 layers, not 12 (runtime is not the reason: 12 would take seconds on an H200): through 12
    random layers the first-token features collapse and one label wins almost everywhere (93% of
    1024 of these inputs on the CPU in fp32), so agreement would be hollow; at 2 layers the labels
    spread (51 / 28 / 20%) and the test asserts they do. Random weights also leave some inputs at
    near-ties that any rounding flips (a trained head's margins are wide): the plain fp16 reference
    (fp32 math, fp16 between ops) agreed with fp32 on 4094 of these 4096 inputs on the CPU.

    bf16: its 8-bit mantissa flips ~0.5% of these near-ties even in the plain bf16 reference
    (4077 / 4096 on the CPU), as DisentangledFlash reports for MNLI (fp16 full decision parity, bf16
    not). So bf16 must be no worse than transformers' own bf16 eager, to within 4 decisions.
    """
    params = v3_base_params(layers=2, heads=("classifier",))
    w = common.make_workload(common.DEBERTA_WORKLOADS["mnli"], VOCAB, seed=0)
    assert len(w.lengths) == 4096

    def hf(model):
        def run(b):
            ids, mask = b.padded(0)
            return model(input_ids=ids.cuda(), attention_mask=mask.cuda()).logits
        return run

    want = _decisions(hf(hf_model(params, transformers.DebertaV2ForSequenceClassification, torch.float32)), w)
    share = torch.bincount(want, minlength=3) / want.numel()
    assert share.min() >= 0.05, f"degenerate head: label shares {share.tolist()} (agreement would be hollow)"
    low = pe.tree_to(pe.tree_cast(params, dtype), "cuda")

    def ours(b):
        ids, cu = b.ids.cuda(), b.cu_seqlens.cuda()
        hidden = pe.encode(low, ids, cu, b.max_seqlen, backend="auto")
        return deberta.classify(low, hidden, cu, backend="auto")

    agree = (_decisions(ours, w) == want).float().mean().item()
    hf_lowp = (_decisions(hf(hf_model(params, transformers.DebertaV2ForSequenceClassification, dtype)), w)
               == want).float().mean().item()
    print(f"{dtype}: packedenc agrees with transformers fp32 on {agree:.4%}, transformers {dtype} on {hf_lowp:.4%}")
    floor = 0.999 if dtype == torch.float16 else min(0.999, hf_lowp - 4 / 4096)
    assert agree >= floor, f"{dtype}: decisions agree on {agree:.4%} < {floor:.4%} (transformers {dtype}: {hf_lowp:.4%})"


# ---- CUDA graphs ---------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _graph_params():
    return pe.tree_to(pe.tree_cast(v3_base_params(layers=2), torch.float16), "cuda")


def _batches():
    mnli = common.make_workload(common.DEBERTA_WORKLOADS["mnli"], VOCAB)
    doc = common.make_workload(common.DEBERTA_WORKLOADS["doc1k"], VOCAB)
    return {
        "mnli-0": mnli.batch(0), "doc1k-0": doc.batch(0),
        "ragged": random_batch((2047, 1, 300), seed=3, device="cpu"),
        "one-token": random_batch((1,), seed=4, device="cpu"),
        "long-8192": random_batch((8192,), seed=5, device="cpu"),
    }


def test_gpu_graphed_deberta_replays_eager():
    """`packedenc.cudagraphs.graphed` on DeBERTa params (the budget of the benchmark's graphed
    system): each replay is bitwise the eager encode of the same padded buffers and close to the
    eager encode of the real batch."""
    params = _graph_params()
    g = graphed(params, max_tokens=16384, max_seqs=16)
    with torch.inference_mode():
        for name, b in _batches().items():
            ids, cu = b.ids.cuda(), b.cu_seqlens.cuda()
            out = g(ids, cu, b.max_seqlen)
            bucket = g.bucket_for(ids.numel(), cu.numel() - 1, b.max_seqlen)
            pids, pcu, _ = pad_batch(ids, cu, bucket)
            padded = pe.encode(params, pids, pcu, bucket.max_seqlen)[: ids.numel()]
            assert torch.equal(out, padded), f"{name}: max diff {(out.float() - padded.float()).abs().max()}"
            eager = pe.encode(params, ids, cu, b.max_seqlen)
            cos = cosine_rows(out, eager)
            assert cos.min() >= 0.999, f"{name}: min cos {cos.min():.5f}"
    assert g.num_graphs == len(_batches())


def test_gpu_graphed_deberta_bucket_reuse():
    """A second batch in a captured bucket replays with its own values (the buffers are refreshed)."""
    params = _graph_params()
    g = graphed(params, max_tokens=16384, max_seqs=16)
    x, y = (random_batch([36] * 16, seed=s) for s in (10, 11))  # same shape, other ids: one bucket
    with torch.inference_mode():
        ox = g(x.ids, x.cu_seqlens, x.max_seqlen)
        oy = g(y.ids, y.cu_seqlens, y.max_seqlen)
        assert g.num_graphs == 1
        for out, b in ((ox, x), (oy, y)):
            assert cosine_rows(out, pe.encode(params, b.ids, b.cu_seqlens, b.max_seqlen)).min() >= 0.999
        assert torch.equal(g(x.ids, x.cu_seqlens, x.max_seqlen), ox)  # replay is deterministic
