"""Training through the pure encode on the reference backend (fp32, CPU): gradients equal HF's,
mixed precision, reproducible dropout, activation checkpointing, packed losses."""

import pytest
import torch
import torch.nn.functional as F

import packedenc as pe
from packedenc.train import losses
from packedenc.convert.hf import to_state_dict
from packedenc.models import modernbert
from tests.models.test_modernbert_vs_hf import batch, save_tiny, tiny_config

transformers = pytest.importorskip("transformers")


def rel_err(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def test_mlm_grads_match_hf_for_every_leaf(tmp_path):
    cfg = tiny_config(local_attention=8, attention_bias=True, mlp_bias=True, norm_bias=True, classifier_bias=True)
    hf = save_tiny(tmp_path, transformers.ModernBertForMaskedLM, cfg)
    params = pe.load(tmp_path)
    packed, ids, mask = batch()
    g = torch.Generator().manual_seed(1)
    masked_ids, pos, tgt = losses.mask_tokens(packed.ids, mask_token_id=4, vocab_size=101, prob=0.3, generator=g)
    assert pos.numel() > 5

    def loss_fn(p):
        h = pe.encode(p, masked_ids, packed.cu_seqlens, packed.max_seqlen, backend="reference")
        return losses.mlm_loss(p, h, pos, tgt)

    loss, grads = torch.func.grad_and_value(loss_fn)(params)[::-1]

    # HF: same masked tokens in the padded layout, labels -100 elsewhere
    hf_ids = ids.clone()
    hf_ids[mask.bool()] = masked_ids
    labels = torch.full_like(ids, -100)
    flat = labels[mask.bool()]
    flat[pos] = tgt
    labels[mask.bool()] = flat
    hf.zero_grad()
    out = hf(input_ids=hf_ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    assert abs(out.loss.item() - loss.item()) < 1e-5

    ours, _ = to_state_dict(grads)
    theirs = {n: p.grad for n, p in hf.named_parameters()}
    assert set(ours) == set(theirs)  # every leaf has a gradient to compare
    for name, gt in theirs.items():
        assert rel_err(ours[name], gt) <= 1e-4, name


def test_classifier_grads_match_hf(tmp_path):
    cfg = tiny_config(local_attention=8, num_labels=3, classifier_pooling="mean")
    hf = save_tiny(tmp_path, transformers.ModernBertForSequenceClassification, cfg)
    params = pe.load(tmp_path)
    packed, ids, mask = batch()
    labels = torch.arange(len(packed.cu_seqlens) - 1) % 3

    def loss_fn(p):
        h = pe.encode(p, packed.ids, packed.cu_seqlens, packed.max_seqlen)
        return losses.classification_loss(modernbert.classify(p, h, packed.cu_seqlens), labels)

    grads = torch.func.grad(loss_fn)(params)
    hf(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    ours, _ = to_state_dict(grads)
    for name, p in hf.named_parameters():
        assert rel_err(ours[name], p.grad) <= 1e-4, name


CFG = modernbert.ModernBertConfig(vocab_size=60, hidden_size=32, intermediate_size=40, num_hidden_layers=3,
                                  num_attention_heads=4, local_attention=4, embedding_dropout=0.1,
                                  attention_dropout=0.1, mlp_dropout=0.2)


def _tiny():
    return pe.init(CFG, torch.Generator().manual_seed(0)), pe.pack([[1, 2, 3, 4, 5, 6, 7, 8, 9], [10, 11], [12]])


def test_dropout_reproducible_and_checkpoint_equivalent():
    params, b = _tiny()
    run = lambda seed, ck=False: pe.encode(params, b.ids, b.cu_seqlens, dropout_seed=seed, checkpoint=ck)  # noqa: E731
    assert torch.equal(run(7), run(7))
    assert not torch.allclose(run(7), run(8))
    assert not torch.allclose(run(7), pe.encode(params, b.ids, b.cu_seqlens))  # None = eval, no dropout

    w = torch.randn(b.num_tokens, 32)

    def grad_of(ck):  # torch.autograd: torch.func does not support checkpoint's saved-tensor hooks
        p = torch.utils._pytree.tree_map(lambda t: t.clone().requires_grad_(True), params)
        (pe.encode(p, b.ids, b.cu_seqlens, dropout_seed=3, checkpoint=ck) * w).sum().backward()
        return [t.grad for t in torch.utils._pytree.tree_leaves(p)]

    for a, c in zip(grad_of(False), grad_of(True)):
        assert a.abs().max() > 1e-4
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-7)


def test_attention_dropout_needs_reference_attention():
    params, b = _tiny()
    ops = pe.get_ops("reference")
    fake = type(ops)(**{**ops.__dict__, "chosen": tuple((k, "flash" if k == "varlen_attention" else v) for k, v in ops.chosen)})
    with pytest.raises(pe.ConfigError, match="attention_dropout"):
        pe.encode(params, b.ids, b.cu_seqlens, dropout_seed=1, backend=fake)


def test_compute_dtype_keeps_master_weights():
    params, b = _tiny()

    w = torch.randn(b.num_tokens, 32)  # a generic loss: the mean square of a LayerNorm output is ~constant

    def loss(p, dt):
        return (pe.encode(p, b.ids, b.cu_seqlens, compute_dtype=dt).float() * w).sum()

    g16 = torch.func.grad(loss)(params, torch.bfloat16)
    g32 = torch.func.grad(loss)(params, None)
    assert pe.encode(params, b.ids, b.cu_seqlens, compute_dtype=torch.bfloat16).dtype == torch.bfloat16
    for a, c in zip(torch.utils._pytree.tree_leaves(g16), torch.utils._pytree.tree_leaves(g32)):
        assert a.dtype == torch.float32
        assert rel_err(a, c) < 0.1


def test_info_nce_and_classification_match_formulas():
    q, p = torch.randn(4, 8), torch.randn(6, 8)
    qn, pn = F.normalize(q, dim=-1), F.normalize(p, dim=-1)
    want = F.cross_entropy(qn @ pn.T / 0.05, torch.arange(4))
    torch.testing.assert_close(losses.info_nce(q, p), want)
    with pytest.raises(pe.InputError, match="at least one passage per query"):
        losses.info_nce(q, p[:3])
    logits, labels = torch.randn(5, 3), torch.tensor([0, 2, 1, 1, 0])
    torch.testing.assert_close(losses.classification_loss(logits, labels), F.cross_entropy(logits, labels))


def test_maxsim_matches_loop():
    qb, db = pe.pack([[1] * 3, [1] * 1, [1] * 5]), pe.pack([[1] * 4, [1] * 2, [1] * 7, [1]])
    q, d = torch.randn(qb.num_tokens, 6), torch.randn(db.num_tokens, 6)
    got = losses.maxsim_scores(q, qb.cu_seqlens, d, db.cu_seqlens)
    want = torch.tensor([[(qi @ dj.T).max(1).values.sum().item() for dj in pe.unpack(d, db.cu_seqlens)]
                         for qi in pe.unpack(q, qb.cu_seqlens)])
    torch.testing.assert_close(got, want)
    loss = losses.colbert_loss(q, qb.cu_seqlens, d, db.cu_seqlens)
    torch.testing.assert_close(loss, F.cross_entropy(want, torch.arange(3)))


def test_mask_tokens_respects_specials():
    ids = torch.tensor([1, 5, 6, 7, 2, 1, 8, 9, 2] * 20)
    masked, pos, tgt = losses.mask_tokens(ids, mask_token_id=4, vocab_size=50, special_ids=torch.tensor([1, 2]),
                                          prob=0.5, generator=torch.Generator().manual_seed(0))
    assert torch.equal(tgt, ids[pos]) and not torch.isin(tgt, torch.tensor([1, 2])).any()
    assert (masked[pos] == 4).float().mean() > 0.6
    unchanged = torch.ones_like(ids, dtype=torch.bool)
    unchanged[pos] = False
    assert torch.equal(masked[unchanged], ids[unchanged])
