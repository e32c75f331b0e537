"""Masked-language-model training on packed tokens; the MLM head runs only on masked positions.

Synthetic language: each sequence repeats a short random motif, so masked tokens are predictable
from context. Run: python examples/mlm.py [--model tiny|FOLDER] [--steps N]
"""

import torch

import packedenc as pe
from examples._train_common import compute_dtype, load_model, parse_args, report, save_and_check, train_step
from packedenc.cudagraphs import Pad
from packedenc.train.losses import mask_tokens, mlm_loss


def make_batch(n: int, vocab: int, mask_id: int, g: torch.Generator, device: str) -> dict:
    seqs = []
    for _ in range(n):
        motif = torch.randint(3, vocab, (int(torch.randint(2, 5, (1,), generator=g)),), generator=g)
        reps = int(torch.randint(3, 12, (1,), generator=g))
        seqs.append([1, *motif.repeat(reps).tolist(), 2])
    b = pe.pack(seqs)
    ids, pos, tgt = mask_tokens(b.ids, mask_token_id=mask_id, vocab_size=vocab, special_ids=torch.tensor([0, 1, 2]),
                                prob=0.3, generator=g)
    text = pe.Packed(ids, b.cu_seqlens, b.positions, b.max_seqlen).to(device)
    return {"text": text, "pos": pos.to(device), "tgt": tgt.to(device)}


def main() -> None:
    args = parse_args(__doc__)
    params = load_model(args.model, args.device, heads=("mlm",))
    cfg, dt = params.config, compute_dtype(args.device)
    # ModernBERT's tokenizer has [MASK] = 50284; a smaller vocab (the tiny model, a random test
    # checkpoint) uses its last id, which the synthetic tokens never take
    mask_id = 50284 if cfg.vocab_size > 50284 else cfg.vocab_size - 1

    def loss_fn(p, batch):
        t = batch["text"]  # p: the bf16 casts of the fp32 master weights on a GPU (the step's compute_dtype)
        return mlm_loss(p, pe.encode(p, t.ids, t.cu_seqlens, t.max_seqlen), batch["pos"], batch["tgt"])

    # masked positions are a free axis, padded with position 0 and an ignored target
    step = train_step(loss_fn, params, args.lr, compute_dtype=dt, pad={"pos": Pad("masked", 0), "tgt": Pad("masked", -100)})
    g = torch.Generator().manual_seed(args.seed)
    losses = []
    for i in range(args.steps):
        losses.append(step(make_batch(32, cfg.vocab_size - 1, mask_id, g, args.device)))
        if i % 10 == 0 or i == args.steps - 1:
            print(f"step {i:4d}  loss {losses[-1].item():.4f}")
    report(losses)
    save_and_check(step.state.params, args.out)


if __name__ == "__main__":
    main()
