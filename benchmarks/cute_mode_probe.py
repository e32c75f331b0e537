"""Host us a call of the op table's linear_glu (cute and triton entries) under no_grad and under
inference_mode, at 64 and 3,628 rows (a `query` batch): does the mode change the CuteDSL call's host cost?

    python3 -m benchmarks.cute_mode_probe     # H200 with the gpu-stack, ~30 s
"""

from __future__ import annotations

import torch

from benchmarks.cute_host_probe import D, FM, host_us


def main() -> int:
    import packedenc as pe

    w = torch.randn(2 * FM, D, device="cuda", dtype=torch.bfloat16) * 0.03
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            for T in (64, 3628):
                x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
                for backend in ("cute", "triton"):
                    ops = pe.get_ops(backend, "cuda")
                    us = host_us(lambda: ops.linear_glu(x, w, None, "gelu"), calls=200)
                    print(f"{mode.__name__:15s} T={T:5d} {backend:7s} host {us:7.1f} us a call", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
