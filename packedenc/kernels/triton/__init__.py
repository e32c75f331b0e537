"""Fused Triton kernels, registered as the "triton" backend of the op table.

One file per fused op: `layer_norm.py` (layer_norm, add_layer_norm, embed_layer_norm),
`rotary.py`, `glu.py`, `activation.py`, `cross_entropy.py` (linear_cross_entropy),
`graph_readout.py`, `deberta/` (DeBERTa's disentangled attention, a sub-package: slots, scores,
tiles, forward, backward, op), `attention.py` (packed varlen attention: forward kernel and tiles;
`attention_bwd.py` the backward, `attention_op.py` the registered op and the varlen_attention /
graph_attention entries). Each op is a `torch.library.triton_op` `packedenc::<op>` (CPU: the
reference; CUDA: the Triton kernel, which a trace records through `wrap_triton`; the DeBERTa
attention is a plain custom op, `deberta/op.py` says why), with autograd registered, and the
functions registered here have the reference signatures, so the table calls either interchangeably. `linear_glu.py` is a forward-only GEMM with the GeGLU
gate in its epilogue (eager inference; the op table runs the op's parts, cuBLAS then `glu`, elsewhere),
and with a LayerNorm prologue (`layer_norm_linear_glu`); `layer_norm_linear.py` is the same GEMM
without the gate, for the norm before an attention's Wqkv.
"""

from packedenc.kernels import register_impl
from packedenc.kernels.triton import (
    activation, attention_op, cross_entropy, deberta, glu, layer_norm, rotary,
)
from packedenc.kernels.triton import graph_readout, layer_norm_linear, linear_glu

for _name, _fn in (
    ("layer_norm", layer_norm.layer_norm),
    ("add_layer_norm", layer_norm.add_layer_norm),
    ("embed_layer_norm", layer_norm.embed_layer_norm),
    ("rotary", rotary.rotary),
    ("glu", glu.glu),
    ("activation", activation.activation),
    ("deberta_attention", deberta.deberta_attention),
    ("varlen_attention", attention_op.varlen_attention),  # forward and backward, every input
    ("linear_cross_entropy", cross_entropy.linear_cross_entropy),  # GEMM + in-place loss/grad kernel
    ("graph_readout", graph_readout.graph_readout),  # graph transformer readout, a program per sequence
):
    register_impl("triton", _name, _fn)
# full layers' fused fp16 / bf16 qkv only: the op table routes the rest (kernels/__init__.py)
register_impl("triton", "graph_attention", attention_op.graph_attention, covers=attention_op.covers_graph)
# eager inference on short sequences: the rest runs the table's rotary, then its varlen_attention
register_impl("triton", "rotary_attention", attention_op.rotary_attention, covers=attention_op.covers_rotary_attention)
# eager inference: one GEMM with the gate in its epilogue; the rest runs the table's linear, then its glu
register_impl("triton", "linear_glu", linear_glu.covered_linear_glu, covers=linear_glu.covers_linear_glu)
register_impl("triton", "layer_norm_linear_glu", linear_glu.covered_layer_norm_linear_glu,
              covers=linear_glu.covers_layer_norm_linear_glu)
# the same GEMM without the gate: the norm before Wqkv; the rest runs the table's layer_norm, then its linear
register_impl("triton", "layer_norm_linear", layer_norm_linear.covered_layer_norm_linear,
              covers=layer_norm_linear.covers_layer_norm_linear)
