"""The eager CUDA path of whole models, run on the CPU: a training step of a small ModernBERT, DeBERTa-v3
and BERT through the Triton kernels (interpreted) equals the reference backend's.

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


def _direct_any(*tensors):
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return False
    return _eager_any(*tensors)


@pytest.fixture
def cpu_as_cuda(monkeypatch):
    """The Triton-only table a GPU machine builds, its entries taking plain CPU tensors."""
    import packedenc.kernels.triton as KT

    for info in pkgutil.walk_packages(KT.__path__, KT.__name__ + "."):
        mod = importlib.import_module(info.name)
        for name, fn in (("eager_cuda", _eager_any), ("direct_launch", _direct_any)):
            if hasattr(mod, name):
                monkeypatch.setattr(mod, name, fn)
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
    expected = {"_ln_fwd_kernel", "_ln_bwd_kernel", "_ce_kernel"}
    expected |= {"modernbert": {"_glu_fwd_kernel", "_glu_bwd_kernel", "_rotary_kernel", "_fwd_kernel", "_bwd_kernel"},
                 "deberta": {"_act_fwd_kernel", "_act_bwd_kernel"},
                 "bert": {"_act_fwd_kernel", "_act_bwd_kernel", "_fwd_kernel", "_bwd_kernel"}}[model]
    assert expected <= set(launched), sorted(set(launched))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for i, (a, w) in enumerate(zip(got_grads, want_grads)):
        assert (a is None) == (w is None), i
        if w is not None:
            rel = ((a - w).norm() / w.norm().clamp_min(1e-12)).item()
            assert rel <= 1e-4, f"{model} gradient {i}: relative error {rel:.2e}"


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
    expected = {"modernbert": {"_ln_fwd_kernel", "_fwd_kernel", "_glu_fwd_kernel"},
                "deberta": {"_ln_fwd_kernel", "_fwd_wide_kernel", "_act_fwd_kernel"},
                "bert": {"_ln_fwd_kernel", "_fwd_kernel", "_act_fwd_kernel"}}[model]
    assert expected <= set(launched), sorted(set(launched))
    if model == "modernbert":  # RoPE read inside the attention forward: no rotary launch of its own
        assert "_rotary_kernel" not in launched
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
