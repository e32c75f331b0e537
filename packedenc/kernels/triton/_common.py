"""Launch helpers shared by the Triton kernels: tile sizes and layout checks.

Shapes: T packed tokens, D row width.
Tiles are fixed by heuristics from the row width (no `triton.autotune`): a launch never benchmarks,
so the first call inside CUDA-graph capture or under the interpreter behaves like any other.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable

import torch
from torch import Tensor

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for host ints. `triton.cdiv` is a (constexpr) JIT function whose host call costs
    ~2-4 us of dispatch; launchers compute several grids per call, and an eager doc1k batch of
    DeBERTa-v3-base is host-bound (benchmarks/results/history/NOTES-diary.md)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1), for host ints: `triton.next_power_of_2` is a
    constexpr function too, with the same dispatch cost as `triton.cdiv`."""
    return 1 << (int(n) - 1).bit_length() if n > 1 else 1


def check_float(name: str, *tensors: Tensor) -> None:
    for t in tensors:
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name}: expected float16, bfloat16 or float32, got {t.dtype}")


def rows(x: Tensor) -> Tensor:
    """x as a 2-D (rows, D) tensor whose last dim is contiguous (copies only when it is not).

    Gradients from `.sum().backward()` arrive as stride-0 expanded tensors: they must be
    materialised, or the kernel would read the wrong elements.
    """
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # reshape is a dispatcher call: skip it
    if x2.stride(-1) != 1 or (x2.shape[0] > 1 and x2.stride(0) < x2.shape[1]):
        x2 = x2.contiguous()
    return x2


