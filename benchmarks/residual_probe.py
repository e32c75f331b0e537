"""Is the residual add cheaper inside the GEMM than inside the next LayerNorm? A probe, not a family.

    python3 -m benchmarks.residual_probe            # H200: ~20 s

ModernBERT adds each block's output to the residual in the next norm (`ops.add_layer_norm`: reads
the output and the residual, writes the new residual and the normalised rows: 4 x T x D). The
alternative lets cuBLAS add it in the GEMM's epilogue (`residual.addmm_(x, W^T)`: beta = 1, one more
read of T x D inside a GEMM that is partly bandwidth-bound at D = 768) and leaves the norm a plain
LayerNorm (2 x T x D). At 65,536 tokens, bf16, for the attention output (768 -> 768) and the MLP
output (1152 -> 768) projections: queued-call device ms of (a) F.linear + Triton add_layer_norm,
(b) addmm_ + Triton layer_norm, and each one's max error against fp32 (the GEMM's sum rounds once in
(b), twice in (a): HF's rounding is (a)'s). Prints a table and one JSON line per row.

Shapes: T tokens, D hidden, K the projection's input width.
"""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F

from benchmarks import common

T, D, BF16 = 65536, 768, torch.bfloat16


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    from packedenc.kernels import get_ops

    ops = get_ops("triton", "cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    w_ln, b_ln = torch.ones(D, device="cuda", dtype=BF16), None
    rows = []
    for name, K in (("attn-out 768->768", 768), ("mlp-out 1152->768", 1152)):
        x = torch.randn(T, K, device="cuda", generator=g).to(BF16)
        W = (torch.randn(D, K, device="cuda", generator=g) * K**-0.5).to(BF16)
        r0 = torch.randn(T, D, device="cuda", generator=g).to(BF16)
        r = r0.clone()

        def split():
            a = F.linear(x, W)
            return ops.add_layer_norm(a, r, w_ln, b_ln, 1e-5)

        def fused():
            r.copy_(r0)  # timed in both columns below: subtract `copy`
            r.addmm_(x, W.t())
            return ops.layer_norm(r, w_ln, b_ln, 1e-5)

        copy_ms = common.median_ms(lambda: r.copy_(r0), reps=7, warmup=3, calls=20)
        gemm_ms = common.median_ms(lambda: F.linear(x, W), reps=7, warmup=3, calls=20)
        addmm_ms = common.median_ms(lambda: r.addmm_(x, W.t()), reps=7, warmup=3, calls=20)
        split_ms = common.median_ms(split, reps=7, warmup=3, calls=20)
        fused_ms = common.median_ms(fused, reps=7, warmup=3, calls=20) - copy_ms
        ref_sum = r0.float() + x.float() @ W.float().t()
        ref = F.layer_norm(ref_sum, (D,), w_ln.float(), None, 1e-5)
        r.copy_(r0)
        h_split, s_split = split()
        r.copy_(r0)
        h_fused = fused()
        row = dict(probe="residual", projection=name, tokens=T, gemm_ms=gemm_ms, addmm_ms=addmm_ms,
                   split_ms=split_ms, fused_ms=fused_ms, saved_ms=split_ms - fused_ms,
                   err_split=(h_split.float() - ref).abs().max().item(),
                   err_fused=(h_fused.float() - ref).abs().max().item(),
                   err_sum_split=(s_split.float() - ref_sum).abs().max().item(),
                   err_sum_fused=(r.float() - ref_sum).abs().max().item(),
                   gpu=torch.cuda.get_device_name())
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n{'projection':20s} {'gemm':>7s} {'addmm':>7s} {'split':>7s} {'fused':>7s} {'saved':>7s}  err split/fused")
    for r_ in rows:
        print(f"{r_['projection']:20s} {r_['gemm_ms']:7.3f} {r_['addmm_ms']:7.3f} {r_['split_ms']:7.3f} "
              f"{r_['fused_ms']:7.3f} {r_['saved_ms']:7.3f}  {r_['err_split']:.2e}/{r_['err_fused']:.2e}")
    per_layer = sum(r_["saved_ms"] for r_ in rows)
    print(f"saved per ModernBERT-base layer at {T} tokens: {per_layer:.3f} ms (x 22 layers: {22 * per_layer:.2f} ms)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
