"""Shared helpers for kernel tests: the 2x rule, ragged packs, the test device.

The 2x rule (FlashAttention's test rule): a kernel's error against the reference run in fp32 may
be at most twice the error of the plain reference run in the same low precision, plus a small
atol. Without a GPU the Triton kernels run under TRITON_INTERPRET=1 (tests/conftest.py) on CPU
tensors; with one they run compiled on CUDA tensors.
"""

from __future__ import annotations

import importlib.util

import torch
from torch import Tensor

HAS_CUDA = torch.cuda.is_available()
# nvidia-cutlass-dsl (the cute extra's compiler) is importable: CuteDSL kernels compile, GPU or not
HAS_CUTLASS = importlib.util.find_spec("cutlass") is not None
DEVICE = "cuda" if HAS_CUDA else "cpu"

# Lengths that cross 64-token tile / window edges, plus length 1 (GPU tests).
GPU_LENGTHS = (1, 63, 64, 65, 128, 129, 130, 2047, 4096)
# Tiny ragged packs for the interpreter: a length-1 sequence, odd lengths, one past a 4-row tile.
CPU_LENGTHS = (1, 5, 3, 9, 2)


def err(out: Tensor, ref: Tensor) -> float:
    return (out.float() - ref.float()).abs().max().item()


def assert_close_to_ref(out: Tensor, ref_fp32: Tensor, ref_lowp: Tensor, atol: float = 1e-5, what: str = "") -> None:
    """err(out) <= 2 * err(ref_lowp) + atol * max(1, |ref_fp32|max), errors against the fp32 reference."""
    assert out.shape == ref_fp32.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref_fp32.shape)}"
    assert out.dtype == ref_lowp.dtype, f"{what}: dtype {out.dtype} != {ref_lowp.dtype}"
    assert torch.isfinite(out.float()).all(), f"{what}: non-finite output"
    e, base = err(out, ref_fp32), err(ref_lowp, ref_fp32)
    atol = atol * max(1.0, ref_fp32.float().abs().max().item())
    assert e <= 2 * base + atol, f"{what}: error {e:.3g} > 2 * {base:.3g} (plain {ref_lowp.dtype} reference) + {atol:g}"


def cu_seqlens(lengths, device=DEVICE) -> Tensor:
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    return cu.to(device)


def positions(lengths, device=DEVICE) -> Tensor:
    return torch.cat([torch.arange(n) for n in lengths]).to(device)


def other_rows(lengths, s: int, device=DEVICE) -> Tensor:
    """(T,) bool mask of the tokens NOT in sequence s (for isolation tests)."""
    cu = cu_seqlens(lengths, "cpu")
    m = torch.ones(int(cu[-1]), dtype=torch.bool)
    m[cu[s] : cu[s + 1]] = False
    return m.to(device)


def skip_without_cute(capable, why: str) -> None:
    """Skip unless a CUDA GPU is here, the cute extra loads and `capable(capability)` holds (`why` says what)."""
    import pytest

    from packedenc import kernels

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if not kernels._load_backend("cute"):
        pytest.skip(f"the cute extra does not load here: {kernels._IMPORT_ERRORS.get('cute')}")
    if not capable(torch.cuda.get_device_capability()):
        pytest.skip(why)
