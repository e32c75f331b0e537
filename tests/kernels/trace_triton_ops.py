"""Trace every Triton op's CUDA branch as torch.compile's AOT stage does, on a machine without a GPU.

Fake CUDA tensors stand in for real ones. Without a GPU, run it as a script (never under
TRITON_INTERPRET: the interpreter has no compiled kernel to record); a stand-in Triton driver then
names an sm_90 target, so torch's kernel analysis (which arguments a kernel writes) runs as on the
GPU. Prints one JSON object: op name -> {"kernels": kernel names in the traced graph, "opaque":
whether a `packedenc::` op was left in it} or {"error": the first line of the error}.
`test_triton_op_trace.py` runs it (CPU) or imports `trace` (GPU).

A CPU-only torch cannot functionalize views of fake CUDA tensors nor ask whether a CUDA stream is
capturing, so there the ops whose launchers do either stop with an error; the GPU traces all.
"""

from __future__ import annotations

import json
import os
import warnings


import torch
from torch._functorch.aot_autograd import aot_function
from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
from torch._subclasses.fake_tensor import FakeTensorMode
from triton.backends.compiler import GPUTarget
from triton.runtime import driver

import packedenc.kernels.triton  # noqa: F401  (registers the ops)


class _Sm90:
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_active_torch_device(self):
        return torch.device("cuda", 0)


def cases():
    """(op name, args) with fake CUDA tensors: every forward and backward op, bf16."""
    bf, dev = torch.bfloat16, "cuda"
    T, D, F, H, K, S = 24, 64, 96, 2, 32, 3

    def r(*shape, dtype=bf):
        return torch.empty(shape, device=dev, dtype=dtype)

    cu = torch.empty(S + 1, device=dev, dtype=torch.int32)
    ids, pos = r(T, dtype=torch.int64), r(T, dtype=torch.int64)
    x, w = r(T, D), r(D)
    q, k, v = r(T, H, K), r(T, H, K), r(T, H, K)
    lse2, lse_th = r(H, T, dtype=torch.float32), r(T, H, dtype=torch.float32)
    m, den = r(S, dtype=torch.float32), r(S, dtype=torch.float32)
    return [
        ("layer_norm", (x, w, w, 1e-5)),
        ("add_layer_norm", (x, x, w, w, 1e-5, w)),
        ("embed_layer_norm", (ids, r(50, D), w, w, 1e-5)),
        ("layer_norm_bwd", (x, x, None, x, w, 1e-5, True, True)),
        ("activation", (x, "gelu")),
        ("activation_bwd", (x, x, "gelu")),
        ("bias_activation", (x, w, "gelu")),
        ("bias_activation_bwd", (x, x, w, "gelu")),
        ("glu", (r(T, 2 * F), "gelu")),
        ("glu_bwd", (r(T, F), r(T, 2 * F), "gelu")),
        ("rotary", (r(T, 3, H, K), pos, 10000.0, 1.0)),
        ("rotary_bwd", (q, k, pos, 10000.0, 1.0)),
        ("rotary_qkv", (r(T, 3, H, K), pos, 10000.0, 1.0)),
        ("rotary_qkv_bwd", (q, k, v, pos, 10000.0, 1.0)),
        ("triton_varlen_attention", (q, k, v, cu, 16, 4, 4, 0.2, True)),
        ("triton_varlen_attention_bwd", (q, q, k, v, q, lse2, cu, 16, -1, -1, 0.2)),
        ("graph_readout", (x, r(1, 2 * D), r(1), cu, 16)),
        ("graph_readout_bwd", (r(S, D), x, r(1, 2 * D), r(1), cu, m, den)),
        ("linear_cross_entropy", (x, r(40, D), r(40), r(T, dtype=torch.int64))),
        ("deberta_attention", (q, k, v, cu, 16, r(8, H, K), r(8, H, K), 4, 8, 0.2, None)),
        ("deberta_attention_bwd", (q, q, k, v, q, lse_th, cu, 16, r(8, H, K), r(8, H, K), 4, 8, 0.2)),
    ]


def trace() -> dict[str, dict]:
    assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "trace without TRITON_INTERPRET"
    if not torch.cuda.is_available():
        driver.set_active(_Sm90())
    out: dict[str, dict] = {}
    with FakeTensorMode(allow_non_fake_inputs=True):
        for name, args in cases():
            op = getattr(torch.ops.packedenc, name).default
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            slots = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]

            def f(*ts, op=op, args=args, slots=slots):
                full = list(args)
                for i, t in zip(slots, ts):
                    full[i] = t
                return op(*full)

            graphs = []
            try:
                aot_function(f, fw_compiler=lambda gm, _: graphs.append(gm) or gm)(*tensors)
            except Exception as e:
                out[name] = {"error": str(e).splitlines()[0][:200]}
                continue
            nodes = list(graphs[0].graph.nodes)
            kernels = [kernel_side_table.get_kernel(n.kwargs["kernel_idx"]).fn.__name__
                       for n in nodes if "triton_kernel_wrapper" in str(n.target)]
            opaque = any("packedenc" in str(n.target) for n in nodes)
            out[name] = {"kernels": kernels, "opaque": opaque}
    return out


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    print(json.dumps(trace()))
