"""The interpreter's bounds check (`_bounds.py`, on for every CPU test by tests/conftest.py) catches
a load or a store one element past a tensor, and lets masked-off lanes and in-bounds views pass."""

import os

import pytest
import torch
import triton
import triton.language as tl

from tests.kernels._bounds import OutOfBounds, bounds_checked

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="checks the Triton interpreter")


@triton.jit
def _copy(X, Y, N, MASK_LOAD: tl.constexpr, MASK_STORE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < N, other=0.0) if MASK_LOAD else tl.load(X + offs)
    if MASK_STORE:
        tl.store(Y + offs, x, mask=offs < N)
    else:
        tl.store(Y + offs, x)


def _run(x, y, mask_load, mask_store):
    _copy[(1,)](x, y, x.numel(), MASK_LOAD=mask_load, MASK_STORE=mask_store, BLOCK=8)


def test_masked_accesses_pass_and_copy():
    x, y = torch.arange(5, dtype=torch.float32), torch.zeros(5)
    with bounds_checked() as launched:
        _run(x, y, True, True)
    assert launched == ["test_bounds._copy"] and torch.equal(x, y)


@pytest.mark.parametrize("mask_load, mask_store, what", [(False, True, "load"), (True, False, "store")])
def test_an_access_past_the_end_fails_with_the_kernels_name(mask_load, mask_store, what):
    base = torch.zeros(16)
    x, y = base[:5], torch.zeros(5)  # x's storage ends at 16 elements: a load of 8 fits, a store of 8 into y does not
    x2 = torch.arange(5, dtype=torch.float32)  # a storage of exactly 5
    from triton.runtime.errors import InterpreterError  # the interpreter wraps a kernel's exception in it
    with bounds_checked(), pytest.raises((OutOfBounds, InterpreterError), match=f"test_bounds._copy: 3 {what}"):
        _run(x2 if what == "load" else x, y, mask_load, mask_store)


def test_a_view_reads_anywhere_in_its_storage():
    """The check is per storage (an allocation), as a GPU fault is: a view may read its base's
    other rows, which a kernel given strides does legitimately."""
    base = torch.arange(16, dtype=torch.float32)
    y = torch.zeros(8)
    with bounds_checked():
        _copy[(1,)](base[:5], y, 5, MASK_LOAD=False, MASK_STORE=False, BLOCK=8)
    assert torch.equal(y, base[:8])
