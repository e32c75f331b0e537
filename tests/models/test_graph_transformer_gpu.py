"""Graph transformer on the GPU (`-m gpu`): the CPU file's equalities (tests/models/test_graph_transformer.py)
on the CUDA path — fp32 equal to the padded SDPA model, bf16 within twice its error, gradients of every
params leaf for each graph_attention implementation (the auto route "triton>flash", torch's efficient
and flash cores), and each implementation against the reference.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

import packedenc as pe
from packedenc.convert.gigl import gigl_key
from packedenc.kernels import flash, reference
from packedenc.kernels.triton import attention_op as AT
from packedenc.models.graph_transformer import encode
from packedenc.pytree import named_leaves, tree_map
from tests.models.test_graph_transformer import inputs, make, padded_forward, padded_model


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["neighbor-gelu-all", "anchor-gelu-all-l2", "anchor-swiglu", "neighbor-tanh-silu"])
def test_gpu_fp32_equals_padded_and_bf16_within_twice_padded_error(name):
    cfg, p = make(name)
    x, cu, kw = inputs(cfg, lengths=[1, 90, 3, 256, 17, 1, 64] * 3)
    dev = "cuda"
    pc = pe.tree_to(p, dev)
    xc, cuc, kwc = x.to(dev), cu.to(dev), {k: v.to(dev) for k, v in kw.items()}
    with torch.no_grad():
        ref32, _ = padded_forward(padded_model(cfg, p, device=dev), xc, cuc, kwc)
        ref16, _ = padded_forward(padded_model(cfg, p, torch.bfloat16, dev), xc.bfloat16(), cuc, kwc)
        out32 = encode(pc, xc, cuc, **kwc)
        out16 = encode(pe.tree_cast(pc, torch.bfloat16), xc, cuc, **kwc)
    assert dict(pe.get_ops("auto", dev).chosen)["graph_attention"] == "triton>flash"
    torch.testing.assert_close(out32, ref32, atol=1e-4, rtol=1e-4)
    err16 = (out16.float() - ref32).abs().max()
    err_pad16 = (ref16.float() - ref32).abs().max()
    assert err16 <= 2 * err_pad16 + 1e-3, (err16, err_pad16)


def _table(attn: str):
    """The auto table with graph_attention served by `attn`: "auto" (triton>flash: the Triton
    kernel for full bf16 layers, torch's efficient kernel for the anchor-only layer and fp32),
    "efficient" or "flash" (torch's kernels for every layer)."""
    ops = pe.get_ops("auto", "cuda")
    if attn == "auto":
        return ops
    return dataclasses.replace(ops, graph_attention=functools.partial(flash.graph_attention, core=attn))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,attn,recompute", [
    (torch.float32, "auto", False), (torch.bfloat16, "auto", False), (torch.bfloat16, "efficient", False),
    (torch.bfloat16, "flash", False),
    # the FFN recompute (act(u + b) and its dbias again in the backward), fp32 and bf16
    (torch.float32, "auto", True), (torch.bfloat16, "auto", True),
])
@pytest.mark.parametrize("name", ["neighbor-gelu-all", "anchor-gelu-all-l2"])
def test_gpu_gradients_match_padded(name, dtype, attn, recompute):
    cfg, p = make(name)
    x, cu, kw = inputs(cfg, lengths=[1, 40, 3, 128, 7])
    dev = "cuda"
    w = torch.randn(5, cfg.out_dim, device=dev)
    x, cu, kw = x.to(dev), cu.to(dev), {k: v.to(dev) for k, v in kw.items()}

    def padded_grads(dt):
        m = padded_model(cfg, p, dt, dev)
        (padded_forward(m, x.to(dt), cu, kw)[0].float() * w).sum().backward()
        return {n: t.grad.float() for n, t in m.named_parameters()}

    ref32 = padded_grads(torch.float32)
    ref_lowp = padded_grads(dtype)
    pc = tree_map(lambda t: t.to(dev, dtype).requires_grad_(), p)
    (encode(pc, x, cu, **kw, backend=_table(attn), recompute_ffn=recompute).float() * w).sum().backward()
    # Some gradients are exactly zero in exact arithmetic (a key-projection bias shifts every score
    # of a query equally, and softmax ignores that): what remains is the rounding noise of a sum of
    # cancelling bf16 terms, judged against one bf16 unit roundoff (2^-8) of the scale of the
    # layer's other gradients, not against the padded model's own (equally random) noise.
    scale = max(g.abs().max() for g in ref32.values())
    for path, t in named_leaves(pc):
        key = gigl_key(path, cfg)
        r = ref32[key]
        err, err_pad = (t.grad.float() - r).abs().max(), (ref_lowp[key] - r).abs().max()
        if dtype == torch.float32:
            torch.testing.assert_close(t.grad, r, atol=2e-4, rtol=2e-4, msg=path)
        else:  # the 2x rule against the padded model run in bf16
            vanishing = r.abs().max() < 1e-4 * scale
            atol = 2.0**-8 * scale if vanishing else 1e-3 * r.abs().max()
            assert err <= 2 * err_pad + atol, (path, float(err), float(err_pad))


