"""`_common.launch`: the cached direct launch of compiled Triton kernels (CPU: a fake kernel).

The GPU suite runs every kernel through it; here its bookkeeping is checked without a GPU: which
calls go through the JIT, which launch the cached compiled kernel, and with which arguments.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch

from packedenc.kernels.triton import _common


class FakeCompiled:
    def __init__(self, log):
        self.log, self.function, self.packed_metadata = log, "fn-handle", "meta"

    def run(self, g0, g1, g2, stream, function, packed, launch_metadata, enter, exit_, *args):
        self.log.append(("direct", (g0, g1, g2), stream, args))


class FakeKernel:
    """A JITFunction's launch surface: kernel[grid](*args, **meta) -> compiled kernel."""

    def __init__(self):
        self.log, self.pre_run_hooks = [], []

        def sig(x, y, n, scale, BLOCK, FLAG=True):  # noqa: N803 - constexpr names as in kernels
            pass

        self.arg_names = list(inspect.signature(sig).parameters)
        self.params = [SimpleNamespace(name=p.name, default=p.default) for p in inspect.signature(sig).parameters.values()]

    def __getitem__(self, grid):
        def run(*args, **meta):
            self.log.append(("jit", grid, args, meta))
            return FakeCompiled(self.log)

        return run


@pytest.fixture
def direct(monkeypatch):
    """launch() as on a GPU: not interpreting, a fake driver giving device 0 and stream 7."""
    monkeypatch.setattr(_common, "_INTERPRET", False)
    monkeypatch.setattr(_common, "_driver", lambda: SimpleNamespace(get_current_device=lambda: 0,
                                                                   get_current_stream=lambda d: 7))
    _common._DIRECT.clear()
    _common._device_getter.cache_clear()
    yield
    _common._DIRECT.clear()
    _common._device_getter.cache_clear()


def test_second_call_launches_the_compiled_kernel_with_constexprs_in_order(direct):
    k = FakeKernel()
    x, y = torch.zeros(64), torch.zeros(64)
    _common.launch(k, (4,), x, y, 64, 0.5, BLOCK=32, num_warps=4)
    _common.launch(k, (5, 2), x, y, 64, 0.25, BLOCK=32, num_warps=4)
    assert [e[0] for e in k.log] == ["jit", "direct"]
    kind, grid, stream, args = k.log[1]
    assert grid == (5, 2, 1) and stream == 7
    # every parameter in signature order: the launcher drops the constexpr slots itself
    assert args[:4] == (x, y, 64, 0.25) and args[4:] == (32, True)


def test_a_new_specialisation_goes_through_the_jit(direct):
    k = FakeKernel()
    buf = torch.zeros(80)
    x, y = buf[:64], buf[1:65]  # y is not 16-byte aligned
    _common.launch(k, (1,), x, x, 64, 1.0, BLOCK=32)
    _common.launch(k, (1,), x, y, 64, 1.0, BLOCK=32)  # alignment differs
    _common.launch(k, (1,), x, x, 63, 1.0, BLOCK=32)  # no longer a multiple of 16
    _common.launch(k, (1,), x, x, 1, 1.0, BLOCK=32)  # == 1
    _common.launch(k, (1,), x, x, 64, 1.0, BLOCK=64)  # another constexpr
    _common.launch(k, (1,), x, x, 64, 1.0, BLOCK=32, num_warps=8)  # another option
    _common.launch(k, (1,), x.half(), x, 64, 1.0, BLOCK=32)  # another dtype
    _common.launch(k, (1,), x, x, 1 << 40, 1.0, BLOCK=32)  # a 64-bit int
    _common.launch(k, (1,), x, x, 1 << 63, 1.0, BLOCK=32)  # an unsigned 64-bit int
    assert [e[0] for e in k.log] == ["jit"] * 9
    _common.launch(k, (1,), x, x, 32, 3.0, BLOCK=32)  # same key as the first (floats are not keyed)
    assert k.log[-1][0] == "direct"


def test_interpreter_and_launch_hooks_always_take_the_jit(direct, monkeypatch):
    from triton import knobs

    k = FakeKernel()
    x = torch.zeros(16)
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda *a: None)
    for _ in range(2):
        _common.launch(k, (1,), x, x, 16, 1.0, BLOCK=16)
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", None)
    k.pre_run_hooks.append(lambda *a, **kw: None)  # e.g. a test recording the launch options
    for _ in range(2):
        _common.launch(k, (1,), x, x, 16, 1.0, BLOCK=16)
    k.pre_run_hooks.clear()
    monkeypatch.setattr(_common, "_INTERPRET", True)
    for _ in range(2):
        _common.launch(k, (1,), x, x, 16, 1.0, BLOCK=16)
    assert [e[0] for e in k.log] == ["jit"] * 6


class FakeCudaLauncher:
    """Triton's CudaLauncher surface: the C `launch` and the fields that say whether scratch is needed."""

    def __init__(self, log, scratch):
        self.log, self.global_scratch_size, self.profile_scratch_size = log, scratch, 0
        self.launch_cooperative_grid, self.launch_pdl = False, True

    def launch(self, g0, g1, g2, stream, function, coop, pdl, gscratch, pscratch, packed, lmeta, enter, exit_, *args):
        self.log.append(("c", (g0, g1, g2), stream, (function, coop, pdl, gscratch, pscratch, packed), args))

    def __call__(self, g0, g1, g2, stream, function, packed, lmeta, enter, exit_, *args):
        self.log.append(("python", (g0, g1, g2), stream, args))


@pytest.mark.parametrize("scratch", [0, 128])
def test_a_kernel_without_scratch_is_launched_by_the_c_launcher(direct, scratch):
    k = FakeKernel()

    def jit(grid):
        def run(*args, **meta):
            k.log.append(("jit", grid, args, meta))
            return SimpleNamespace(run=FakeCudaLauncher(k.log, scratch), function="fn-handle", packed_metadata=(4, 1, 0))
        return run

    k.__class__ = type("K", (FakeKernel,), {"__getitem__": lambda self, grid: jit(grid)})
    x = torch.zeros(64)
    _common.launch(k, (3,), x, x, 64, 0.5, BLOCK=32)
    _common.launch(k, (3, 2), x, x, 64, 0.5, BLOCK=32)
    if scratch:  # scratch to allocate: the launcher's own __call__ does it
        assert k.log[1] == ("python", (3, 2, 1), 7, (x, x, 64, 0.5, 32, True))
    else:
        assert k.log[1] == ("c", (3, 2, 1), 7, ("fn-handle", False, True, None, None, (4, 1, 0)), (x, x, 64, 0.5, 32, True))
