"""DeBERTa position tables in one GEMM (`position_tables`) equal the per-layer projections.

Every layer projects the same rel_RD, so encode stacks the projection blocks of all layers into
one `ops.linear`; these tests pin that it is the per-layer computation (`position_projections`)
in value and gradient for every projection layout, that it is one GEMM, and that training dropout
(a pos_dropout mask per layer, as HF) keeps the per-layer path.
"""

import dataclasses

import pytest
import torch

from packedenc.kernels import get_ops
from packedenc.models.deberta import model as M
from packedenc.models.deberta.config import PRESETS
from packedenc.models.deberta.params import init

leaves = torch.utils._pytree.tree_leaves

LAYOUTS = {  # (share_att_key, pos_att_type): which rows of which leaves make the tables
    "shared_both": (True, ("p2c", "c2p")),  # v3: query and key rows of the fused qkv leaf
    "shared_c2p": (True, ("c2p",)),  # key rows only
    "shared_p2c": (True, ("p2c",)),  # query rows only
    "separate_both": (False, ("c2p", "p2c")),  # pos_key_proj and pos_query_proj leaves
    "separate_c2p": (False, ("c2p",)),
    "separate_p2c": (False, ("p2c",)),
}


def _params(share, types, layers=3, **kw):
    cfg = dataclasses.replace(PRESETS["tiny"], share_att_key=share, pos_att_type=types, num_hidden_layers=layers,
                              **kw)
    params = init(cfg, torch.Generator().manual_seed(0))
    with torch.no_grad():  # init leaves biases at zero: perturb every leaf so the biases count
        for t in leaves(params):
            t.add_(torch.randn_like(t) * 0.05)
    return params


def _counting_ops():
    """The reference table with `linear` counting its calls."""
    ops, calls = get_ops("reference", "cpu"), []

    def linear(*a):
        calls.append(a[0].shape)
        return ops.linear(*a)

    return dataclasses.replace(ops, linear=linear), calls


def _per_layer(params, rel_RD, ops, seed=None):
    return [M.position_projections(p, rel_RD, params.config, ops, seed, i) for i, p in enumerate(params.encoder.layer)]


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_tables_equal_the_per_layer_projections_in_one_gemm(name):
    params = _params(*LAYOUTS[name])
    ops, calls = _counting_ops()
    rel_RD = M.rel_embeddings(params, ops)
    calls.clear()
    stacked = M.position_tables(params, rel_RD, ops)
    assert len(calls) == 1, calls  # one GEMM for all 3 layers and both terms
    ref = _per_layer(params, rel_RD, ops)
    for i, (pair, want) in enumerate(zip(stacked, ref)):
        for got, w, term in zip(pair, want, ("c2p", "p2c")):
            assert (got is None) == (w is None) == (term not in LAYOUTS[name][1]), (i, term)
            if w is not None:
                assert got.shape == w.shape == (rel_RD.shape[0], 4, 8) and got.stride(-1) == 1
                torch.testing.assert_close(got, w, rtol=0, atol=1e-6, msg=f"layer {i} {term}")


@pytest.mark.parametrize("name", ["shared_both", "separate_both"])
def test_tables_gradients_equal_the_per_layer_path(name):
    """The concatenation is part of autograd: every leaf gets the per-layer path's gradient."""
    params = _params(*LAYOUTS[name])
    ops = get_ops("reference", "cpu")
    flat, spec = torch.utils._pytree.tree_flatten(params)
    g = torch.Generator().manual_seed(1)
    R = 2 * params.config.att_span
    w = [torch.randn(R, 4, 8, generator=g) for _ in range(2 * params.config.num_hidden_layers)]

    def grads(fn):
        leaves_ = [t.detach().requires_grad_() for t in flat]
        p = torch.utils._pytree.tree_unflatten(leaves_, spec)
        tabs = [t for pair in fn(p, M.rel_embeddings(p, ops)) for t in pair]
        sum((t * wi).sum() for t, wi in zip(tabs, w)).backward()
        return [t.grad for t in leaves_]

    stacked = grads(lambda p, r: M.position_tables(p, r, ops))
    ref = grads(lambda p, r: _per_layer(p, r, ops))
    used = 0
    for a, b in zip(stacked, ref):
        assert (a is None) == (b is None)
        if b is not None:
            # rel_RD's gradient is summed over the tables in another order: fp32 rounding only
            assert (a - b).abs().max() <= 1e-6 * b.abs().max(), (a - b).abs().max()
            used += bool(b.abs().sum() > 0)
    assert used >= 3 * 2 + 2  # each layer's projection weight and bias, the rel embeddings and their norm


def test_dropout_seed_keeps_a_mask_per_layer():
    """With a seed and hidden_dropout_prob > 0, HF drops rel_RD per layer: per-layer GEMMs, distinct masks."""
    params = _params(True, ("p2c", "c2p"), hidden_dropout_prob=0.5)
    ops, calls = _counting_ops()
    rel_RD = M.rel_embeddings(params, ops)
    calls.clear()
    tables = M.position_tables(params, rel_RD, ops, seed=7)
    assert len(calls) == 2 * 3
    for got, want in zip(tables, _per_layer(params, rel_RD, ops, seed=7)):
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    # the per-layer masks differ: layers 0 and 1 would be the same table without dropout
    same = dataclasses.replace(params, encoder=dataclasses.replace(
        params.encoder, layer=[params.encoder.layer[0]] * 3))
    t0, t1, _ = M.position_tables(same, rel_RD, ops, seed=7)
    assert not torch.equal(t0[0], t1[0])
    # a seed without dropout probability is inference math: one GEMM again
    calls.clear()
    no_drop = dataclasses.replace(params, config=dataclasses.replace(params.config, hidden_dropout_prob=0.0))
    M.position_tables(no_drop, rel_RD, ops, seed=7)
    assert len(calls) == 1


def test_encode_uses_the_stacked_tables():
    """encode on the stacked tables equals encode on the per-layer ones (fp32, CPU)."""
    params = _params(True, ("p2c", "c2p"))
    ids = torch.randint(3, 1000, (40,))
    cu = torch.tensor([0, 1, 17, 40], dtype=torch.int32)
    out = M.encode(params, ids, cu, backend="reference")
    orig = M.position_tables
    try:
        M.position_tables = lambda p, r, ops, seed=None: _per_layer(p, r, ops, seed)
        ref = M.encode(params, ids, cu, backend="reference")
    finally:
        M.position_tables = orig
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
