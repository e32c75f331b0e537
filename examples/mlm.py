"""Masked-language-model training on packed tokens; the MLM head runs only on masked positions.

Synthetic language: each sequence repeats a short random motif, so masked tokens are predictable
from context. Run: python examples/mlm.py [--model tiny|FOLDER] [--steps N]
"""

import torch

import packedenc as pe
from examples._train_common import compute_dtype, load_model, optimizer, parse_args, report, save_and_check, trainable
from packedenc.train.losses import mask_tokens, mlm_loss


def make_batch(n: int, vocab: int, g: torch.Generator, device: str):
    seqs = []
    for _ in range(n):
        motif = torch.randint(3, vocab, (int(torch.randint(2, 5, (1,), generator=g)),), generator=g)
        reps = int(torch.randint(3, 12, (1,), generator=g))
        seqs.append([1, *motif.repeat(reps).tolist(), 2])
    return pe.pack(seqs)


def main() -> None:
    args = parse_args(__doc__)
    params = trainable(load_model(args.model, args.device, heads=("mlm",)))
    opt = optimizer(params, args.lr)
    g = torch.Generator().manual_seed(args.seed)
    cfg, dt = params.config, compute_dtype(args.device)
    # ModernBERT's tokenizer has [MASK] = 50284; a smaller vocab (the tiny model, a random test
    # checkpoint) uses its last id, which the synthetic tokens never take
    mask_id = 50284 if cfg.vocab_size > 50284 else cfg.vocab_size - 1
    losses = []
    for step in range(args.steps):
        b = make_batch(32, cfg.vocab_size - 1, g, "cpu")
        ids, pos, tgt = mask_tokens(b.ids, mask_token_id=mask_id, vocab_size=cfg.vocab_size - 1,
                                    special_ids=torch.tensor([0, 1, 2]), prob=0.3, generator=g)
        dev = args.device
        p = pe.tree_cast(params, dt) if dt else params  # bf16 compute, fp32 master weights get the grads
        h = pe.encode(p, ids.to(dev), b.cu_seqlens.to(dev), b.max_seqlen)
        loss = mlm_loss(p, h, pos.to(dev), tgt.to(dev))
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
