"""DeBERTa training through the pure encode (reference backend, fp32, CPU): gradients of an MLM and a
classification loss equal transformers' for every leaf, seeded dropout at HF's sites, per-layer
activation checkpointing, compute_dtype with fp32 master weights.

(tests/models/test_deberta_vs_hf.py::test_gradients_match_hf checks an MSE on the hidden states
with an absolute bound; here the losses are the real training heads and the bound is relative.)
"""

import dataclasses

import pytest
import torch

import packedenc as pe
from packedenc.train import losses
from packedenc.convert.hf import to_state_dict
from packedenc.models import deberta
from tests.models.test_deberta_vs_hf import CONFIGS, batch, save_tiny, tiny_config

transformers = pytest.importorskip("transformers")

leaves = torch.utils._pytree.tree_leaves


def rel_err(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def _hf_labels(ids, mask, packed_ids, pos, tgt):
    """The packed masked ids / targets in HF's padded layout (labels -100 where nothing is predicted)."""
    hf_ids = ids.clone()
    hf_ids[mask.bool()] = packed_ids
    flat = torch.full((int(mask.sum()),), -100, dtype=torch.long)
    flat[pos] = tgt
    labels = torch.full_like(ids, -100)
    labels[mask.bool()] = flat
    return hf_ids, labels


def _assert_grads_match(grads, hf, vanishing=()):
    """Every leaf within 1e-4 relative (norm) of HF's gradient.

    A leaf whose gradient is zero in exact arithmetic (`vanishing`: a bias added to every key's
    c2p score shifts all logits of a query equally, and softmax ignores that) holds only rounding
    noise on both sides; it is judged against 1e-6 of the largest leaf gradient instead, and the
    test names those leaves so the exemption cannot spread. A leaf HF never uses (grad None) must
    get an all-zero gradient here too.
    """
    ours, _ = to_state_dict(grads)
    theirs = {n: p.grad for n, p in hf.named_parameters()}
    assert set(ours) == set(theirs)  # every leaf has a gradient to compare
    scale = max(g.norm().item() for g in theirs.values() if g is not None)
    tiny = {n for n, g in theirs.items() if g is not None and g.norm() < 1e-6 * scale}
    assert tiny == set(vanishing), tiny
    for name, gt in theirs.items():
        if gt is None:
            assert not ours[name].any(), f"{name}: unused by HF but has a gradient here"
        else:
            floor = 1e-6 * scale if name in tiny else gt.norm().item()
            assert (ours[name] - gt).norm().item() <= 1e-4 * floor, (name, rel_err(ours[name], gt))


@pytest.mark.parametrize("legacy,extra", [
    (False, {}),  # v3 layout, Microsoft's lm_predictions head (tied to the word embeddings)
    (True, dict(embedding_size=24, tie_word_embeddings=False)),  # cls.predictions, untied decoder, embed_proj
])
def test_mlm_grads_match_hf_for_every_leaf(tmp_path, legacy, extra):
    cfg = tiny_config(**{**CONFIGS["v3"], **extra}, legacy=legacy)
    hf = save_tiny(tmp_path, transformers.DebertaV2ForMaskedLM, cfg)
    params = pe.load(tmp_path)
    packed, ids, mask, _ = batch()
    g = torch.Generator().manual_seed(1)
    masked, pos, tgt = losses.mask_tokens(packed.ids, mask_token_id=4, vocab_size=101, prob=0.3, generator=g)
    assert pos.numel() > 10

    def loss_fn(p):
        h = pe.encode(p, masked, packed.cu_seqlens, packed.max_seqlen, backend="reference")
        return losses.mlm_loss(p, h, pos, tgt, backend="reference")

    grads, loss = torch.func.grad_and_value(loss_fn)(params)
    hf_ids, labels = _hf_labels(ids, mask, masked, pos, tgt)
    hf.zero_grad()
    out = hf(input_ids=hf_ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    assert abs(out.loss.item() - loss.item()) <= 1e-5 * max(1.0, abs(loss.item()))
    _assert_grads_match(grads, hf)


def test_classifier_grads_match_hf_with_conv_and_token_types(tmp_path):
    """Separate c2p / p2c projections, a k=5 grouped conv layer, token types: every leaf, CE loss."""
    cfg = tiny_config(**CONFIGS["conv_k5_groups_separate"], type_vocab_size=2, id2label={0: "a", 1: "b", 2: "c"},
                      pooler_hidden_act="tanh")
    hf = save_tiny(tmp_path, transformers.DebertaV2ForSequenceClassification, cfg)
    params = pe.load(tmp_path)
    packed, ids, mask, types = batch(type_vocab=2)
    labels = torch.arange(packed.cu_seqlens.numel() - 1) % 3

    def loss_fn(p):
        h = pe.encode(p, packed.ids, packed.cu_seqlens, packed.max_seqlen, token_type_ids=types[mask.bool()],
                      backend="reference")
        return losses.classification_loss(deberta.classify(p, h, packed.cu_seqlens, backend="reference"), labels)

    grads = torch.func.grad(loss_fn)(params)
    hf.zero_grad()
    hf(input_ids=ids, attention_mask=mask, token_type_ids=types, labels=labels).loss.backward()
    vanishing = {f"deberta.encoder.layer.{i}.attention.self.pos_key_proj.bias" for i in range(3)}
    _assert_grads_match(grads, hf, vanishing)


# ---- dropout, checkpointing, mixed precision (random tiny params, no HF) -------------------------

CFG = dataclasses.replace(deberta.PRESETS["tiny"], conv_kernel_size=3, conv_act="gelu", hidden_dropout_prob=0.1,
                          attention_probs_dropout_prob=0.2)


def _tiny(**overrides):
    cfg = dataclasses.replace(CFG, **overrides)
    params = pe.init(cfg, torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, cfg.vocab_size, (n,), generator=g) for n in (9, 20, 1, 14)]  # 20 > 16: saturated buckets
    return params, pe.pack(seqs)


def _run(params, b, seed, **kw):
    return pe.encode(params, b.ids, b.cu_seqlens, b.max_seqlen, backend="reference", dropout_seed=seed, **kw)


def test_dropout_reproducible_seeded_and_off_without_a_seed():
    params, b = _tiny()
    assert torch.equal(_run(params, b, 7), _run(params, b, 7))
    assert not torch.allclose(_run(params, b, 7), _run(params, b, 8))
    assert not torch.allclose(_run(params, b, 7), _run(params, b, None))  # None = eval, no dropout
    off, _ = _tiny(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    assert torch.equal(_run(off, b, 7), _run(off, b, None))  # the sites read the config's probabilities


@pytest.mark.parametrize("site", ["hidden_dropout_prob", "attention_probs_dropout_prob"])
def test_each_dropout_probability_is_live(site):
    """Each config field alone changes the seeded output (no site silently ignored)."""
    params, b = _tiny(**{"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, site: 0.3})
    assert (_run(params, b, 3) - _run(params, b, None)).abs().max() > 1e-3


def test_dropout_scales_kept_units_as_hf():
    """Inverted dropout: the mean over many seeds approaches the no-dropout output (unbiased in expectation
    for a linear site). Checked on the embedding site alone (0 layers would be an invalid config, so use
    the embedding output directly through `dropout`, the function every site calls)."""
    from packedenc.models.common import dropout

    x = torch.randn(64, 32)
    mean = torch.stack([dropout(x, 0.25, s, -1, 0) for s in range(400)]).mean(0)
    assert (mean - x).abs().mean() < 0.05 * x.abs().mean()
    kept = (dropout(x, 0.25, 0, -1, 0) != 0).float().mean().item()
    assert 0.7 < kept < 0.8


def test_torch_func_grad_is_reproducible_with_dropout():
    params, b = _tiny()
    w = torch.randn(b.num_tokens, CFG.hidden_size, generator=torch.Generator().manual_seed(2))
    grad = torch.func.grad(lambda p, s: (_run(p, b, s) * w).sum())
    g1, g2, g3 = grad(params, 5), grad(params, 5), grad(params, 6)
    assert all(torch.equal(x, y) for x, y in zip(leaves(g1), leaves(g2)))
    assert any(not torch.allclose(x, y) for x, y in zip(leaves(g1), leaves(g3)))


def _autograd_grads(params, b, w, **kw):
    p = torch.utils._pytree.tree_map(lambda t: t.detach().clone().requires_grad_(True), params)
    (_run(p, b, 3, **kw).float() * w).sum().backward()
    return [t.grad for t in leaves(p)]


def test_checkpoint_gives_the_same_grads_and_reuses_the_position_tables():
    params, b = _tiny()
    w = torch.randn(b.num_tokens, CFG.hidden_size, generator=torch.Generator().manual_seed(4))
    plain, ck = _autograd_grads(params, b, w), _autograd_grads(params, b, w, checkpoint=True)
    assert len(plain) == len(leaves(params))
    for a, c in zip(plain, ck):
        assert a is not None and a.abs().max() > 0
        torch.testing.assert_close(a, c, rtol=1e-6, atol=1e-8)

    # The (R, D) relative table is projected once per layer and term in the forward, never recomputed
    # in the backward: count ops.linear calls on R-row inputs with and without checkpointing.
    R = 2 * CFG.att_span
    ops = pe.get_ops("reference")

    def counted():
        calls = []

        def linear(x, weight, bias=None):
            calls.append(x.shape[0])
            return ops.linear(x, weight, bias)

        return dataclasses.replace(ops, linear=linear), calls

    counts = []
    for checkpoint in (False, True):
        table_ops, calls = counted()
        p = torch.utils._pytree.tree_map(lambda t: t.detach().clone().requires_grad_(True), params)
        out = pe.encode(p, b.ids, b.cu_seqlens, b.max_seqlen, backend=table_ops, dropout_seed=3, checkpoint=checkpoint)
        out.sum().backward()
        counts.append((calls.count(R), len(calls)))
    n_layers, n_terms = CFG.num_hidden_layers, len(CFG.pos_att_type)
    assert counts[0][0] == counts[1][0] == n_layers * n_terms
    assert counts[1][1] > counts[0][1]  # the layers themselves were recomputed


def test_compute_dtype_keeps_fp32_master_grads():
    params, b = _tiny()
    w = torch.randn(b.num_tokens, CFG.hidden_size, generator=torch.Generator().manual_seed(5))

    def loss(p, dt):
        return (pe.encode(p, b.ids, b.cu_seqlens, b.max_seqlen, backend="reference", compute_dtype=dt).float()
                * w).sum()

    out = pe.encode(params, b.ids, b.cu_seqlens, backend="reference", compute_dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    g16, g32 = torch.func.grad(loss)(params, torch.bfloat16), torch.func.grad(loss)(params, None)
    for p, a, c in zip(leaves(params), leaves(g16), leaves(g32)):
        assert p.dtype == a.dtype == torch.float32
        assert rel_err(a, c) < 0.1  # bf16 rounding of a 2-layer forward + backward, not a different function
    assert any(rel_err(a, c) > 0 for a, c in zip(leaves(g16), leaves(g32)))  # bf16 really ran


def test_attention_dropout_with_the_kernel_is_a_config_error_that_says_how_to_turn_it_off():
    params, b = _tiny()
    ops = pe.get_ops("reference")
    fake = dataclasses.replace(ops, chosen=tuple((o, "triton" if o == "deberta_attention" else c)
                                                 for o, c in ops.chosen))
    with pytest.raises(pe.ConfigError, match=r"attention_probs_dropout_prob=0\.2.*backend='reference'.*"
                                             r"attention_probs_dropout_prob=0\.0"):
        pe.encode(params, b.ids, b.cu_seqlens, backend=fake, dropout_seed=1)
    # the advice works: with it at 0 the kernel trains with the hidden dropout sites only
    fixed = dataclasses.replace(params, config=dataclasses.replace(params.config, attention_probs_dropout_prob=0.0))
    out = pe.encode(fixed, b.ids, b.cu_seqlens, backend=fake, dropout_seed=1)
    assert not torch.allclose(out, pe.encode(fixed, b.ids, b.cu_seqlens, backend=fake))
    pe.encode(params, b.ids, b.cu_seqlens, backend=fake)  # inference (no seed) never asks for dropout
