"""Sequence-classification fine-tuning on packed batches (cls pooling -> head -> classifier).

Synthetic task: the label is 1 when the sequence contains token 7. Run:
python examples/classify.py [--model tiny|FOLDER] [--steps N]
"""

import torch

import packedenc as pe
from examples._train_common import (compute_dtype, load_model, optimizer, parse_args, random_sequences, report,
                                    save_and_check, trainable)
from packedenc.train.losses import classification_loss
from packedenc.models import modernbert


def make_batch(n: int, vocab: int, g: torch.Generator, device: str):
    seqs = random_sequences(n, 4, 30, vocab, g)
    labels = torch.randint(0, 2, (n,), generator=g)
    for s, y in zip(seqs, labels.tolist()):
        s[1:-1] = [t if t != 7 else 8 for t in s[1:-1]]
        if y:
            s[int(torch.randint(1, len(s) - 1, (1,), generator=g))] = 7
    return pe.pack(seqs, device=device), labels.to(device)


def main() -> None:
    args = parse_args(__doc__)
    params = trainable(load_model(args.model, args.device, heads=("classifier",), num_labels=2))
    opt = optimizer(params, args.lr)
    g = torch.Generator().manual_seed(args.seed)
    dt = compute_dtype(args.device)
    losses = []
    for step in range(args.steps):
        b, y = make_batch(32, params.config.vocab_size, g, args.device)
        p = pe.tree_cast(params, dt) if dt else params  # bf16 compute, fp32 master weights get the grads
        h = pe.encode(p, b.ids, b.cu_seqlens, b.max_seqlen)
        loss = classification_loss(modernbert.classify(p, h, b.cu_seqlens), y)
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
