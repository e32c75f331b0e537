"""Contrastive fine-tuning (InfoNCE, in-batch negatives) on packed queries and documents.

Synthetic task: a document contains its query's tokens among noise, so a mean-pooled encoder can
learn to match them. Run: python examples/finetune_contrastive.py [--model tiny|FOLDER] [--steps N]
Data parallel, unchanged: torchrun --nproc_per_node 2 examples/finetune_contrastive.py --steps 10
(each rank takes its share of every batch; the step all-reduces the gradients; rank 0 prints and saves).
"""

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file (python / torchrun examples/...py): make `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

import packedenc as pe
from examples._train_common import (compute_dtype, distributed_device, load_model, mean_over_ranks, parse_args,
                                    random_sequences, report, save_and_check, train_step)
from packedenc.cudagraphs import Pad
from packedenc.train import distributed as pdist
from packedenc.train.losses import info_nce


def make_batch(n: int, vocab: int, g: torch.Generator, device: str):
    queries = random_sequences(n, 3, 8, vocab, g)
    docs = []
    for q in queries:
        noise = random_sequences(1, 10, 40, vocab, g)[0][1:-1]
        cut = int(torch.randint(0, len(noise) + 1, (1,), generator=g))
        docs.append([1, *noise[:cut], *q[1:-1], *noise[cut:], 2])
    mine = pdist.rank_range(n)  # every rank draws the same global batch and keeps its share
    q, d = pe.pack([queries[i] for i in mine], device=device), pe.pack([docs[i] for i in mine], device=device)
    ones = torch.ones(q.num_seqs, device=device)  # real pairs; a padded batch's dummy sequences get 0
    return {"q": q, "d": d, "q_real": ones, "d_real": ones}


def contrastive_loss(params, batch):
    q, d = batch["q"], batch["d"]  # params: bf16 casts of the master weights on a GPU (the step casts)
    hq = pe.encode(params, q.ids, q.cu_seqlens, q.max_seqlen)
    hd = pe.encode(params, d.ids, d.cu_seqlens, d.max_seqlen)
    return info_nce(pe.pool_mean(hq, q.cu_seqlens), pe.pool_mean(hd, d.cu_seqlens), temperature=0.05,
                    q_valid=batch["q_real"], p_valid=batch["d_real"])


def main() -> None:
    args = parse_args(__doc__)
    args.device = distributed_device(args.device)
    params = load_model(args.model, args.device)
    dt = compute_dtype(args.device)
    step = train_step(contrastive_loss, params, args.lr, compute_dtype=dt,
                      pad={"q_real": Pad("q.seqs", 0), "d_real": Pad("d.seqs", 0)})
    g = torch.Generator().manual_seed(args.seed)
    vocab = params.config.vocab_size
    losses = []
    for i in range(args.steps):
        loss = step(make_batch(32, vocab, g, args.device))
        losses.append(mean_over_ranks(loss))
        if pdist.rank() == 0 and (i % 10 == 0 or i == args.steps - 1):
            print(f"step {i:4d}  loss {losses[-1]:.4f}")
    if pdist.rank() == 0:
        report(losses)
        save_and_check(step.state.params, args.out)


if __name__ == "__main__":
    main()
    pdist.finish()
