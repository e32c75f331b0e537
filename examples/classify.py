"""Sequence-classification fine-tuning on packed batches (cls pooling -> head -> classifier).

Synthetic task: the label is 1 when the sequence contains token 7. Run:
python examples/classify.py [--model tiny|FOLDER] [--steps N]
"""

import torch

import packedenc as pe
from examples._train_common import (compute_dtype, load_model, parse_args, random_sequences, report, save_and_check,
                                    train_step)
from packedenc.cudagraphs import Pad
from packedenc.models import modernbert
from packedenc.train.losses import classification_loss


def make_batch(n: int, vocab: int, g: torch.Generator, device: str) -> dict:
    seqs = random_sequences(n, 4, 30, vocab, g)
    labels = torch.randint(0, 2, (n,), generator=g)
    for s, y in zip(seqs, labels.tolist()):
        s[1:-1] = [t if t != 7 else 8 for t in s[1:-1]]
        if y:
            s[int(torch.randint(1, len(s) - 1, (1,), generator=g))] = 7
    return {"text": pe.pack(seqs, device=device), "labels": labels.to(device)}


def main() -> None:
    args = parse_args(__doc__)
    params = load_model(args.model, args.device, heads=("classifier",), num_labels=2)
    dt = compute_dtype(args.device)

    def loss_fn(p, batch):
        t = batch["text"]  # p: the bf16 casts of the fp32 master weights on a GPU (the step's compute_dtype)
        h = pe.encode(p, t.ids, t.cu_seqlens, t.max_seqlen)
        return classification_loss(modernbert.classify(p, h, t.cu_seqlens), batch["labels"])

    # dummy sequences of a padded batch get label -100: cross-entropy ignores them
    step = train_step(loss_fn, params, args.lr, compute_dtype=dt, pad={"labels": Pad("text.seqs", -100)})
    g = torch.Generator().manual_seed(args.seed)
    losses = []
    for i in range(args.steps):
        losses.append(step(make_batch(32, params.config.vocab_size, g, args.device)))
        if i % 10 == 0 or i == args.steps - 1:
            print(f"step {i:4d}  loss {losses[-1].item():.4f}")
    report(losses)
    save_and_check(step.state.params, args.out)


if __name__ == "__main__":
    main()
