"""The measured work of the `distributed` family, one process per GPU (torchrun, or alone for 1 GPU).

    embed: the ModernBERT `doc` workload x8 (8 seeded draws, 8192 sequences). Each rank takes its
        `rank_range` share of the sequences, sorts it longest first and cuts it into token-budget
        packs (as `packedenc.embed` does after tokenizing), then per pack: encode (bf16), mean
        pool, copy the embeddings to the host. Strong scaling: the same corpus on 1 and N GPUs.
    train: a ModernBERT-base MLM step (30% masked, head on masked rows only) on one pack of about
        64k tokens per GPU: forward + backward + AdamW, fp32 master weights, bf16 compute, DDP
        (`packedenc.train.distributed.wrap`) when N > 1, the plain module on 1 GPU. Weak scaling.

Time of a repetition = the slowest rank's time from a common start (barrier) to its last
synchronised result; tokens are real tokens summed over ranks. Rank 0 writes a JSON result.

Shapes: T packed tokens, S sequences, D hidden.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import statistics
import time
from typing import Any, Callable

import torch

import packedenc as pe
from benchmarks import common
from benchmarks.records import gpu_name
from packedenc.train import distributed as pdist

TRAIN_MASK_ID = 50284  # ModernBERT's [MASK] (tiny: the last id)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reduce(x: float, op: str) -> float:
    """SUM or MAX of a host number over ranks (a no-op alone)."""
    if not pdist.is_initialized():
        return x
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.distributed.get_backend() == "nccl" else "cpu"
    t = torch.tensor([x], dtype=torch.float64, device=dev)
    torch.distributed.all_reduce(t, op=getattr(torch.distributed.ReduceOp, op))
    return float(t.item())


def _barrier(device: torch.device) -> None:
    if pdist.is_initialized():
        _reduce(0.0, "SUM")  # a tiny all-reduce: a barrier that works the same on NCCL and gloo
    _sync(device)


def _timed(fn: Callable[[], int], device: torch.device) -> tuple[float, float]:
    """(seconds of the slowest rank, real tokens over all ranks) of one repetition."""
    _barrier(device)
    t0 = time.perf_counter()
    tokens = fn()
    _sync(device)
    dt = time.perf_counter() - t0
    return _reduce(dt, "MAX"), _reduce(float(tokens), "SUM")


def _peak_gb(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    return _reduce(torch.cuda.max_memory_reserved(device) / 2**30, "MAX")


def _config(tiny: bool) -> Any:
    from benchmarks.encode import MODERNBERT_TINY
    from packedenc.models import modernbert

    return modernbert.ModernBertConfig(**(MODERNBERT_TINY if tiny else {}))  # the defaults are ModernBERT-base


def _sequences(spec: common.WorkloadSpec, vocab: int, seeds: range) -> list[torch.Tensor]:
    """Every sequence of `spec` drawn with each seed, back to back (host int64 ids)."""
    out: list[torch.Tensor] = []
    for seed in seeds:
        w = common.make_workload(spec, vocab, seed)
        out += list(torch.split(w.tokens, w.lengths))
    return out


def _spec(tiny: bool) -> common.WorkloadSpec:
    from benchmarks.encode import TINY_SPECS

    return (TINY_SPECS if tiny else common.MODERNBERT_WORKLOADS)["doc"]


# ---- embed --------------------------------------------------------------------------------------


def run_embed(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    cfg = _config(args.tiny)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    params = pe.tree_to(pe.init(cfg, torch.Generator().manual_seed(0), dtype=dtype), device)
    seqs = _sequences(_spec(args.tiny), cfg.vocab_size, range(8))
    mine = sorted(pdist.rank_range(len(seqs)), key=lambda i: -seqs[i].numel())  # longest first, as embed
    budget = args.embed_budget
    packs = [pe.pack([seqs[mine[k]] for k in b], device=device)
             for b in pe.token_budget_batches([seqs[i].numel() for i in mine], budget)]

    def one_pass() -> int:
        n = 0
        with torch.inference_mode():
            for p in packs:
                h_TD = pe.encode(params, p.ids, p.cu_seqlens, p.max_seqlen)
                emb_SD = pe.pool_mean(h_TD, p.cu_seqlens).float().cpu()  # to the host, as embed does
                assert emb_SD.shape == (p.cu_seqlens.numel() - 1, cfg.hidden_size)
                n += p.ids.numel()
        return n

    t0 = time.perf_counter()
    one_pass()  # warm-up: every pack shape once (kernel compilation, autotuning)
    _sync(device)
    warm = time.perf_counter() - t0
    reps = [_timed(one_pass, device) for _ in range(args.reps)]
    return {"workload": f"doc-x8{'-tiny' if args.tiny else ''}", "tokens": reps[0][1],
            "seconds": [s for s, _ in reps], "tokens_per_s": statistics.median(t / s for s, t in reps),
            "peak_reserved_gb": _peak_gb(device), "warmup_s": warm, "sequences": len(seqs),
            "packs_per_rank": len(packs), "budget_tokens": budget}


# ---- train --------------------------------------------------------------------------------------


def _train_packs(cfg: Any, budget: int, n: int, tiny: bool, device: torch.device) -> list[tuple[Any, ...]]:
    """n packs of about `budget` tokens, masked on the host, staged on the device."""
    from packedenc.train.losses import mask_tokens

    spec = _spec(tiny)
    seqs: list[torch.Tensor] = []
    packs: list[list[int]] = []
    seed = 100  # other draws than the embed workload's
    while len(packs) < n:
        seqs = _sequences(spec, cfg.vocab_size - 1, range(100, seed + 1))
        packs = pe.token_budget_batches([s.numel() for s in seqs], budget)[:-1]  # the last one is partial
        seed += 1
    g = torch.Generator().manual_seed(0)
    mask_id = cfg.vocab_size - 1 if tiny else TRAIN_MASK_ID
    out = []
    for b in packs[:n]:
        p = pe.pack([seqs[i] for i in b])
        ids, pos, tgt = mask_tokens(p.ids, mask_token_id=mask_id, vocab_size=cfg.vocab_size - 1, prob=0.3,
                                    generator=g)
        out.append((ids.to(device), p.cu_seqlens.to(device), p.max_seqlen, pos.to(device), tgt.to(device),
                    p.ids.numel()))
    return out


def run_train(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    from packedenc.train.losses import mlm_loss

    cfg = _config(args.tiny)
    compute = None if device.type == "cpu" else torch.bfloat16
    params = pe.tree_to(pe.init(cfg, torch.Generator().manual_seed(0), heads=("mlm",)), device)  # fp32 master
    world, r = pdist.world_size(), pdist.rank()
    model = pdist.wrap(params, gradient_as_bucket_view=True) if world > 1 else pdist.ParamsModule(params)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=device.type == "cuda")
    steps = args.warmup_steps + args.reps * args.steps_per_rep
    all_packs = _train_packs(cfg, args.train_budget, steps * world, args.tiny, device)
    mine = all_packs[r::world]  # step i on rank r: pack i * world + r, so ranks never share data
    del all_packs

    def loss_fn(p: Any, ids: torch.Tensor, cu: torch.Tensor, max_seqlen: int, pos: torch.Tensor,
                tgt: torch.Tensor) -> torch.Tensor:
        # one differentiable cast of the fp32 master tree, shared by the encoder and the MLM head
        # (encode's compute_dtype would cast for the encoder only, leaving the head in fp32)
        pc = p if compute is None else pe.tree_cast(p, compute)
        return mlm_loss(pc, pe.encode(pc, ids, cu, max_seqlen), pos, tgt)

    step_i = [0]
    losses: list[torch.Tensor] = []

    def steps_fn(k: int) -> Callable[[], int]:
        def run() -> int:
            n = 0
            for _ in range(k):
                ids, cu, max_seqlen, pos, tgt, tokens = mine[step_i[0]]
                loss = model(loss_fn, ids, cu, max_seqlen, pos, tgt)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                losses.append(loss.detach())
                step_i[0] += 1
                n += tokens
            return n

        return run

    t0 = time.perf_counter()
    steps_fn(args.warmup_steps)()  # compilation, autotuning, DDP's first-step bucket rebuild
    _sync(device)
    warm = time.perf_counter() - t0
    reps = [_timed(steps_fn(args.steps_per_rep), device) for _ in range(args.reps)]
    last = float(losses[-1])
    if not torch.isfinite(torch.tensor(last)):
        raise RuntimeError(f"the training loss is not finite ({last})")
    # identical params on every rank after the steps (what DDP promises): one checksum per rank
    check = sum(float(t.detach().double().sum()) for t in model.parameters())
    in_sync = _reduce(check, "MAX") == -_reduce(-check, "MAX")
    return {"workload": f"mlm-{args.train_budget // 1024}k-per-gpu{'-tiny' if args.tiny else ''}",
            "tokens": reps[0][1], "seconds": [s for s, _ in reps],
            "tokens_per_s": statistics.median(t / s for s, t in reps), "peak_reserved_gb": _peak_gb(device),
            "warmup_s": warm, "steps_per_rep": args.steps_per_rep, "first_loss": float(losses[0]),
            "last_loss": last, "params_in_sync": in_sync, "budget_tokens": args.train_budget}


# ---- entry ---------------------------------------------------------------------------------------


def main(args: argparse.Namespace) -> int:
    faulthandler.dump_traceback_later(args.hang_s, exit=True)  # a hung collective prints its stack
    device = pdist.init("gloo" if args.device == "cpu" else None)
    if args.device == "cpu":
        device = torch.device("cpu")
    result: dict[str, Any] = {"system": args.system, "gpus": pdist.world_size(),
                              "gpu": gpu_name(device)}
    try:
        result.update(run_embed(args, device) if args.system == "embed" else run_train(args, device))
        result["status"] = "ok"
    except Exception as e:
        result.update(status="failed", error=f"{type(e).__name__}: {e}"[:300])
        if pdist.rank() == 0:
            _write(args.result, result)
        raise  # a failed rank ends the whole torchrun group instead of leaving others in a collective
    if pdist.rank() == 0:
        _write(args.result, result)
        print(f"[{args.system} x{result['gpus']}] {result['tokens_per_s'] / 1e3:,.0f}k tokens/s "
              f"(reps {', '.join(f'{s:.3f}s' for s in result['seconds'])}; warm-up {result['warmup_s']:.1f}s)",
              flush=True)
    pdist.finish()  # the DDP model first: one that outlives its process group can hang on exit
    return 0


def _write(path: str, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f)
