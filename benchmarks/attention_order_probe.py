"""Does the attention kernels' program order matter? Heads fastest (grid (H, blocks), the default:
the H programs of one row block run side by side, so the rows they read, one head's K elements
each, are fetched together) vs blocks fastest (grid (blocks, H)).

    PYTHONPATH=. python -m benchmarks.attention_order_probe --out DIR     # H100 / H200: ~1 min

bf16, H=12, K=64, the attention family's workloads; each pass (forward without LSE, the backward's
two passes together) at its default tile, timed in both orders alternately (four rounds each,
CUDA events around 10 queued calls: device time, host ahead), after a bitwise check that both
orders give the same output and gradients. Writes DIR/attention_order_<gpu>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from benchmarks import attention as AB
from benchmarks import common, records


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=4)
    a = ap.parse_args(argv)
    from packedenc.kernels.triton import attention as A
    from packedenc.kernels.triton.attention_bwd import attention_bwd

    gpu = torch.cuda.get_device_name()
    meta = {"gpu": gpu, "commit": AB.commit(), "torch": torch.__version__,
            "command": " ".join(["python -m benchmarks.attention_order_probe", *(argv if argv is not None else sys.argv[1:])])}
    print(f"# {meta['command']} on {gpu}, commit {meta['commit']}", flush=True)
    rows = []
    names = [f"{w}{s}" for w in AB.WORKLOADS for s in ("", "-window")]
    for wl in names:
        q, k, v, do, cu, L, window, scale = AB.probe_case(wl)
        T, n_seqs = q.shape[0], cu.numel() - 1
        o, lse = A.attention_fwd(q, k, v, cu, L, window, scale, lse=True)
        blocks, heads = ((*A.attention_fwd(q, k, v, cu, L, window, scale, lse=True, head_major=hm),
                          attention_bwd(do, q, k, v, o, lse, cu, L, window, scale, head_major=hm))
                         for hm in (False, True))
        same = all(bool(torch.equal(a, b)) for a, b in zip(blocks, heads))  # out, LSE, gradients
        fns = {
            "fwd": lambda hm: A.attention_fwd(q, k, v, cu, L, window, scale, lse=False, head_major=hm),
            "bwd": lambda hm: attention_bwd(do, q, k, v, o, lse, cu, L, window, scale, head_major=hm),
        }
        for p, fn in fns.items():
            ms = {False: [], True: []}
            for _ in range(a.rounds):
                for hm in (False, True):
                    ms[hm].append(common.median_ms(lambda: fn(hm), reps=7, warmup=2, calls=10))
            rec = {"workload": wl, "pass": p, "tokens": T, "sequences": n_seqs, "bitwise_same": same,
                   "blocks_fastest_ms": statistics.median(ms[False]), "heads_fastest_ms": statistics.median(ms[True]),
                   "rounds_blocks_fastest": ms[False], "rounds_heads_fastest": ms[True], **meta}
            rows.append(rec)
            print(f"{wl:18s} {p:4s} blocks-fastest {rec['blocks_fastest_ms']:7.3f}  heads-fastest "
                  f"{rec['heads_fastest_ms']:7.3f} ms  ({rec['heads_fastest_ms'] / rec['blocks_fastest_ms']:.3f}x)"
                  f"  same={same}", flush=True)
    records.replace_text(Path(a.out) / f"attention_order_{records.gpu_slug(gpu)}.json", json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
