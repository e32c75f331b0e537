"""The eager CUDA path of whole models, run on the CPU: a training step and an inference forward of a
small ModernBERT, DeBERTa-v3 and BERT, and the graph transformer's forward and gradients, through the
Triton kernels (interpreted) equal the reference backend's.

On a machine without a GPU the Ops-table entries send CPU tensors to the reference, so the kernel
tests check each kernel alone and nothing checks the calls the models make: the views, strides and
dtypes they pass, the autograd wiring of the eager path (`eager_autograd`, `launch_or_op`). Here
the "plain CUDA tensor" checks of the Triton modules are widened to plain CPU tensors, so the same
entries launch the kernels under the interpreter, and every load and store is bounds-checked
(tests/conftest.py): an access past a tensor that a GPU survives by luck of allocation fails here.
"""

import dataclasses
import importlib
import os
import pkgutil

import pytest
import torch
from torch import Tensor

import packedenc as pe
from packedenc import kernels as K
from packedenc.train import losses

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreter runs the kernels")

LENGTHS = (1, 5, 37, 70)  # a 1-token sequence, a tile edge, and a sequence past ModernBERT's +-32 window


def _eager_any(*tensors):
    x = tensors[0]
    return type(x) is Tensor and not torch.compiler.is_compiling() and torch._C._len_torch_dispatch_stack() == 0


@pytest.fixture
def cpu_as_cuda(monkeypatch):
    """The Triton-only table a GPU machine builds, its entries taking plain CPU tensors."""
    import packedenc.kernels.triton as KT

    for info in pkgutil.walk_packages(KT.__path__, KT.__name__ + "."):
        mod = importlib.import_module(info.name)
        if hasattr(mod, "eager_cuda"):  # `direct_launch` asks _common's, patched here too
            monkeypatch.setattr(mod, "eager_cuda", _eager_any)
    usable = {"triton", "reference"}.__contains__
    chosen = tuple((op, K.choose(op, "auto", "cuda", usable)) for op in K.OP_NAMES)
    return K.Ops(backend="auto", chosen=chosen, **K._entries(chosen))


def _models():
    from packedenc.models import bert, deberta, modernbert

    mb = modernbert.ModernBertConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=2, local_attention=64,
                                     layer_types=("full_attention", "sliding_attention"),
                                     pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)
    db = dataclasses.replace(deberta.PRESETS["v3-base"], vocab_size=128, hidden_size=64, num_attention_heads=2,
                             intermediate_size=96, num_hidden_layers=2, position_buckets=16,
                             max_relative_positions=64, legacy=False)
    bt = bert.BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=96, max_position_embeddings=128)
    return {"modernbert": mb, "deberta": db, "bert": bt}


def _step(params, batch, ops):
    ids, cu, L, pos, tgt = batch
    leaves = [t for t in torch.utils._pytree.tree_leaves(params) if t.is_floating_point()]
    loss = losses.mlm_loss(params, pe.encode(params, ids, cu, L, backend=ops), pos, tgt, backend=ops)
    return loss, torch.autograd.grad(loss, leaves, allow_unused=True)


def _assert_grads_close(got, want, what):
    """Each leaf's gradient within 1e-4 of the reference's norm; a gradient that is zero in exact
    arithmetic (a key bias: softmax ignores a per-query constant) is compared against the largest
    one instead, since both sides hold only rounding noise there."""
    scale = max(w.norm().item() for w in want if w is not None)
    for i, (a, w) in enumerate(zip(got, want)):
        assert (a is None) == (w is None), f"{what} gradient {i}"
        if w is not None:
            err = (a - w).norm().item()
            assert err <= 1e-4 * max(w.norm().item(), 1e-3 * scale), f"{what} gradient {i}: error {err:.2e}"


