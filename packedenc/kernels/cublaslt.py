"""Inference GEMMs through cuBLASLt called directly: `linear` = x @ W.T + b with no torch op around it.

Why: eager short batches are host-bound, and an `F.linear` pays torch's dispatch, a fresh cuBLASLt
matmul descriptor, four matrix layouts and an algorithm heuristic on every call. Here all of that
is made once per (rows, out, in, dtype) and kept (`_Plan`), so a call is one output allocation and
one `cublasLtMatmul` through ctypes. The host cost against `F.linear` is measured by
`python -m benchmarks.linear_probe` (benchmarks/results).

The library is the libcublasLt that torch has loaded (found in the process's memory map after
one cuBLAS call), so the kernels and their numerics are torch's own; the algorithm is cuBLASLt's
first heuristic choice for the same problem, as torch's. Row-major torch tensors read as
column-major: out (M, N) = x (M, K) @ W.T is D (N, M) = op(A) (N, K) @ B (K, M) with A = W
(K x N, ld K, transposed), B = x (K x M, ld K), the bias added along D's rows (N).

Only what `covers_linear` accepts comes here (inference, CUDA, fp16 / bf16, contiguous operands
with 16-byte aligned addresses, outside CUDA-graph capture and torch.compile); the op table sends
everything else to `F.linear`. Shapes: M rows (tokens), K in features, N out features.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading

import torch
from torch import Tensor

__all__ = ["linear", "covers_linear", "available"]

_V = ctypes.c_void_p
_COMPUTE_32F, _R_32F = 68, 0
_DTYPES = {torch.float16: 2, torch.bfloat16: 14}  # cudaDataType_t
_TRANSA, _TRANSB, _EPILOGUE, _BIAS_POINTER = 3, 4, 7, 8  # cublasLtMatmulDescAttributes_t
_EPI_DEFAULT, _EPI_BIAS = 1, 4
_PREF_WORKSPACE, _PREF_ALIGN = 1, (5, 6, 7, 8)  # cublasLtMatmulPreferenceAttributes_t: A, B, C, D
ALIGN = 16  # bytes: every operand's address and leading dimension (plans are found for this)
WORKSPACE = 32 << 20  # bytes per (device, stream)
_MAX_PLANS = 512


class _Heuristic(ctypes.Structure):  # cublasLtMatmulHeuristicResult_t
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


class LtError(RuntimeError):
    pass


def _library_path() -> str | None:
    """The libcublasLt torch has loaded (after one cuBLAS call), else the system's."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                if "libcublasLt.so" in line:
                    return line.split()[-1]
    except OSError:
        pass
    return ctypes.util.find_library("cublasLt")


class _Lt:
    """The library's functions, a handle, and the per-stream workspaces."""

    def __init__(self):
        x = torch.ones(16, 16, device="cuda", dtype=torch.float16)
        torch.nn.functional.linear(x, x, x[0])  # loads cuBLAS (and cuBLASLt) into this process
        path = _library_path()
        if path is None:
            raise LtError("libcublasLt not found in this process")
        lib = ctypes.CDLL(path)
        P = ctypes.POINTER
        sig = {
            "cublasLtCreate": [P(_V)],
            "cublasLtMatmulDescCreate": [P(_V), ctypes.c_int, ctypes.c_int],
            "cublasLtMatmulDescSetAttribute": [_V, ctypes.c_int, _V, ctypes.c_size_t],
            "cublasLtMatmulDescDestroy": [_V],
            "cublasLtMatrixLayoutCreate": [P(_V), ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int64],
            "cublasLtMatrixLayoutDestroy": [_V],
            "cublasLtMatmulPreferenceCreate": [P(_V)],
            "cublasLtMatmulPreferenceSetAttribute": [_V, ctypes.c_int, _V, ctypes.c_size_t],
            "cublasLtMatmulPreferenceDestroy": [_V],
            "cublasLtMatmulAlgoGetHeuristic": [_V, _V, _V, _V, _V, _V, _V, ctypes.c_int, P(_Heuristic),
                                              P(ctypes.c_int)],
            "cublasLtMatmul": [_V] * 14 + [ctypes.c_size_t, _V],
        }
        for name, args in sig.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, ctypes.c_int
        self.lib, self.matmul = lib, lib.cublasLtMatmul
        self.handle = _V()
        self.check(lib.cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")
        self.one, self.zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
        self.one_p, self.zero_p = ctypes.addressof(self.one), ctypes.addressof(self.zero)
        self.workspaces: dict[tuple[int, int], Tensor] = {}

    @staticmethod
    def check(status: int, what: str) -> None:
        if status != 0:
            raise LtError(f"{what} failed: cublasStatus {status}")

    def workspace(self, device: int, stream: int) -> int:
        """One workspace per (device, stream): calls queued on one stream run in order, so they can share it."""
        ws = self.workspaces.get((device, stream))
        if ws is None:
            ws = self.workspaces[(device, stream)] = torch.empty(WORKSPACE, dtype=torch.uint8, device=f"cuda:{device}")
        return ws.data_ptr()


class _Plan:
    """Everything cublasLtMatmul needs for one (M, N, K, dtype, bias?) but the pointers."""

    def __init__(self, lt: _Lt, M: int, N: int, K: int, dtype: torch.dtype, bias: bool):
        lib, dt = lt.lib, _DTYPES[dtype]
        self.desc, self.bias_ptr = _V(), None
        lt.check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), _COMPUTE_32F, _R_32F), "MatmulDescCreate")
        self._set(lt, _TRANSA, ctypes.c_int32(1))  # A = W read transposed
        self._set(lt, _TRANSB, ctypes.c_int32(0))
        self._set(lt, _EPILOGUE, ctypes.c_int32(_EPI_BIAS if bias else _EPI_DEFAULT))
        self.layouts = [_V() for _ in range(3)]  # A (K, N), B (K, M), D (N, M), column-major
        for lay, (r, c) in zip(self.layouts, ((K, N), (K, M), (N, M))):
            lt.check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(lay), dt, r, c, r), "MatrixLayoutCreate")
        pref = _V()
        lt.check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "MatmulPreferenceCreate")
        try:
            ws = ctypes.c_uint64(WORKSPACE)
            lt.check(lib.cublasLtMatmulPreferenceSetAttribute(pref, _PREF_WORKSPACE, ctypes.byref(ws), 8), "pref")
            align = ctypes.c_uint32(ALIGN)
            for attr in _PREF_ALIGN:
                lt.check(lib.cublasLtMatmulPreferenceSetAttribute(pref, attr, ctypes.byref(align), 4), "pref")
            if bias:  # the heuristic reads the bias pointer's alignment: an aligned stand-in
                self.set_bias(lt, ALIGN)
            a, b, d = self.layouts
            self.heuristic, n = _Heuristic(), ctypes.c_int(0)
            lt.check(lib.cublasLtMatmulAlgoGetHeuristic(lt.handle, self.desc, a, b, d, d, pref, 1,
                                                        ctypes.byref(self.heuristic), ctypes.byref(n)), "heuristic")
            if n.value < 1:
                raise LtError(f"no cuBLASLt algorithm for ({M}, {K}) @ ({K}, {N}) {dtype}")
        finally:
            lib.cublasLtMatmulPreferenceDestroy(pref)
        self.algo = ctypes.addressof(self.heuristic.algo)
        self.args = (lt.handle.value, self.desc.value, *(lay.value for lay in self.layouts), self.algo)

    def _set(self, lt: _Lt, attr: int, value) -> None:
        lt.check(lt.lib.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(value), ctypes.sizeof(value)),
                 "MatmulDescSetAttribute")

    def set_bias(self, lt: _Lt, ptr: int) -> None:
        if ptr != self.bias_ptr:
            self._set(lt, _BIAS_POINTER, _V(ptr))
            self.bias_ptr = ptr

    def destroy(self, lt: _Lt) -> None:
        for lay in self.layouts:
            lt.lib.cublasLtMatrixLayoutDestroy(lay)
        lt.lib.cublasLtMatmulDescDestroy(self.desc)


