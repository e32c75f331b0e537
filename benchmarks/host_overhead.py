"""Where eager time goes for one ModernBERT-base batch: host enqueue time vs device time, and the
top host-side ops. `python -m benchmarks.host_overhead [--workload doc]` (CUDA only)."""

import argparse
import time

import torch

import packedenc as pe
from benchmarks import common
from benchmarks.encode import MODELS


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="doc")
    args = ap.parse_args()
    dev = torch.device("cuda")
    params = pe.tree_to(MODELS["modernbert-base"].make_params(torch.bfloat16), dev)
    cfg = params.config
    w = common.make_workload(common.MODERNBERT_WORKLOADS[args.workload], cfg.vocab_size)
    b = w.batch(0)
    packed = pe.pack(pe.unpack(b.ids, b.cu_seqlens), device=dev)
    run = lambda: pe.encode(params, packed.ids, packed.cu_seqlens, packed.max_seqlen, packed.positions)  # noqa: E731
    with torch.inference_mode():
        enq, tot = common.host_ms(run)
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            run()
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            run()
        g.replay()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            g.replay()
        torch.cuda.synchronize()
        dev_ms = (time.perf_counter() - t0) / 10 * 1e3
        print(f"{args.workload}: T={packed.num_tokens} S={packed.num_seqs} L={packed.max_seqlen}")
        print(f"eager: enqueue {enq:.2f} ms, enqueue+sync {tot:.2f} ms; graph replay {dev_ms:.2f} ms")
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
