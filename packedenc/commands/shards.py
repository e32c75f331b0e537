"""`packedenc embed --out-dir DIR` (sharded, resumable, torchrun-aware) and `packedenc merge DIR OUT.npy`.

    torchrun --nproc_per_node 8 -m packedenc.cli embed -m MODEL -i corpus.txt --out-dir shards/
    packedenc merge shards/ vectors.npy            # or pass -o vectors.npy to the embed command

"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any, Callable

from packedenc.commands import inputs
from packedenc.commands.errors import OutputError, UsageError

SHARDS_HELP = ("write the vectors as resumable shards in DIR (a rerun skips finished shards); under torchrun every "
               "process embeds its share: torchrun --nproc_per_node N -m packedenc.cli embed ... --out-dir DIR. "
               "Combine with -o FILE.npy to merge at the end, or run `packedenc merge DIR FILE.npy`")


def add_embed_arguments(e: argparse.ArgumentParser) -> None:
    g = e.add_argument_group("sharded output")
    g.add_argument("--out-dir", metavar="DIR", help=SHARDS_HELP)
    g.add_argument("--shard-size", type=int, default=16384, help="texts per shard with --out-dir (default 16384)")


def add_merge_parser(sub: Any, func: Callable[[argparse.Namespace], int]) -> None:
    m = sub.add_parser("merge", help="join the shards of `embed --out-dir` into one .npy, in input order",
                       description="Check that every shard of a sharded embedding job is present and intact, and "
                                   "write all vectors as one float32 (N, D) .npy, row i for input text i.")
    m.add_argument("dir", metavar="DIR", help="the --out-dir of the embed job")
    m.add_argument("output", metavar="OUT.npy", help="where to write the vectors (atomically)")
    m.set_defaults(func=func)


def embed_sharded(args: argparse.Namespace, texts: list[str]) -> int:
    """The body of `packedenc embed --out-dir`; every rank runs it, rank 0 reports."""
    from packedenc.train import distributed as pdist
    from packedenc.text.sharded import embed_to_dir

    if args.query or args.colbert_query:
        raise UsageError("--query / --colbert-query do not combine with --out-dir")
    if args.output is not None and not args.output.endswith(".npy"):
        raise UsageError(f"-o {args.output}: with --out-dir the merged vectors are a .npy file")
    inputs.check_output(args.output)
    path = inputs.model_path(args.model)
    name = "all-MiniLM-L6-v2 (bundled)" if path == inputs.bundled() else args.model
    normalize = {"on": True, "off": False, None: None}[args.normalize]
    t0 = time.perf_counter()
    try:
        run = embed_to_dir(path, texts, args.out_dir, shard_size=args.shard_size, max_tokens=args.max_tokens,
                           pooling=args.pooling, normalize=normalize, prompt=args.prompt, max_length=args.max_length,
                           truncate=not args.no_truncate, device=inputs.device(args.device), dtype=inputs.dtype(args.dtype),
                           progress=not args.no_progress)
        dt = time.perf_counter() - t0
        if pdist.rank() != 0:
            return 0
        print(f"embedded {len(texts)} texts with {name} into {args.out_dir}: {run.shards} shard(s), "
              f"{run.done_before} already done, {run.todo} computed by {pdist.world_size()} process(es) in {dt:.2f}s")
        if args.output:
            _merge(args.out_dir, args.output)
        return 0
    finally:
        if pdist.is_initialized():
            import torch.distributed as dist

            dist.destroy_process_group()


def cmd_merge(args: argparse.Namespace) -> int:
    if not args.output.endswith(".npy"):
        raise UsageError(f"output {args.output}: use a .npy file")
    inputs.check_output(args.output)
    if not Path(args.dir).is_dir():
        raise UsageError(f"{args.dir} is not a folder: pass the --out-dir of a `packedenc embed` job")
    _merge(args.dir, args.output)
    return 0


def _merge(out_dir: str, output: str) -> None:
    from packedenc.text.sharded import merge

    try:
        arr = merge(out_dir, output)
    except OSError as e:
        raise OutputError(f"cannot write {output}: {e.strerror or e}") from None
    print(f"merged {arr.shape[0]} x {arr.shape[1]} from {out_dir} -> {output}")
