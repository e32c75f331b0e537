"""Contrastive fine-tuning (InfoNCE, in-batch negatives) on packed queries and documents.

Synthetic task: a document contains its query's tokens among noise, so a mean-pooled encoder can
learn to match them. Run: python examples/finetune_contrastive.py [--model tiny|FOLDER] [--steps N]
"""

import torch

import packedenc as pe
from examples._train_common import (compute_dtype, load_model, optimizer, parser, random_sequences, report,
                                    save_and_check, trainable)
from packedenc.losses import info_nce


def make_batch(n: int, vocab: int, g: torch.Generator, device: str):
    queries = random_sequences(n, 3, 8, vocab, g)
    docs = []
    for q in queries:
        noise = random_sequences(1, 10, 40, vocab, g)[0][1:-1]
        cut = int(torch.randint(0, len(noise) + 1, (1,), generator=g))
        docs.append([1, *noise[:cut], *q[1:-1], *noise[cut:], 2])
    return pe.pack(queries, device=device), pe.pack(docs, device=device)


def main() -> None:
    args = parser(__doc__).parse_args()
    params = trainable(load_model(args.model, args.device))
    opt = optimizer(params, args.lr)
    g = torch.Generator().manual_seed(args.seed)
    vocab, dt = params.config.vocab_size, compute_dtype(args.device)
    losses = []
    for step in range(args.steps):
        q, d = make_batch(32, vocab, g, args.device)
        hq = pe.encode(params, q.ids, q.cu_seqlens, q.max_seqlen, compute_dtype=dt)
        hd = pe.encode(params, d.ids, d.cu_seqlens, d.max_seqlen, compute_dtype=dt)
        loss = info_nce(pe.pool_mean(hq, q.cu_seqlens), pe.pool_mean(hd, d.cu_seqlens), temperature=0.05)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {losses[-1]:.4f}")
    report(losses)
    save_and_check(params, args.out)


if __name__ == "__main__":
    main()