@pytest.mark.parametrize("model", ["modernbert", "deberta", "bert"])
def test_a_training_step_through_the_kernels_equals_the_reference(model, cpu_as_cuda):
    from tests.kernels._bounds import bounds_checked

    cfg = _models()[model]
    g = torch.Generator().manual_seed(0)
    params = pe.init(cfg, g, heads=("mlm",))
    params = torch.utils._pytree.tree_map(lambda t: t.requires_grad_(True) if t.is_floating_point() else t, params)
    b = pe.pack([torch.randint(3, cfg.vocab_size, (n,), generator=g) for n in LENGTHS])
    ids, pos, tgt = losses.mask_tokens(b.ids, mask_token_id=cfg.vocab_size - 1, vocab_size=cfg.vocab_size - 1,
                                       prob=0.3, generator=g)
    batch = (ids, b.cu_seqlens, b.max_seqlen, pos, tgt)
    want, want_grads = _step(params, batch, "reference")
    with bounds_checked() as launched:
        got, got_grads = _step(params, batch, cpu_as_cuda)
    expected = {"layer_norm_kernels._ln_fwd_kernel", "layer_norm_kernels._ln_bwd_kernel", "cross_entropy._ce_kernel"}
    attention = {"attention._fwd_kernel", "attention_bwd._bwd_kernel"}
    act = {"activation._act_fwd_kernel", "activation._act_bwd_kernel"}
    expected |= {"modernbert": {"glu._glu_fwd_kernel", "glu._glu_bwd_kernel", "rotary._rotary_kernel", *attention},
                 "deberta": act, "bert": act | attention}[model]
    assert expected <= set(launched), sorted(set(launched))
    if model == "deberta":  # its own attention kernels (deberta/), forward and backward
        modules = {k.split(".")[0] for k in launched}
        assert "backward" in modules and modules & {"forward", "forward_wide"}, sorted(set(launched))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    _assert_grads_close(got_grads, want_grads, model)


