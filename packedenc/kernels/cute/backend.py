"""Registers the "cute" backend's implementations in the op table (imported by `kernels/__init__.py`).

The import fails where CuteDSL or FlashAttention-4 is missing: the op table records that and turns
it into a ConfigError for `backend="cute"` that names the extra (`pip install 'packedenc[cute]'`);
"auto" skips cute.
"""

from __future__ import annotations

import importlib

from packedenc.kernels import register_impl

REQUIRES = {"cutlass": "nvidia-cutlass-dsl", "cutlass.cute": "nvidia-cutlass-dsl",
            "flash_attn.cute": "flash-attn-4",
            "tvm_ffi": "apache-tvm-ffi",  # geglu_gemm.py: the compiled GEMM is called through TVM-FFI
            "quack.rmsnorm": "quack-kernels"}  # norms.py: LayerNorm forward and backward


def _require() -> None:
    for module, package in REQUIRES.items():
        try:
            importlib.import_module(module)
        except Exception as e:  # missing, or present without its CUDA libraries
            raise ImportError(f"{module} ({package}) does not import: {type(e).__name__}: {e}") from e


_require()

# After the check: the CUDA kernels of these modules import FA4 / cutlass / quack.
from packedenc.kernels.cute import attention, linear_glu, norms  # noqa: E402

register_impl("cute", "varlen_attention", attention.varlen_attention, covers=attention.covers_fa4)
register_impl("cute", "linear_glu", linear_glu.covered_linear_glu, covers=linear_glu.covers_linear_glu)
register_impl("cute", "layer_norm", norms.layer_norm, covers=norms.covers_layer_norm)
register_impl("cute", "add_layer_norm", norms.add_layer_norm, covers=norms.covers_add_layer_norm)
