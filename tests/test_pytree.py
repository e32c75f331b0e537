"""Params trees: torch pytree traversal keeps the static config, None pieces never become leaves,
and torch.func.grad through encode returns a gradient tree shaped like the params."""

import dataclasses

import torch
import torch.utils._pytree as pytree

import packedenc as pe
from packedenc.models import modernbert
from packedenc.pytree import named_leaves

CFG = modernbert.ModernBertConfig(vocab_size=50, hidden_size=16, intermediate_size=24, num_hidden_layers=3,
                                  num_attention_heads=2, local_attention=4, norm_bias=True)


def test_tree_map_keeps_config_and_skips_none():
    params = pe.init(CFG, torch.Generator().manual_seed(0))
    assert params.layers[0].attn_norm is None and params.head is None
    bf = pytree.tree_map(lambda t: t.to(torch.bfloat16), params)  # a plain tree_map, no *_only
    assert bf.config == CFG and bf.layers[0].attn_norm is None
    assert {t.dtype for t in pytree.tree_leaves(bf)} == {torch.bfloat16}
    assert len(pytree.tree_leaves(bf)) == len(pytree.tree_leaves(params))


def test_layer0_round_trip_and_names():
    params = pe.init(CFG, torch.Generator().manual_seed(0))
    leaves, spec = pytree.tree_flatten(params.layers[0])
    back = pytree.tree_unflatten(leaves, spec)
    assert back.attn_norm is None and torch.equal(back.attn.wqkv.weight, params.layers[0].attn.wqkv.weight)
    names = dict(named_leaves(params))
    assert "layers.1.attn_norm.weight" in names and "layers.0.attn_norm.weight" not in names
    assert names["layers.2.attn.wqkv.weight"].shape == (48, 16)


def test_func_grad_through_encode_matches_autograd():
    params = pe.init(CFG, torch.Generator().manual_seed(0))
    batch = pe.pack([[1, 2, 3, 4, 5, 6, 7], [8], [9, 10, 11]])

    def loss(p):
        return pe.encode(p, batch.ids, batch.cu_seqlens, batch.max_seqlen).pow(2).mean()

    grads = torch.func.grad(loss)(params)
    assert type(grads) is type(params) and grads.config == CFG
    g_leaves, p_leaves = pytree.tree_leaves(grads), pytree.tree_leaves(params)
    assert [g.shape for g in g_leaves] == [p.shape for p in p_leaves]
    # same numbers as plain autograd on leaves that require grad
    req = pytree.tree_map(lambda t: t.clone().requires_grad_(True), params)
    loss(req).backward()
    for g, p in zip(g_leaves, pytree.tree_leaves(req)):
        torch.testing.assert_close(g, p.grad)
    assert any(g.abs().sum() > 0 for g in g_leaves[-3:])


def test_params_are_frozen():
    params = pe.init(CFG)
    try:
        params.final_norm = None
    except dataclasses.FrozenInstanceError:
        pass
    else:
        raise AssertionError("params containers must be frozen")