def row_tile(width: int, target: int = 4096) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_D, num_warps) for a row-wise kernel over rows of `width` elements.

    The whole row sits in registers (BLOCK_D = next power of two); short rows are stacked so
    that one program handles about `target` elements, enough to hide memory latency. A symbolic
    width (torch.compile with dynamic=True makes the weights' dims SymInts too) is specialised by
    int(): the tile is a constexpr, and a model's width does not change between batches.
    """
    return _row_tile(int(width), target)


@functools.lru_cache(maxsize=None)  # host time: called on every launch
def _row_tile(width: int, target: int) -> tuple[int, int, int]:
    block_d = next_pow2(width)
    block_t = max(1, min(64, target // block_d))
    elems = block_t * block_d
    num_warps = 1 if elems <= 256 else 2 if elems <= 1024 else 4 if elems <= 4096 else 8 if elems <= 16384 else 16
    return block_t, block_d, num_warps


def direct_launch(*tensors: Tensor | None) -> bool:
    """True when an Ops-table call may launch its kernel directly, skipping the custom op.

    That is eager inference on plain CUDA tensors: no torch.compile trace, no gradient needed, no
    functorch transform or tensor subclass / dispatch mode (FakeTensor) in play. The custom-op
    dispatcher costs tens of microseconds of host time per call, which decides the speed of short
    batches; compile, autograd and the CPU keep going through the registered op.
    """
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return False
    return eager_cuda(*tensors)


def eager_cuda(*tensors: Tensor | None) -> bool:
    """True in eager execution on plain CUDA tensors, gradients or not (see `direct_launch`)."""
    x = tensors[0]
    if type(x) is not Tensor or not x.is_cuda or torch.compiler.is_compiling():
        return False
    try:
        return torch._C._len_torch_dispatch_stack() == 0 and torch._C._functorch.peek_interpreter_stack() is None
    except AttributeError:  # private hooks moved: take the registered op, always correct
        return False


def eager_autograd(forward: Callable, setup: Callable, backward: Callable) -> Callable:
    """An autograd.Function running a registered op's CUDA launcher with the op's own
    `setup_context` and backward: the same forward and gradients as the custom op, without the
    custom-op dispatcher, whose host time in eager training (hundreds of calls a step) exceeds
    the GPU time of a short batch. torch.compile, functorch and the CPU keep the registered op."""

    class _Eager(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, *args: Any) -> Any:
            out = forward(*args)
            setup(ctx, args, out)
            return out

        @staticmethod
        def backward(ctx: Any, *grads: Any) -> Any:
            return backward(ctx, *grads)

    _Eager.__name__ = _Eager.__qualname__ = f"Eager_{getattr(forward, '__name__', 'op')}"
    return _Eager.apply


def launch_or_op(launcher: Callable, op: Callable, *args: Any) -> Any:
    """A backward's kernel call: the launcher when it may run directly (eager CUDA, the usual case
    inside `eager_autograd`'s backward), else the registered backward op (compile, CPU)."""
    tensors = [a for a in args if isinstance(a, Tensor)]
    return launcher(*args) if direct_launch(*tensors) else op(*args)


# ---- launches ------------------------------------------------------------------------------------

_INT32 = (-(1 << 31), 1 << 31)
# id(kernel) -> (kernel, {(constexprs, argument key, device): (compiled launcher, head, constexpr tail)}):
# keyed by id, checked by identity, because a JITFunction's __hash__ is Python code run on every launch
_DIRECT: dict[int, tuple[Any, dict[tuple, tuple]]] = {}
_INT_KEYS: dict[int, tuple] = {}  # an int's `_arg_key` entry: strides and sizes repeat between launches


def _int_key(a: int) -> tuple:
    k = (a == 1, not a & 15, 0 if _INT32[0] <= a < _INT32[1] else 1 if a < 1 << 63 else 2)
    if len(_INT_KEYS) < 1 << 16:
        _INT_KEYS[a] = k
    return k


def _arg_key(args: tuple) -> tuple:
    """What Triton specialises a compiled kernel on, per positional argument, or finer: a tensor's
    dtype and 16-byte alignment; an int's == 1, multiple of 16 and width (i32, i64 or u64); a
    float's type only; anything else (None, bools, strings) is part of the kernel's identity.
    One comprehension and a dict of ints' entries: this runs on every launch of an eager batch."""
    return tuple([(_INT_KEYS.get(a) or _int_key(a)) if type(a) is int
                  else (a.dtype, not a.data_ptr() & 15) if isinstance(a, Tensor)
                  else float if type(a) is float else (type(a), a) for a in args])


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **meta: Any) -> None:
    """`kernel[grid](*args, **meta)` at a fraction of its host time.

    Non-constexpr arguments go positionally, constexprs and launch options (num_warps, ...) by
    keyword. The first call with a given specialisation goes through Triton's JIT (compiling or
    finding the kernel); later calls launch that compiled kernel directly, skipping the JIT's
    binding and key strings, which decide short eager batches: with 24 arguments the JIT adds 11-19
    us to the compiled kernel's own launcher (21.5 vs 10.6, 36.7 vs 17.3 us on two H200 hosts), this
    function ~6 us (16.6 us; benchmarks/results/host_probe_h200.json). The cache key
    (`_arg_key`) distinguishes at least what Triton's does, so the kernel launched is the one the
    JIT would pick. The interpreter, a kernel with pre-run hooks and any launch while a Triton launch
    hook is set (profilers) take the JIT every time.

    Traced (torch.compile decomposing a registered op, fake tensors, a dispatch mode): the launch is
    recorded through `torch.library.wrap_triton`, so the compiled graph calls this kernel itself.
    """
    if _INTERPRET:
        kernel[grid](*args, **meta)
        return
    if type(args[0]) not in _PLAIN or _dispatch_modes():
        _traced_launch(kernel, grid, args, meta)
        return
    if kernel.pre_run_hooks or _launch_hooked():
        kernel[grid](*args, **meta)
        return
    driver = _driver()
    device = _device_getter()()
    per = _DIRECT.get(id(kernel))
    if per is None or per[0] is not kernel:  # a kernel seen for the first time (or a reused id)
        per = _DIRECT[id(kernel)] = (kernel, {})
    key = (tuple(meta.items()), _arg_key(args), device)
    hit = per[1].get(key)
    if hit is None:
        compiled = kernel[grid](*args, **meta)
        names = kernel.arg_names[len(args):]
        defaults = {p.name: p.default for p in kernel.params}
        tail = tuple(meta[n] if n in meta else defaults[n] for n in names)
        if len(per[1]) > 4096:  # a run with many shapes' alignments: start over rather than grow
            per[1].clear()
        per[1][key] = (*_launcher(compiled), tail)
        return
    fn, head, tail = hit
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    fn(grid[0], g1, g2, driver.get_current_stream(device), *head, *args, *tail)


