"""The training step (`packedenc.train.make_step`) and its graphed replay (`packedenc.cudagraphs.graphed_step`).

CPU: the pure step equals torch.optim.AdamW + clip_grad_norm_; the graphed step runs its padded
phases eagerly (capture=False) and must equal a hand-written eager step on the unpadded batches;
bucket selection, overflow fallback, gradient accumulation, clipping, exact-zero dummy gradients,
bad input. GPU (`gpu`): graphs replayed vs the eager step after 20 steps, ModernBERT and DeBERTa.
"""

import copy

import pytest
import torch

import packedenc as pe
from packedenc.cudagraphs import Pad, graphed_step
from packedenc.models import deberta, modernbert
from packedenc.train import AdamW, TrainState, losses, make_step

TINY = modernbert.ModernBertConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, local_attention=8, pad_token_id=0, cls_token_id=1,
                                   sep_token_id=2, id2label=((0, "a"), (1, "b")))
PAD_ID = 63  # a token the batches never use: its embedding row must get exactly zero gradient


def _clone(params):  # a state is donated to the step: give it its own tensors
    return torch.utils._pytree.tree_map(lambda t: t.clone(), params)


def _params(device="cpu", cfg=TINY):
    return pe.tree_to(pe.init(cfg, torch.Generator().manual_seed(0), heads=("classifier",)), device)


