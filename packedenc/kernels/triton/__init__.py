"""Fused Triton kernels, registered as the "triton" backend of the op table.

One file per fused op: `layer_norm.py` (layer_norm, add_layer_norm, embed_layer_norm),
`rotary.py`, `glu.py`, `activation.py`, `cross_entropy.py` (linear_cross_entropy),
`deberta/` (DeBERTa's disentangled attention, a sub-package: forward, backward, op), `attention.py` (packed
varlen attention, forward only: FA2 where gradients are needed). Each op is a `torch.library`
custom op `packedenc::<op>` (CPU: the reference; CUDA: the Triton kernel; fake and autograd
registered), and the functions registered here have the reference signatures, so the table calls
either interchangeably.
"""

from packedenc.kernels import register_impl
from packedenc.kernels.triton import (
    activation, attention, cross_entropy, deberta, glu, layer_norm, rotary,
)
from packedenc.kernels.triton import graph_readout

for _name, _fn in (
    ("layer_norm", layer_norm.layer_norm),
    ("add_layer_norm", layer_norm.add_layer_norm),
    ("embed_layer_norm", layer_norm.embed_layer_norm),
    ("rotary", rotary.rotary),
    ("glu", glu.glu),
    ("activation", activation.activation),
    ("deberta_attention", deberta.deberta_attention),
    ("varlen_attention", attention.varlen_attention),  # forward kernel where it wins, else FA2
    ("linear_cross_entropy", cross_entropy.linear_cross_entropy),  # GEMM + in-place loss/grad kernel
    ("graph_readout", graph_readout.graph_readout),  # graph transformer readout, a program per sequence
):
    register_impl("triton", _name, _fn)