_IMPLS = {"triton": AT.graph_attention, "efficient": flash.graph_attention,
          "flash": functools.partial(flash.graph_attention, core="flash")}
# every implementation on the inputs it takes: the Triton entry full fused bf16 layers only
_CASES = [(impl, dtype, layout, bias)
          for impl in _IMPLS for dtype in (torch.float32, torch.bfloat16)
          for layout in ("fused", "separate", "anchors_only") for bias in (False, True)
          if impl != "triton" or (dtype == torch.bfloat16 and layout == "fused")]


@pytest.mark.gpu
@pytest.mark.parametrize("impl,dtype,layout,bias", _CASES)
def test_gpu_graph_attention_equals_reference(impl, dtype, layout, bias):
    dev = "cuda"
    lengths = torch.tensor([1, 90, 3, 256, 17, 1, 64])
    cu = torch.zeros(8, dtype=torch.int32, device=dev)
    cu[1:] = torch.cumsum(lengths, 0).to(dev)
    T, H, K, S = int(lengths.sum()), 8, 64, 7
    g = torch.Generator(device=dev).manual_seed(0)
    qkv = torch.randn(T, 3, H, K, device=dev, generator=g)
    kb = torch.randn(T, H, device=dev, generator=g) if bias else None
    do = torch.randn(S if layout == "anchors_only" else T, H, K, device=dev, generator=g)
    cq, mq = cu, 256
    if layout == "fused":
        leaves = [qkv]
        call = lambda x, kb_: (x[0], None, None, cq, cu, mq, 256, kb_)  # noqa: E731
    else:
        q, k, v = qkv.unbind(1)
        if layout == "anchors_only":
            q, cq, mq = q[cu[:-1].long()], torch.arange(S + 1, dtype=torch.int32, device=dev), 1
        leaves = [q, k, v]
        call = lambda x, kb_: (x[0], x[1], x[2], cq, cu, mq, 256, kb_)  # noqa: E731

    def run(fn, dt):
        xs = [t.detach().to(dt).requires_grad_() for t in leaves]
        out = fn(*call(xs, None if kb is None else kb.to(dt)))
        return out.float(), [d.float() for d in torch.autograd.grad(out, xs, do.to(dt))]

    want, want_d = run(reference.graph_attention, torch.float32)
    ref_lowp, ref_lowp_d = run(reference.graph_attention, dtype)
    got, got_d = run(_IMPLS[impl], dtype)
    err, err_ref = (got - want).abs().max(), (ref_lowp - want).abs().max()
    assert err <= 2 * err_ref + 5e-5, (err, err_ref)
    for d, r, rl in zip(got_d, want_d, ref_lowp_d):
        e, e_ref = (d - r).abs().max(), (rl - r).abs().max()
        assert e <= 2 * e_ref + 1e-4 * max(1.0, float(r.abs().max())), (e, e_ref)


@pytest.mark.gpu
def test_gpu_efficient_core_fused_gradient_equals_aten_backward():
    # shared_storage_dqdkdv: the fused buffer's gradient is the chunk aten allocated, viewed (T, 3, H, K)
    dev = "cuda"
    cu = torch.tensor([0, 5, 40, 41], dtype=torch.int32, device=dev)
    qkv = torch.randn(41, 3, 4, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)
    out = flash.efficient_qkv_attention(qkv, cu, 35, 64**-0.5)
    captured = {}
    qkv.register_hook(lambda gr: captured.setdefault("g", gr))
    out.float().sum().backward()
    gr = captured["g"]
    assert gr.shape == qkv.shape and gr.is_contiguous()
    q, k, v = qkv.detach().unbind(1)
    dq, dk, dv, _ = torch.ops.aten._efficient_attention_backward(
        torch.ones_like(out)[None], q[None], k[None], v[None], None, out.detach()[None], cu, cu, 35, 35,
        torch.ops.aten._efficient_attention_forward(q[None], k[None], v[None], None, cu, cu, 35, 35, 0.0, 0, True,
                                                    scale=64**-0.5)[1],
        0.0, torch.empty((), dtype=torch.int64), torch.empty((), dtype=torch.int64), 0, False, scale=64**-0.5)
    torch.testing.assert_close(gr, torch.stack([dq[0], dk[0], dv[0]], 1))