def _batch(g, n, lo=3, hi=12, device="cpu"):
    seqs = [torch.randint(3, 60, (int(torch.randint(lo, hi + 1, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]
    return {"text": pe.pack(seqs, device=device), "labels": torch.randint(0, 2, (n,), generator=g).to(device)}


def classify_loss(params, batch, backend="reference"):
    b = batch["text"]
    h = pe.encode(params, b.ids, b.cu_seqlens, b.max_seqlen, backend=backend)
    logits = modernbert.classify(params, h, b.cu_seqlens, backend=backend)
    return losses.classification_loss(logits, batch["labels"])  # dummy sequences: label -100, ignored


PAD = {"labels": Pad("text.seqs", -100)}


def _torch_steps(params, batches, lr=1e-2, clip=None, accumulate=1):
    """The hand-written eager step: autograd + torch.optim.AdamW (+ clip_grad_norm_)."""
    leaves = [t.detach().clone().requires_grad_(True) for t in torch.utils._pytree.tree_leaves(params)]
    spec = torch.utils._pytree.tree_structure(params)
    opt = torch.optim.AdamW(leaves, lr=lr, weight_decay=0.01)
    out = []
    for i in range(0, len(batches), accumulate):
        opt.zero_grad()
        group = batches[i:i + accumulate]
        ls = [classify_loss(torch.utils._pytree.tree_unflatten(leaves, spec), b) / len(group) for b in group]
        for l_ in ls:
            l_.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(leaves, clip)
        opt.step()
        out.append(float(sum(l_.detach() for l_ in ls)))
    return out, leaves


def _assert_params_close(state, leaves, atol):
    for a, b in zip(torch.utils._pytree.tree_leaves(state.params), leaves):
        torch.testing.assert_close(a, b.detach(), rtol=0, atol=atol)


def test_pure_step_equals_torch_adamw_and_leaves_its_input_alone():
    params, g = _params(), torch.Generator().manual_seed(1)
    batches = [_batch(g, 5) for _ in range(4)]
    step = make_step(classify_loss, AdamW(lr=1e-2, weight_decay=0.01), clip_norm=0.5)
    state = TrainState.create(_clone(params), step.optimizer)
    before = copy.deepcopy(state)
    got = []
    for b in batches:
        loss, state = step(state, b)
        got.append(float(loss))
    want, leaves = _torch_steps(params, batches, clip=0.5)
    assert got == pytest.approx(want, rel=1e-5)
    _assert_params_close(state, leaves, 2e-5)
    # the first state is untouched by the pure calls: its params are still the initial ones
    assert all(torch.equal(a, b) for a, b in zip(torch.utils._pytree.tree_leaves(before.params),
                                                 torch.utils._pytree.tree_leaves(_params())))


def test_step_runs_the_backward_on_the_calling_thread_and_restores_the_mode():
    """`backward_grads`: the engine's thread mode is off while the step's backward runs (on CUDA
    the backward then stays on this thread instead of the engine's device thread) and back on after."""
    import threading

    seen = []

    class Spy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            seen.append((threading.get_ident(), torch.autograd.is_multithreading_enabled()))
            return g

    def loss_fn(params, batch):
        return Spy.apply(classify_loss(params, batch))

    step = make_step(loss_fn, AdamW(lr=1e-2))
    state = TrainState.create(_params(), step.optimizer)
    assert torch.autograd.is_multithreading_enabled()
    loss, grads = step.grads(state.params, _batch(torch.Generator().manual_seed(5), 3))
    assert seen == [(threading.get_ident(), False)]
    assert torch.autograd.is_multithreading_enabled()
    assert torch.isfinite(loss) and any(bool(g.abs().sum() > 0) for g in grads)


@pytest.mark.parametrize("clip", [None, 0.05])  # 0.05: every step is clipped
def test_graphed_step_on_cpu_equals_the_eager_step(clip):
    params, g = _params(), torch.Generator().manual_seed(2)
    batches = [_batch(g, n) for n in (5, 3, 7, 5, 2, 6)]
    step = make_step(classify_loss, AdamW(lr=1e-2), clip_norm=clip)
    jstep = graphed_step(step, TrainState.create(_clone(params), step.optimizer), max_tokens=128, max_seqs=8, pad=PAD,
                         pad_id=PAD_ID)
    got = [float(jstep(b)) for b in batches]
    want, leaves = _torch_steps(params, batches, clip=clip)
    assert got == pytest.approx(want, rel=1e-4, abs=1e-6)  # fp32: the padded batch sums in another order
    _assert_params_close(jstep.state, leaves, 1e-4)
    assert len(jstep._entries) >= 2  # several batch shapes: several buckets
    if clip is not None:
        assert float(jstep.grad_norm) > clip  # the norm before clipping is reported


def test_gradient_accumulation_is_the_mean_over_micro_batches():
    params, g = _params(), torch.Generator().manual_seed(3)
    batches = [_batch(g, n) for n in (4, 6, 3, 5)]
    step = make_step(classify_loss, AdamW(lr=1e-2))
    jstep = graphed_step(step, TrainState.create(_clone(params), step.optimizer), max_tokens=128, max_seqs=8, pad=PAD)
    got = [float(jstep(batches[0:2])), float(jstep(batches[2:4]))]
    want, leaves = _torch_steps(params, batches, accumulate=2)
    assert got == pytest.approx(want, rel=1e-5)
    _assert_params_close(jstep.state, leaves, 1e-4)


def test_compute_dtype_is_casting_inside_the_loss():
    """make_step(compute_dtype=bf16): one cast outside autograd, bf16 gradients widened by the
    accumulator; the same losses and params as autograd through `tree_cast` inside the loss."""
    params, g = _params(), torch.Generator().manual_seed(9)
    batches = [_batch(g, n) for n in (4, 6, 3, 5)]
    outside = make_step(classify_loss, AdamW(lr=1e-2), compute_dtype=torch.bfloat16)
    inside = make_step(lambda p, b: classify_loss(pe.tree_cast(p, torch.bfloat16), b), AdamW(lr=1e-2))
    a, b = TrainState.create(_clone(params), outside.optimizer), TrainState.create(_clone(params), inside.optimizer)
    got = [float(outside.update_(a, batches[i:i + 2])) for i in (0, 2)]  # 2 micro-batches a step
    want = [float(inside.update_(b, batches[i:i + 2])) for i in (0, 2)]
    assert got == want
    for x, y in zip(torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)):
        assert x.dtype == y.dtype and torch.equal(x, y)
    jstep = graphed_step(outside, TrainState.create(_clone(params), outside.optimizer), max_tokens=128, max_seqs=8,
                         pad=PAD)
    assert [float(jstep(batches[i:i + 2])) for i in (0, 2)] == pytest.approx(want, rel=1e-2)  # padded bf16 sums
    with pytest.raises(pe.ConfigError, match="compute_dtype"):
        make_step(classify_loss, AdamW(), compute_dtype=torch.int32)


def test_expanded_gradients_reach_the_fused_update_as_plain_tensors():
    """`b.sum()` has an expanded (stride-0) gradient; the fused AdamW needs contiguous ones."""
    params = {"w": torch.randn(3, 5), "b": torch.randn(5)}
    x = torch.randn(4, 3)

    def loss(p, x):
        return (x @ p["w"]).square().sum() + p["b"].sum()

    step = make_step(loss, AdamW(lr=0.1), clip_norm=1.0)
    state = TrainState.create({k: v.clone() for k, v in params.items()}, step.optimizer)
    leaves = [v.clone().requires_grad_(True) for v in params.values()]
    opt = torch.optim.AdamW(leaves, lr=0.1)
    for _ in range(3):
        step.update_(state, [x, x])  # two micro-batches: the mean of equal gradients
        opt.zero_grad()
        loss(dict(zip(params, leaves)), x).backward()
        torch.nn.utils.clip_grad_norm_(leaves, 1.0)
        opt.step()
    for k, ref in zip(params, leaves):
        torch.testing.assert_close(state.params[k], ref.detach(), rtol=1e-5, atol=1e-6)


def test_bucket_selection_and_overflow_fallback():
    params, g = _params(), torch.Generator().manual_seed(4)
    step = make_step(classify_loss, AdamW(lr=1e-2))
    jstep = graphed_step(step, TrainState.create(_clone(params), step.optimizer), max_tokens=40, max_seqs=4, pad=PAD)
    small, same_bucket, big = _batch(g, 3, 3, 5), _batch(g, 3, 3, 5), _batch(g, 8, 8, 12)
    assert jstep.bucket_for(small) is not None and jstep.bucket_for(big) is None  # 8 seqs > max_seqs
    (name, bucket), = jstep.bucket_for(small)
    assert name == "text" and bucket.tokens >= small["text"].num_tokens + 1 and bucket.seqs >= 3
    assert jstep.bucket_for(same_bucket) == jstep.bucket_for(small)  # small packs share the first bucket
    with pytest.warns(UserWarning, match="over the graphed step's budget"):
        jstep(big)
    jstep(small)
    jstep(same_bucket)
    assert len(jstep._entries) == 1  # the big batch ran unpadded, outside the buckets
    want, leaves = _torch_steps(params, [big, small, same_bucket])
    _assert_params_close(jstep.state, leaves, 1e-4)


def test_dummy_tokens_and_sequences_get_exactly_zero_gradient():
    params, g = _params(), torch.Generator().manual_seed(5)
    step = make_step(classify_loss, AdamW(lr=1e-2))
    jstep = graphed_step(step, TrainState.create(_clone(params), step.optimizer), max_tokens=128, max_seqs=8, pad=PAD,
                         pad_id=PAD_ID)
    b = _batch(g, 5)
    key = jstep.bucket_for(b)
    bucket = dict(key)["text"]
    assert bucket.tokens > b["text"].num_tokens  # there are dummy tokens in the padded batch
    jstep._accumulate(b, first=True)
    padded = jstep._entries[key].batch
    assert (padded["labels"][5:] == -100).all() and padded["text"].cu_seqlens.numel() == bucket.seqs + 2
    word = torch.utils._pytree.tree_leaves(params.embeddings)[0]
    idx = [i for i, t in enumerate(torch.utils._pytree.tree_leaves(params)) if t is word][0]
    assert torch.count_nonzero(jstep._acc[idx][PAD_ID]) == 0  # the dummies' token row: exactly zero
    assert torch.count_nonzero(jstep._acc[idx][3:60].abs().sum(1)) > 0  # real rows do get gradient


def test_mlm_masked_positions_on_a_free_axis():
    params = pe.tree_to(pe.init(TINY, torch.Generator().manual_seed(0), heads=("mlm",)), "cpu")
    g = torch.Generator().manual_seed(6)

    def mlm(params, batch):
        b = batch["text"]
        h = pe.encode(params, b.ids, b.cu_seqlens, b.max_seqlen, backend="reference")
        return losses.mlm_loss(params, h, batch["pos"], batch["tgt"], backend="reference")

    batches = []
    for n in (4, 6, 5):
        t = _batch(g, n)["text"]
        ids, pos, tgt = losses.mask_tokens(t.ids, mask_token_id=62, vocab_size=60, prob=0.3, generator=g)
        batches.append({"text": pe.Packed(ids, t.cu_seqlens, t.positions, t.max_seqlen), "pos": pos, "tgt": tgt})
    step = make_step(mlm, AdamW(lr=1e-2))
    jstep = graphed_step(step, TrainState.create(_clone(params), step.optimizer), max_tokens=128, max_seqs=8,
                         pad={"pos": Pad("masked", 0), "tgt": Pad("masked", -100)})
    eager = TrainState.create(_clone(params), step.optimizer)
    for b in batches:
        got, want = float(jstep(b)), float(step.update_(eager, b))
        assert got == pytest.approx(want, rel=1e-5)
    key = jstep.bucket_for(batches[0])
    assert dict(key)["masked"] >= batches[0]["pos"].numel()
    for a, b in zip(torch.utils._pytree.tree_leaves(jstep.state), torch.utils._pytree.tree_leaves(eager)):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-5)


def test_bad_configuration_and_batches_are_refused():
    params, g = _params(), torch.Generator().manual_seed(7)
    step = make_step(classify_loss, AdamW())
    state = TrainState.create(_clone(params), step.optimizer)
    with pytest.raises(pe.ConfigError, match="CUDA graphs need a CUDA state"):
        graphed_step(step, state, max_tokens=64, max_seqs=4, capture=True)
    with pytest.raises(pe.ConfigError, match="max_tokens"):
        graphed_step(step, state, max_tokens=0, max_seqs=4)
    with pytest.raises(pe.ConfigError, match="make_step"):
        graphed_step(classify_loss, state, max_tokens=64, max_seqs=4)
    with pytest.raises(pe.ConfigError, match="clip_norm"):
        make_step(classify_loss, AdamW(), clip_norm=0)
    with pytest.raises(pe.ConfigError, match="AdamW needs"):
        AdamW(lr=-1)
    with pytest.raises(pe.ConfigError, match="fp32 master weights"):  # the fused update needs them
        TrainState.create(pe.tree_cast(_clone(params), torch.bfloat16), step.optimizer)
    jstep = graphed_step(step, state, max_tokens=64, max_seqs=4, pad=PAD)
    b = _batch(g, 3)
    with pytest.raises(pe.InputError, match="no padding rule"):
        jstep({"text": b["text"], "labels": b["labels"], "extra": torch.zeros(3)})
    with pytest.raises(pe.InputError, match="text.seqs needs 3"):
        jstep({"text": b["text"], "labels": torch.zeros(4, dtype=torch.long)})
    with pytest.raises(pe.InputError, match="at least one packedenc.Packed"):
        jstep({"labels": b["labels"]})
    with pytest.raises(TypeError, match="scalar float tensor"):
        graphed_step(make_step(lambda p, b: 3, AdamW()), state, max_tokens=64, max_seqs=4, pad=PAD)(b)


# ---- GPU: graph replay vs the eager step ---------------------------------------------------------


def _gpu_case(family):
    if family == "modernbert":
        cfg = dataclass_replace(TINY, vocab_size=512, hidden_size=128, intermediate_size=192, num_attention_heads=2)
    else:
        cfg = deberta.PRESETS["tiny"]
    return pe.tree_to(pe.init(cfg, torch.Generator().manual_seed(0), heads=("classifier",)), "cuda")


def dataclass_replace(cfg, **kw):
    import dataclasses

    return dataclasses.replace(cfg, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["modernbert", "deberta"])
def test_gpu_graphed_step_matches_the_eager_step_after_20_steps(family):
    params = _gpu_case(family)
    cls = modernbert.classify if family == "modernbert" else deberta.classify

    def loss_fn(p, batch):  # p: the step's bf16 casts of the master weights
        b = batch["text"]
        return losses.classification_loss(cls(p, pe.encode(p, b.ids, b.cu_seqlens, b.max_seqlen), b.cu_seqlens),
                                          batch["labels"])

    def casting_loss_fn(p, batch):  # the eager reference casts inside its loss (autograd through the casts)
        return loss_fn(pe.tree_cast(p, torch.bfloat16), batch)

    g = torch.Generator().manual_seed(8)
    vocab = params.config.vocab_size
    batches = []
    for n in [5, 9, 7, 5, 12, 9, 7, 5, 9, 12] * 2:  # repeated shapes: buckets replay their graphs
        seqs = [torch.randint(3, vocab - 1, (int(torch.randint(3, 40, (1,), generator=g)),), generator=g).tolist()
                for _ in range(n)]
        batches.append({"text": pe.pack(seqs, device="cuda"),
                        "labels": torch.randint(0, 2, (n,), generator=g).cuda()})
    step = make_step(loss_fn, AdamW(lr=1e-3), clip_norm=1.0, compute_dtype=torch.bfloat16)
    jstep = graphed_step(step, TrainState.create(_clone(params), step.optimizer), max_tokens=1024, max_seqs=16,
                         pad=PAD, pad_id=vocab - 1)
    eager_step = make_step(casting_loss_fn, AdamW(lr=1e-3), clip_norm=1.0)
    eager = TrainState.create(_clone(params), step.optimizer)
    got = torch.stack([jstep(b) for b in batches]).tolist()
    want = torch.stack([eager_step.update_(eager, b) for b in batches]).tolist()
    assert jstep.num_graphs >= 3  # buckets captured and replayed, plus the update graph
    assert got == pytest.approx(want, rel=2e-2, abs=2e-3)  # bf16 noise over 20 steps
    for a, b in zip(torch.utils._pytree.tree_leaves(jstep.state.params), torch.utils._pytree.tree_leaves(eager.params)):
        assert ((a - b).norm() / b.norm().clamp_min(1e-6)) < 2e-2