@pytest.mark.parametrize("model", ["modernbert", "deberta", "bert"])
def test_inference_through_the_kernels_equals_the_reference(model, cpu_as_cuda):
    """The inference-only paths: launches without the custom op (`direct_launch`), outputs written
    over inputs (`overwrite_input`), and ModernBERT's RoPE read inside the attention forward (every
    sequence here is under 128 tokens)."""
    from tests.kernels._bounds import bounds_checked

    cfg = _models()[model]
    g = torch.Generator().manual_seed(1)
    params = pe.init(cfg, g)
    b = pe.pack([torch.randint(3, cfg.vocab_size, (n,), generator=g) for n in LENGTHS])
    with torch.inference_mode():
        want = pe.encode(params, b.ids, b.cu_seqlens, b.max_seqlen, backend="reference")
        with bounds_checked() as launched:
            got = pe.encode(params, b.ids, b.cu_seqlens, b.max_seqlen, backend=cpu_as_cuda)
    ln = "layer_norm_kernels._ln_fwd_kernel"
    expected = {"modernbert": {ln, "attention._fwd_kernel", "glu._glu_fwd_kernel"},
                "deberta": {ln, "forward_wide._fwd_wide_kernel", "activation._act_fwd_kernel"},
                "bert": {ln, "attention._fwd_kernel", "activation._act_fwd_kernel"}}[model]
    assert expected <= set(launched), sorted(set(launched))
    if model == "modernbert":  # RoPE read inside the attention forward: no rotary launch of its own
        assert "rotary._rotary_kernel" not in launched
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_modernbert_fp16_inference_through_every_fused_gemm(cpu_as_cuda):
    """backend="triton" on fp16: each layer's norms read inside the GEMMs after them
    (`layer_norm_linear` for Wqkv, `layer_norm_linear_glu` for Wi, the gate in its epilogue),
    so the only LayerNorm launches left are the embeddings' and the final norm's; bounds-checked, and within twice the
    plain fp16 reference's error of the fp32 reference."""
    from tests.kernels._bounds import bounds_checked

    usable = {"triton", "reference"}.__contains__
    chosen = tuple((op, K.choose(op, "triton", "cuda", usable)) for op in K.OP_NAMES)
    ops = K.Ops(backend="triton", chosen=chosen, **K._entries(chosen))
    assert dict(chosen)["layer_norm_linear"] == "triton>layer_norm+linear"
    cfg = _models()["modernbert"]
    g = torch.Generator().manual_seed(2)
    params = pe.init(cfg, g)
    half = pe.tree_cast(params, torch.float16)
    b = pe.pack([torch.randint(3, cfg.vocab_size, (n,), generator=g) for n in LENGTHS])
    with torch.inference_mode():
        want = pe.encode(params, b.ids, b.cu_seqlens, b.max_seqlen, backend="reference")
        plain = pe.encode(half, b.ids, b.cu_seqlens, b.max_seqlen, backend="reference").float()
        with bounds_checked() as launched:
            got = pe.encode(half, b.ids, b.cu_seqlens, b.max_seqlen, backend=ops).float()
    # layer 0: Wi only (its attention norm is the embedding's); layer 1: Wqkv and Wi
    assert launched.count("linear_glu._linear_glu_kernel") == 3, launched
    assert launched.count("layer_norm_kernels._ln_fwd_kernel") == 2, launched  # embeddings, final norm
    base = (plain - want).abs().max().item()
    assert (got - want).abs().max().item() <= 2 * base + 1e-3, (base, (got - want).abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_graph_transformer_through_the_kernels_equals_the_reference(dtype, cpu_as_cuda):
    """GiGL's encoder (anchor-neighbour readout, hop embedding, anchor-relative attention bias):
    forward and the gradients of every leaf, bounds-checked. fp16 also takes the Triton attention
    (`covers_graph`: half precision only) and is held to the 2x rule: its error against the fp32
    reference at most twice the plain fp16 reference's, per output and per leaf gradient."""
    from packedenc.models import graph_transformer as gt
    from tests.kernels._bounds import bounds_checked

    cfg = gt.GraphTransformerConfig(node_type_to_feat_dim_map={"user": 24}, hid_dim=64, out_dim=32, num_heads=2,
                                    hop_distance_embedding_size=3, anchor_based_attention_bias_attr_names=("ppr",))
    g = torch.Generator().manual_seed(2)
    params = gt.init(cfg, g)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    T = int(cu[-1])
    x, ppr = torch.randn(T, 24, generator=g), torch.rand(T, 1, generator=g)
    hops = torch.cat([torch.clamp(torch.arange(n), max=2) for n in LENGTHS])

    def run(ops, dt):
        p = torch.utils._pytree.tree_map(
            lambda t: t.detach().to(dt).requires_grad_(True) if t.is_floating_point() else t, params)
        leaves = [t for t in torch.utils._pytree.tree_leaves(p) if t.is_floating_point()]
        out = gt.encode(p, x.to(dt), cu, max(LENGTHS), hops=hops, key_features=ppr.to(dt), backend=ops)
        grads = torch.autograd.grad(out.float().square().sum(), leaves, allow_unused=True)
        return out.float(), [None if a is None else a.float() for a in grads]

    ref32, ref32_grads = run("reference", torch.float32)
    with bounds_checked() as launched:
        got, got_grads = run(cpu_as_cuda, dtype)
    expected = {"layer_norm_kernels._ln_fwd_kernel", "layer_norm_kernels._ln_bwd_kernel",
                "graph_readout._fwd_kernel", "graph_readout._bwd_kernel"}
    if dtype == torch.float16:
        expected |= {"attention._fwd_kernel", "attention_bwd._bwd_kernel"}
    assert expected <= set(launched), sorted(set(launched))
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref32, rtol=1e-4, atol=1e-5)
        _assert_grads_close(got_grads, ref32_grads, "graph transformer")
        return
    plain, plain_grads = run("reference", dtype)
    scale = ref32.abs().max().item()
    assert (got - ref32).abs().max().item() <= 2 * (plain - ref32).abs().max().item() + 1e-3 * scale
    gscale = max(w.norm().item() for w in ref32_grads if w is not None)
    for i, (a, b, w) in enumerate(zip(got_grads, plain_grads, ref32_grads)):
        if w is not None:
            e, base = (a - w).norm().item(), (b - w).norm().item()
            assert e <= 2 * base + 1e-3 * gscale, f"fp16 gradient {i}: error {e:.3g} > 2 x {base:.3g}"