_PLAIN = (Tensor, torch.nn.Parameter)  # what a real launch gets; a trace passes fake / functional tensors

# launch options inductor's user-kernel call does not take: `maxnreg` caps registers, a speed hint
_UNTRACEABLE_OPTIONS = ("maxnreg",)


def _traced_launch(kernel: Any, grid: tuple[int, ...], args: tuple, meta: dict) -> None:
    """`launch` under tracing: every launch's first argument is a tensor, so a FakeTensor or
    FunctionalTensor there (or a dispatch mode) means a trace, never a real launch."""
    from torch.library import wrap_triton

    meta = {k: v for k, v in meta.items() if k not in _UNTRACEABLE_OPTIONS}
    wrap_triton(kernel)[grid](*args, **meta)


def _launcher(compiled: Any) -> tuple[Callable, tuple]:
    """(callable, the arguments between the stream and the kernel's own) for a compiled kernel.

    A kernel that needs no scratch memory (ours: no device-side allocation, no profiler) is
    launched by the C function under Triton's `CudaLauncher`: its Python `__call__` only works
    out scratch buffers, and costs ~1-2 us a call. Anything else, or a Triton whose launcher
    lacks these fields, goes through `compiled.run`, which takes the same arguments as the JIT's.
    """
    run = compiled.run
    c_launch = getattr(run, "launch", None)
    if (callable(c_launch) and getattr(run, "global_scratch_size", None) == 0
            and getattr(run, "profile_scratch_size", None) == 0
            and hasattr(run, "launch_cooperative_grid") and hasattr(run, "launch_pdl")):
        # C signature: grid, stream, function, cooperative, pdl, global / profile scratch, packed
        # metadata, launch metadata, enter / exit hooks, then the kernel's arguments
        return c_launch, (compiled.function, run.launch_cooperative_grid, run.launch_pdl, None, None,
                          compiled.packed_metadata, None, None, None)
    return run, (compiled.function, compiled.packed_metadata, None, None, None)


@functools.lru_cache(maxsize=1)
def _device_getter() -> Callable[[], int]:
    """The current CUDA device index: torch's C getter (no Python wrapper, no lazy-init check: a
    launch only gets here once a kernel has run), or the driver's where torch has no CUDA."""
    return getattr(torch._C, "_cuda_getDevice", None) or _driver().get_current_device


def _launch_hooked() -> bool:
    """A Triton launch hook is set: a callable, or one of Triton's (always present) hook chains with calls."""
    rt = _runtime_knobs()
    enter, exit_ = rt.launch_enter_hook, rt.launch_exit_hook
    return (enter is not None and bool(getattr(enter, "calls", True))) or (
        exit_ is not None and bool(getattr(exit_, "calls", True)))


# the number of active dispatch modes (make_fx, FakeTensorMode, ...); 0 where torch moved the hook
_dispatch_modes = getattr(torch._C, "_len_torch_dispatch_stack", lambda: 0)
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=1)
def _runtime_knobs() -> Any:
    from triton import knobs

    return knobs.runtime


@functools.lru_cache(maxsize=1)
def _driver() -> Any:
    from triton.runtime import driver

    return driver.active
