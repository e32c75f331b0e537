"""The eager-training path of the Triton ops (`_common.eager_autograd`): an autograd.Function around
each registered op's CUDA launcher, setup_context and backward, used instead of the custom op in
eager CUDA training (its dispatcher's host time). It must give the custom op's outputs and gradients.

CPU: the autograd.Functions run their launchers under the Triton interpreter (the backward goes
through the registered backward op there), against the registered op. GPU (`gpu`): the Ops-table
entries take this path in eager training; outputs and every gradient equal the registered op's.
"""

import pytest
import torch

from packedenc.kernels.triton import (
    _common, activation, attention_op, cross_entropy, glu, graph_readout, layer_norm, rotary,
)
from packedenc.kernels.triton.deberta import op as deberta_op
from tests.kernels._assert import CPU_LENGTHS, DEVICE, cu_seqlens, positions


def _leaves(*xs):
    return [x.detach().clone().requires_grad_(x.is_floating_point()) if isinstance(x, torch.Tensor) else x for x in xs]


def _run(fn, args, outputs=None):
    outs = fn(*args)
    outs = outs if isinstance(outs, tuple) else (outs,)
    outs = outs if outputs is None else tuple(outs[i] for i in outputs)
    loss = sum((o.float() * torch.linspace(-1, 1, o.numel(), device=o.device).view(o.shape)).sum() for o in outs)
    diff = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    return [o.detach() for o in outs], torch.autograd.grad(loss, diff)


def _cases(dtype=torch.float32, device=DEVICE):
    T, D, H, K = sum(CPU_LENGTHS), 24, 2, 16
    r = lambda *s: torch.randn(*s, dtype=torch.float32).to(device, dtype)  # noqa: E731
    cu, pos = cu_seqlens(CPU_LENGTHS).to(device), positions(CPU_LENGTHS).to(device)
    ids = torch.randint(0, 30, (T,)).to(device)
    targets = torch.randint(0, 30, (T,)).to(device)
    return [
        ("layer_norm", layer_norm._layer_norm_eager, torch.ops.packedenc.layer_norm, (r(T, D), r(D), r(D), 1e-5), None),
        ("add_layer_norm", layer_norm._add_layer_norm_eager, torch.ops.packedenc.add_layer_norm,
         (r(T, D), r(T, D), r(D), r(D), 1e-5, r(D)), None),
        ("embed_layer_norm", layer_norm._embed_layer_norm_eager, torch.ops.packedenc.embed_layer_norm,
         (ids, r(30, D), r(D), r(D), 1e-5), None),
        ("glu", glu._glu_eager, torch.ops.packedenc.glu, (r(T, 2 * D), "gelu"), None),
        ("activation", activation._activation_eager, torch.ops.packedenc.activation, (r(T, D), "gelu"), None),
        ("bias_activation", activation._bias_activation_eager, torch.ops.packedenc.bias_activation,
         (r(T, D), r(D), "silu"), None),
        ("rotary", rotary._rotary_eager, torch.ops.packedenc.rotary, (r(T, 3, H, K), pos, 10000.0, 1.0), None),
        ("rotary_qkv", rotary._rotary_qkv_eager, torch.ops.packedenc.rotary_qkv, (r(T, 3, H, K), pos, 160.0, 1.0),
         None),
        ("linear_cross_entropy", cross_entropy._linear_ce_eager, torch.ops.packedenc.linear_cross_entropy,
         (r(T, D), r(30, D), r(30), targets), (0,)),
        ("graph_readout", graph_readout._readout_eager, torch.ops.packedenc.graph_readout,
         (r(T, D), r(1, 2 * D), r(1), cu, max(CPU_LENGTHS)), (0,)),
        ("varlen_attention", attention_op._fwd_eager, torch.ops.packedenc.triton_varlen_attention,
         (r(T, H, K), r(T, H, K), r(T, H, K), cu, max(CPU_LENGTHS), 2, 2, K**-0.5, True), (0,)),
        ("deberta_attention", deberta_op._deberta_attention_eager, torch.ops.packedenc.deberta_attention,
         (r(T, H, K), r(T, H, K), r(T, H, K), cu, max(CPU_LENGTHS), r(8, H, K), r(8, H, K), 4, 8, 0.2, None), (0,)),
        ("varlen_attention_fused", attention_op._fwd_eager, torch.ops.packedenc.triton_varlen_attention,
         (r(T, 3, H, K), None, None, cu, max(CPU_LENGTHS), -1, -1, 0.3, True), (0,)),
    ]


@pytest.mark.parametrize("i", range(13))
def test_eager_autograd_equals_the_registered_op(i):
    name, eager, op, args, outputs = _cases()[i]
    got_out, got_grads = _run(eager, _leaves(*args), outputs)
    want_out, want_grads = _run(op, _leaves(*args), outputs)
    for a, b in zip(got_out, want_out):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=f"{name} output")
    assert len(got_grads) == len(want_grads) > 0
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=f"{name} gradient")


def test_launch_or_op_takes_the_registered_op_off_cuda():
    calls = []
    out = _common.launch_or_op(lambda *a: calls.append("launcher"), lambda *a: calls.append("op") or 7,
                               torch.ones(2), 3)
    assert out == 7 and calls == ["op"]
    assert not _common.eager_cuda(torch.ones(2))  # CPU tensors: the registered op, always


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_table_entries_train_through_the_eager_path(dtype):
    """On CUDA with gradients the entries take `eager_autograd` (no custom-op dispatch): same
    outputs and gradients as the registered ops, bit for bit where the kernels are deterministic."""
    for name, eager, op, args, outputs in _cases(dtype, "cuda"):
        assert _common.eager_cuda(*[a for a in args if isinstance(a, torch.Tensor)])
        got_out, got_grads = _run(eager, _leaves(*args), outputs)
        want_out, want_grads = _run(op, _leaves(*args), outputs)
        exact = name != "deberta_attention"  # its backward sums dq and the tables with fp32 atomics
        for a, b in zip((*got_out, *got_grads), (*want_out, *want_grads)):
            torch.testing.assert_close(a, b, rtol=0 if exact else 2e-2, atol=0 if exact else 1e-3, msg=name)