_LT: _Lt | None = None
_LT_ERROR: str | None = None
_PLANS: dict[tuple, _Plan] = {}
_LOCK = threading.Lock()  # a plan's bias pointer is set before its call: one call at a time


def available() -> bool:
    """Whether the library loads here (CUDA, a libcublasLt in the process); asked once."""
    global _LT, _LT_ERROR
    if _LT is None and _LT_ERROR is None:
        try:
            if not torch.cuda.is_available():
                raise LtError("no CUDA device")
            _LT = _Lt()
        except (LtError, OSError, AttributeError) as e:
            _LT_ERROR = f"{type(e).__name__}: {e}"
    return _LT is not None


def _aligned(t: Tensor) -> bool:
    return t.data_ptr() % ALIGN == 0


def covers_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> bool:
    """The calls `linear` takes (host values only): 2-D contiguous fp16 / bf16 CUDA operands of one
    dtype and device, 16-byte aligned, rows and features that keep it so, no gradient."""
    if not x.is_cuda or x.dim() != 2 or x.dtype not in _DTYPES or weight.dtype != x.dtype:
        return False
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or bias is not None and bias.requires_grad):
        return False
    M, K = x.shape
    N = weight.shape[0]
    if M == 0 or K % 8 or N % 8 or weight.shape[1] != K or not x.is_contiguous() or not weight.is_contiguous():
        return False
    if weight.device != x.device or not _aligned(x) or not _aligned(weight):
        return False
    if bias is not None and (bias.dtype != x.dtype or bias.shape != (N,) or bias.device != x.device
                             or bias.stride(0) != 1 or not _aligned(bias)):
        return False
    return available()


def _plan(M: int, N: int, K: int, dtype: torch.dtype, bias: bool) -> _Plan:
    key = (M, N, K, dtype, bias)
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= _MAX_PLANS:  # many distinct batch sizes: start again
            for p in _PLANS.values():
                p.destroy(_LT)
            _PLANS.clear()
        plan = _PLANS[key] = _Plan(_LT, M, N, K, dtype, bias)
    return plan


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x @ weight.T + bias, (M, N) in x's dtype: `reference.linear`'s result from the same cuBLASLt
    kernels, for the calls `covers_linear` accepts."""
    M, K = x.shape
    N = weight.shape[0]
    plan = _plan(M, N, K, x.dtype, bias is not None)
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    dev = x.device.index
    stream = torch._C._cuda_getCurrentRawStream(dev)
    lt = _LT
    h, desc, a, b, d, algo = plan.args
    o = out.data_ptr()
    with _LOCK:
        if bias is not None:
            plan.set_bias(lt, bias.data_ptr())
        status = lt.matmul(h, desc, lt.one_p, weight.data_ptr(), a, x.data_ptr(), b, lt.zero_p, o, d, o, d, algo,
                           lt.workspace(dev, stream), WORKSPACE, stream)
    if status != 0:
        raise LtError(f"cublasLtMatmul failed: cublasStatus {status} for ({M}, {K}) @ ({K}, {N}) {x.dtype}")
    return out
