"""An address sanitizer for Triton kernels under the interpreter (TRITON_INTERPRET=1).

Every load and store a kernel makes (masked-off lanes excluded) must fall inside the storage of
one of the tensors passed to that launch. On a GPU an access past the end of a tensor is usually
silent (the next bytes belong to the same allocator segment) and faults only when the tensor
happens to end a segment, which depends on what ran before; here it fails at once, with the
kernel's name. Use `with bounds_checked(): ...` around kernel calls on CPU tensors.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import numpy as np


class OutOfBounds(AssertionError):
    pass


def _storages(args) -> list[tuple[int, int]]:
    out = []

    def visit(x):
        if isinstance(x, (tuple, list)):
            for y in x:
                visit(y)
        elif hasattr(x, "untyped_storage"):
            s = x.untyped_storage()
            out.append((s.data_ptr(), s.data_ptr() + s.nbytes()))

    visit(args)
    return out


@contextlib.contextmanager
def bounds_checked() -> Iterator[list[str]]:
    """Patch the interpreter for the block; yields the list of kernels launched ("module.kernel")."""
    from triton.runtime import interpreter as I

    launched: list[str] = []
    state: dict = {"ranges": [], "kernel": "?"}
    init0, load0, store0 = (I.GridExecutor._init_args_hst, I.InterpreterBuilder.create_masked_load,
                            I.InterpreterBuilder.create_masked_store)
    rmw0 = I.InterpreterBuilder.create_atomic_rmw

    def init(self, args_dev, kwargs):
        args_hst, kwargs_hst = init0(self, args_dev, kwargs)
        state["ranges"] = _storages([list(args_hst), list(kwargs_hst.values())])
        fn = self.fn  # "module.kernel": several modules name their kernels alike (_fwd_kernel)
        state["kernel"] = f"{getattr(fn, '__module__', '?').rsplit('.', 1)[-1]}.{getattr(fn, '__name__', '?')}"
        launched.append(state["kernel"])
        return args_hst, kwargs_hst

    def check(ptrs, mask, what):
        addr = np.asarray(ptrs.data, dtype=np.uint64)
        on = np.ones(addr.shape, bool) if mask is None else np.broadcast_to(np.asarray(mask.data, bool), addr.shape)
        addr = addr[on]
        if addr.size == 0:
            return
        size = max(1, ptrs.get_element_ty().primitive_bitwidth // 8)
        ok = np.zeros(addr.shape, bool)
        for lo, hi in state["ranges"]:
            ok |= (addr >= lo) & (addr + size <= hi)
        if not ok.all():
            bad = addr[~ok]
            raise OutOfBounds(f"{state['kernel']}: {bad.size} {what}(s) outside every argument's storage "
                              f"(first at {int(bad[0]):#x}; storages {[(hex(a), b - a) for a, b in state['ranges']]})")

    def load(self, ptrs, mask, other, cache_policy, is_volatile):
        check(ptrs, mask, "load")
        return load0(self, ptrs, mask, other, cache_policy, is_volatile)

    def store(self, ptrs, value, mask, cache_policy):
        check(ptrs, mask, "store")
        return store0(self, ptrs, value, mask, cache_policy)

    def rmw(self, op, ptr, val, mask, sem, scope):
        check(ptr, mask, "atomic")
        return rmw0(self, op, ptr, val, mask, sem, scope)

    I.GridExecutor._init_args_hst = init
    I.InterpreterBuilder.create_masked_load = load
    I.InterpreterBuilder.create_masked_store = store
    I.InterpreterBuilder.create_atomic_rmw = rmw
    try:
        yield launched
    finally:
        I.GridExecutor._init_args_hst = init0
        I.InterpreterBuilder.create_masked_load = load0
        I.InterpreterBuilder.create_masked_store = store0
        I.InterpreterBuilder.create_atomic_rmw = rmw0
