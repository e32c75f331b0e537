"""CuteDSL kernels and the FlashAttention-4 path: the optional "cute" backend (sm90+).

    pip install 'packedenc[cute]'    # nvidia-cutlass-dsl, flash-attn-4, quack-kernels, apache-tvm-ffi, pinned

What it registers (`backend.py`, imported by the op table when "cute" is asked for or tried by
"auto"): `varlen_attention` through FlashAttention-4's CuteDSL varlen kernels, forward and
backward, global and windowed, head dims 64 and 128, fp16 / bf16 (`attention.py`, its `covers_fa4`
says which calls it takes; the table routes the rest to the next choice), `linear_glu` (the
GeGLU input projection as one Hopper GEMM with the gate in its epilogue, inference only:
`geglu_gemm.py`, `linear_glu.py`), and `layer_norm` / `add_layer_norm` (no x_bias) through
quack-kernels' CuteDSL LayerNorm, forward and backward, fp16 / bf16, D % 8 == 0 from 256 to 8192
(`norms.py`, its `covers_*` rules).
Without the extra, `backend="cute"` raises a ConfigError that names it; "auto" never picks it.
Whether "auto" picks it where it is installed is `kernels/auto.py`'s table, from measurements.

## Compile caches (why the first call of each kernel takes ~0.5-1 s)

CuteDSL compiles each kernel (per dtype, head dim, window / global, training or not; per model
width for the GeGLU GEMM) the first time it runs in a process. Both kinds are kept on disk:

- our GeGLU GEMM (`geglu_gemm.py`), always, by `compile_cache.py`: under
  `~/.cache/packedenc/cute` (`PACKEDENC_CUTE_CACHE=/path` moves it, `=off` turns it off);
- FA4's attention, when asked to, before `flash_attn.cute` is first imported (it reads the
  variables at import):

    export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
    export FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=~/.cache/packedenc/fa4   # default: $TMPDIR/$USER/...
    python -m packedenc.kernels.cute --head-dims 64 --dtypes bf16      # warm both once per machine

Later processes (with the same two variables) load the kernels instead of compiling them. Both
caches are keyed by the kernel sources and the cutlass / Python versions, so an upgrade
recompiles on first use.
"""
