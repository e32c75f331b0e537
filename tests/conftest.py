"""Shared test setup.

Without a CUDA GPU, Triton kernels run under the interpreter: TRITON_INTERPRET must be set before
any kernel module is imported (triton picks the mode when `@triton.jit` decorates), so it is set
here, at collection time, and every interpreted launch is bounds-checked (`_kernel_bounds`). Tests
marked `gpu` are skipped without a GPU. CuteDSL's compile cache
(`kernels/cute/compile_cache.py`) goes to a temporary folder of this session, not the user's.
"""

import os
import shutil
import tempfile

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
_CUTE_CACHE = os.environ["PACKEDENC_CUTE_CACHE"] = tempfile.mkdtemp(prefix="packedenc-cute-cache-")


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(_CUTE_CACHE, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (marker `gpu`)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _kernel_bounds():
    """Under the interpreter every Triton load and store must land inside one of its launch's
    tensors (`tests/kernels/_bounds.py`): an out-of-bounds access that a GPU run survives by luck
    of allocation fails here, in every test that launches a kernel."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        yield
        return
    from tests.kernels._bounds import bounds_checked

    with bounds_checked():
        yield
