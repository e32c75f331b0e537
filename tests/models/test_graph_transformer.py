"""Graph transformer: packed encode vs a padded SDPA implementation of GiGL's math (tests/models/graph_padded.py).

CPU: reference backend, fp32, every readout and option; batch vs each sequence alone; gradients of
every params leaf; the anchor-only last layer vs the full one; bad input. The GPU versions (`-m gpu`)
are in test_graph_transformer_gpu.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import packedenc as pe
from packedenc.convert.gigl import gigl_key, to_gigl
from packedenc.errors import ConfigError, InputError
from packedenc.kernels import flash, reference
from packedenc.kernels import graph_attention as GA
from packedenc.models.graph_transformer import GraphTransformerConfig, encode, init, project_nodes
from packedenc.pytree import named_leaves, tree_map
from tests.models.graph_padded import PaddedGraphTransformer, padded_inputs

BASE = dict(node_type_to_feat_dim_map={"user": 7, "item": 5}, hid_dim=24, num_heads=4, out_dim=10, num_layers=2)
CONFIGS = {  # each entry switches on the options that change the math
    "neighbor-gelu-all": dict(hop_distance_embedding_size=4, anchor_based_attention_bias_attr_names=("hop_distance", "w")),
    "neighbor-plain-one-type": dict(node_type_to_feat_dim_map={"paper": 6}),
    "anchor-gelu-all-l2": dict(readout_mode="anchor_only", hop_distance_embedding_size=4,
                               anchor_based_attention_bias_attr_names=("hop_distance",),
                               should_l2_normalize_embedding_layer_output=True),
    "anchor-swiglu": dict(readout_mode="anchor_only", activation="swiglu"),
    "neighbor-geglu-ratio": dict(activation="geglu", feedforward_ratio=1.5, num_layers=3),
    "neighbor-reglu-l2": dict(activation="reglu", should_l2_normalize_embedding_layer_output=True),
    "anchor-relu-1layer": dict(readout_mode="anchor_only", activation="relu", num_layers=1),
    "neighbor-tanh-silu": dict(activation="tanh", num_heads=3),
    "anchor-silu-0layers": dict(readout_mode="anchor_only", activation="silu", num_layers=0),
}
# ragged lengths: singletons (no neighbours), a long one, a two-token one
LENGTHS = [1, 5, 9, 2, 1, 13, 4]


def make(name: str, dtype=torch.float32, seed: int = 0):
    cfg = GraphTransformerConfig(**{**BASE, **CONFIGS[name]})
    g = torch.Generator().manual_seed(seed)
    p = init(cfg, g)
    # init has unit norms and zero biases; perturb every leaf so each one matters
    p = tree_map(lambda t: (t + 0.2 * torch.randn(t.shape, generator=g)).to(dtype), p)
    return cfg, p


def inputs(cfg, lengths=LENGTHS, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    T = int(cu[-1])
    pos = pe.packing.positions_from_cu_seqlens(cu, T)
    kw = {}
    if len(cfg.node_types) > 1:
        kw["node_types"] = torch.randint(0, len(cfg.node_types), (T,), generator=g)
    if cfg.hop_distance_embedding_size:
        kw["hops"] = torch.where(pos == 0, 0, torch.randint(1, cfg.hop_distance_embedding_size, (T,), generator=g))
    if cfg.key_bias_dim:
        kw["key_features"] = torch.randn(T, cfg.key_bias_dim, generator=g)
    x = torch.randn(T, max(cfg.feat_dims), generator=g)
    return x, cu, kw


def padded_model(cfg, params, dtype=torch.float32, device="cpu"):
    m = PaddedGraphTransformer(cfg)
    m.load_state_dict(to_gigl(params)[0])  # strict: the params' GiGL names fit a GiGL-layout module
    return m.to(device=device, dtype=dtype).eval()


def padded_forward(m, x, cu, kw, full_last_layer=False):
    xp, valid, nt, hops, kf = padded_inputs(x, cu, kw.get("node_types"), kw.get("hops"), kw.get("key_features"))
    return m(xp, valid, nt, hops, kf, full_last_layer=full_last_layer)


# ---- CPU: equality with the padded implementation ----------------------------------------------


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_packed_equals_padded(name):
    cfg, p = make(name)
    x, cu, kw = inputs(cfg)
    out = pe.encode(p, x, cu, **kw, backend="reference")  # dispatches through packedenc.encode
    with torch.no_grad():
        ref, _ = padded_forward(padded_model(cfg, p), x, cu, kw)
    assert out.shape == (len(LENGTHS), cfg.out_dim)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
    if cfg.should_l2_normalize_embedding_layer_output:
        torch.testing.assert_close(out.norm(dim=-1), torch.ones(len(LENGTHS)))


@pytest.mark.parametrize("name", ["neighbor-gelu-all", "anchor-gelu-all-l2"])
def test_batch_equals_each_sequence_alone(name):
    cfg, p = make(name)
    x, cu, kw = inputs(cfg)
    batch = encode(p, x, cu, **kw, backend="reference")
    for s in range(len(LENGTHS)):
        a, b = int(cu[s]), int(cu[s + 1])
        one = encode(p, x[a:b], torch.tensor([0, b - a], dtype=torch.int32),
                     **{k: v[a:b] for k, v in kw.items()}, backend="reference")
        torch.testing.assert_close(batch[s:s + 1], one, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["anchor-gelu-all-l2", "neighbor-gelu-all", "anchor-swiglu"])
def test_return_tokens_and_anchor_only_last_layer(name):
    cfg, p = make(name)
    x, cu, kw = inputs(cfg)
    out = encode(p, x, cu, **kw, backend="reference")
    out_full, tokens = encode(p, x, cu, **kw, return_tokens=True, backend="reference")
    # the anchor-only last layer (queries = anchors) equals the full last layer at the anchors
    torch.testing.assert_close(out, out_full, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        _, z = padded_forward(padded_model(cfg, p), x, cu, kw, full_last_layer=True)
    xp, valid = pe.pad(tokens, cu)
    torch.testing.assert_close(xp[valid], z[valid], atol=2e-5, rtol=1e-5)


def test_projected_tokens_equal_raw_features():
    cfg, p = make("neighbor-gelu-all")
    g = torch.Generator().manual_seed(3)
    feats = {"user": torch.randn(6, 7, generator=g), "item": torch.randn(4, 5, generator=g)}
    nodes = project_nodes(p, feats, backend="reference")  # (10, D): users 0..5, items 6..9
    index = torch.tensor([0, 7, 3, 2, 9, 8, 6, 1])
    cu = torch.tensor([0, 3, 4, 8], dtype=torch.int32)
    types = (index >= 6).long()
    raw = torch.zeros(8, 7)
    for t, i in enumerate(index.tolist()):
        f = feats["user"][i] if i < 6 else feats["item"][i - 6]
        raw[t, : f.numel()] = f
    hops = torch.tensor([0, 1, 2, 0, 0, 1, 1, 2])
    kf = torch.randn(8, 2, generator=g)
    a = encode(p, raw, cu, node_types=types, hops=hops, key_features=kf, backend="reference")
    b = encode(p, nodes[index], cu, hops=hops, key_features=kf, projected=True, backend="reference")
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def _registered_ops_table():
    """The reference table with the fused ops swapped for the Triton modules' Ops-table entries. On
    the CPU those run their registered custom ops (reference implementation, registered autograd):
    the model then goes through the ops' bias plumbing (`bias=`, `x_bias=`) and backward formulas.
    graph_attention is routed as on CUDA, but by layout alone (the CPU tests run fp32): full
    layers' fused qkv to the Triton entry (key-bias fold, one (T, 3, H, K) gradient), the
    anchor-only layer to the reference."""
    from packedenc import kernels
    from packedenc.kernels.triton import activation as A, attention_op as AT, glu as G, layer_norm as L

    graph = kernels._route(AT.graph_attention, (lambda q, k, *a, **kw: k is None,), reference.graph_attention)
    return dataclasses.replace(pe.get_ops("reference"), activation=A.activation, glu=G.glu,
                               add_layer_norm=L.add_layer_norm, layer_norm=L.layer_norm, graph_attention=graph)


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("ops", ["reference", "registered"])
@pytest.mark.parametrize("name", ["neighbor-gelu-all", "anchor-gelu-all-l2", "neighbor-geglu-ratio"])
def test_gradients_match_padded(name, ops, recompute):
    backend = _registered_ops_table() if ops == "registered" else "reference"
    cfg, p = make(name)
    x, cu, kw = inputs(cfg)
    w = torch.randn(len(LENGTHS), cfg.out_dim, generator=torch.Generator().manual_seed(5))
    leaves = dict(named_leaves(p))
    p = tree_map(lambda t: t.detach().requires_grad_(), p)
    x = x.clone().requires_grad_()
    (encode(p, x, cu, **kw, backend=backend, recompute_ffn=recompute) * w).sum().backward()
    m = padded_model(cfg, p)
    xr = x.detach().clone().requires_grad_()
    xp, valid, nt, hops, kf = padded_inputs(xr, cu, kw.get("node_types"), kw.get("hops"), kw.get("key_features"))
    (m(xp, valid, nt, hops, kf)[0] * w).sum().backward()
    ref = dict(m.named_parameters())
    got = dict(named_leaves(p))
    assert set(got) == set(leaves)
    for path, t in got.items():
        assert t.grad is not None, path
        torch.testing.assert_close(t.grad, ref[gigl_key(path, cfg)].grad, atol=5e-5, rtol=1e-4, msg=path)
    torch.testing.assert_close(x.grad, xr.grad, atol=5e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ["neighbor-gelu-all", "anchor-relu-1layer", "neighbor-geglu-ratio"])
def test_biases_ride_into_the_elementwise_ops(name):
    """The FFN's and the attention output's GEMMs run without bias: linear_in's bias goes to
    ops.activation (gated FFNs keep it in the GEMM: ops.glu takes none), output_projection's and
    linear_out's to the next add_layer_norm as x_bias (incl. the final norm), so the kernels
    return their gradients instead of autograd summing (T, width) gradients once more."""
    cfg, p = make(name)
    x, cu, kw = inputs(cfg)
    ref, calls = pe.get_ops("reference"), []

    def spy(op):
        def fn(*a, **k):
            calls.append((op, a, k))
            return getattr(ref, op)(*a, **k)
        return fn

    ops = dataclasses.replace(ref, **{op: spy(op) for op in ("linear", "activation", "glu", "add_layer_norm")})
    torch.testing.assert_close(encode(p, x, cu, **kw, backend=ops), encode(p, x, cu, **kw, backend="reference"))
    layers = p.encoder_layers
    gemm_bias = {id(a[1]): a[2] if len(a) > 2 else k.get("bias") for op, a, k in calls if op == "linear"}
    for lp in layers:
        assert gemm_bias[id(lp.output_projection.weight)] is None
        assert gemm_bias[id(lp.ffn.linear_out.weight)] is None
        assert gemm_bias[id(lp.ffn.linear_in.weight)] is (lp.ffn.linear_in.bias if cfg.is_xglu else None)
    act_bias = [k.get("bias") for op, a, k in calls if op == "activation"]
    assert [b is lp.ffn.linear_in.bias for b, lp in zip(act_bias, layers)] == [True] * (0 if cfg.is_xglu else len(layers))
    x_bias = [k.get("x_bias") for op, a, k in calls if op == "add_layer_norm"]
    want = [b for lp in layers for b in (lp.output_projection.bias, lp.ffn.linear_out.bias)]
    assert len(x_bias) == len(want) and all(a is b for a, b in zip(x_bias, want))


def test_bf16_params_run_close_to_fp32():
    cfg, p = make("neighbor-gelu-all")
    x, cu, kw = inputs(cfg)
    out32 = encode(p, x, cu, **kw, backend="reference")
    out16 = encode(pe.tree_cast(p, torch.bfloat16), x, cu, **kw, backend="reference")
    assert out16.dtype == torch.bfloat16
    cos = torch.nn.functional.cosine_similarity(out16.float(), out32, dim=-1)
    assert cos.min() > 0.999


# ---- flash.py's graph_attention algebra (torch's kernels), on the CPU ---------------------------


def _core_ref(q, k, v, cq, ck, mq, mk, scale):
    assert q.shape[-1] % 8 == 0  # the kernel contract: head dim padded to a multiple of 8
    return reference.graph_attention(q, k, v, cq, ck, mq, mk, None, scale)


@pytest.mark.parametrize("K", [6, 8, 16])  # 8 + the bias column -> padded to 16
@pytest.mark.parametrize("anchors_only", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_cuda_graph_attention_folding_equals_reference(K, anchors_only, bias):
    g = torch.Generator().manual_seed(K)
    cu = torch.tensor([0, 1, 6, 8, 17], dtype=torch.int32)
    T, H, S = 17, 3, 4
    q, k, v = (torch.randn(T, H, K, generator=g) for _ in range(3))
    kb = torch.randn(T, H, generator=g) * 2 if bias else None
    cq, mq = cu, 9
    if anchors_only:
        q, cq, mq = q[cu[:-1].long()], torch.arange(S + 1, dtype=torch.int32), 1
    want = reference.graph_attention(q, k, v, cq, cu, mq, 9, kb)
    got = flash.graph_attention(q, k, v, cq, cu, mq, 9, kb, core=_core_ref)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_fused_qkv_fold_equals_separate_fold():
    g = torch.Generator().manual_seed(0)
    qkv, kb = torch.randn(11, 3, 2, 8, generator=g), torch.randn(11, 2, generator=g)
    fused = GA.fold_key_bias_qkv(qkv, kb, 0.3)
    assert fused.shape == (11, 3, 2, 9)
    for got, want in zip(fused.unbind(1), GA.fold_key_bias(*qkv.unbind(1), kb, 0.3)):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_unknown_flash_core_and_half_given_kv_are_refused():
    qkv, cu = torch.randn(5, 3, 2, 8), torch.tensor([0, 5], dtype=torch.int32)
    with pytest.raises(InputError, match="unknown core"):
        flash.graph_attention(qkv, None, None, cu, cu, 5, 5, core="fa3")
    with pytest.raises(InputError, match="give k and v, or neither"):
        flash.graph_attention(qkv[:, 0], qkv[:, 1], None, cu, cu, 5, 5)


def test_efficient_shared_gradient_storage_is_returned_without_a_copy():
    T, H, K = 5, 2, 8
    chunk = torch.randn(1, T, 3, H, K)
    dq, dk, dv = chunk.select(2, 0), chunk.select(2, 1), chunk.select(2, 2)  # what aten allocates
    dqkv = flash._dqkv_from_shared(dq, dk, dv)
    assert dqkv.shape == (T, 3, H, K) and dqkv.data_ptr() == chunk.data_ptr()
    torch.testing.assert_close(dqkv, chunk[0], atol=0, rtol=0)
    apart = [t.clone() for t in (dq, dk, dv)]  # separate tensors: one stack
    stacked = flash._dqkv_from_shared(*apart)
    assert stacked.data_ptr() != chunk.data_ptr()
    torch.testing.assert_close(stacked, chunk[0], atol=0, rtol=0)


def _saved_numel(fn) -> int:
    n = [0]

    def pack(t):
        n[0] += t.numel()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return n[0]


@pytest.mark.parametrize("name", ["neighbor-gelu-all", "neighbor-geglu-ratio"])
def test_ffn_activation_recompute_keeps_gradients_and_saves_memory(name):
    """`encode(..., recompute_ffn=True)`: the same gradients, act(u) not saved for the backward."""
    cfg, p = make(name)
    x, cu, kw = inputs(cfg)
    p = tree_map(lambda t: t.detach().requires_grad_(), p)
    leaves = [t for _, t in named_leaves(p)]

    def grads(recompute):
        out = encode(p, x, cu, **kw, backend="reference", recompute_ffn=recompute)
        return torch.autograd.grad(out.square().sum(), leaves)

    with_recompute = grads(True)
    saved_recompute = _saved_numel(lambda: encode(p, x, cu, **kw, backend="reference", recompute_ffn=True))
    plain = grads(False)
    saved_plain = _saved_numel(lambda: encode(p, x, cu, **kw, backend="reference"))
    for a, b in zip(with_recompute, plain):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    # act(u) (and, for gated FFNs, the activation's own fp32 intermediates) is no longer kept:
    # at least (T, F) elements fewer per layer, less the (F,) fused input bias the recompute keeps
    assert saved_plain - saved_recompute >= cfg.num_layers * (x.shape[0] - 1) * cfg.ffn_dim


def test_reference_attention_isolates_sequences_and_applies_key_bias():
    g = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    q, k, v = (torch.randn(9, 2, 8, generator=g) for _ in range(3))
    out = reference.graph_attention(q, k, v, cu, cu, 5, 5)
    k2, v2 = k.clone(), v.clone()
    k2[4:] *= 3
    v2[4:] += 1
    torch.testing.assert_close(reference.graph_attention(q, k2, v2, cu, cu, 5, 5)[:4], out[:4])
    # a huge bias on one key makes every query of that sequence copy its value
    kb = torch.zeros(9, 2)
    kb[2] = 1e4
    o = reference.graph_attention(q, k, v, cu, cu, 5, 5, kb)
    torch.testing.assert_close(o[:4], v[2].expand(4, 2, 8))


# ---- bad input ---------------------------------------------------------------------------------


def test_input_errors_name_the_problem():
    cfg, p = make("neighbor-gelu-all")
    x, cu, kw = inputs(cfg)
    T = x.shape[0]
    cases = [
        (dict(kw, hops=None), "hops= is required"),
        (dict(kw, node_types=None), "node_types= is required"),
        (dict(kw, key_features=torch.randn(T, 3)), "key_features must have shape"),
        (dict(kw, hops=kw["hops"].float()), "hops must be an integer"),
        (dict(kw, hops=torch.full((T,), 4)), "hops values must lie in [0, 4)"),
        (dict(kw, node_types=torch.full((T,), 2)), "node_types values must lie in [0, 2)"),
    ]
    for kwargs, msg in cases:
        with pytest.raises(InputError, match=msg.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
            encode(p, x, cu, **kwargs)
    with pytest.raises(InputError, match="features per token"):
        encode(p, x[:, :5], cu, **kw)
    with pytest.raises(InputError, match="must end at the number of packed tokens"):
        encode(p, x[:-1], cu, **{k: v[:-1] for k, v in kw.items()})
    with pytest.raises(InputError, match="smaller than the longest"):
        encode(p, x, cu, 3, **kw)
    with pytest.raises(InputError, match="must be a floating"):
        encode(p, x.long(), cu, **kw)
    cfg1, p1 = make("neighbor-plain-one-type")
    x1, cu1, _ = inputs(cfg1)
    with pytest.raises(InputError, match="hops= was given but these params do not use it"):
        encode(p1, x1, cu1, hops=torch.zeros(x1.shape[0], dtype=torch.long))


def test_config_errors():
    with pytest.raises(ConfigError, match="not divisible"):
        GraphTransformerConfig(node_type_to_feat_dim_map={"a": 3}, hid_dim=10, num_heads=4)
    with pytest.raises(ConfigError, match="activation 'mish'"):
        GraphTransformerConfig(node_type_to_feat_dim_map={"a": 3}, hid_dim=8, activation="mish")
    with pytest.raises(ConfigError, match="readout_mode 'cls'"):
        GraphTransformerConfig(node_type_to_feat_dim_map={"a": 3}, hid_dim=8, readout_mode="cls")
    with pytest.raises(ConfigError, match="empty"):
        GraphTransformerConfig(node_type_to_feat_dim_map={}, hid_dim=8)
    cfg = GraphTransformerConfig(node_type_to_feat_dim_map={"a": 3}, hid_dim=8, edge_type_to_feat_dim_map={("a", "to", "a"): 0})
    assert GraphTransformerConfig.from_dict(cfg.to_dict()) == cfg
    assert hash(cfg) == hash(GraphTransformerConfig.from_dict(cfg.to_dict()))


def test_params_are_a_pytree_and_init_dispatches():
    cfg = GraphTransformerConfig(**{**BASE, **CONFIGS["neighbor-gelu-all"]})
    p = pe.init(cfg, torch.Generator().manual_seed(0))
    names = [n for n, _ in named_leaves(p)]
    assert "anchor_based_input_embedding_dict.hop_distance.weight" in names
    assert "encoder_layers.1.ffn.linear_out.bias" in names
    p16 = pe.tree_cast(p, torch.bfloat16)
    assert p16.config == cfg and all(t.dtype == torch.bfloat16 for _, t in named_leaves(p16))
    assert pe.num_params(p) == sum(t.numel() for t in padded_model(cfg, p).parameters())
