"""Shared plumbing for the training examples: model choice, synthetic data, the training step, save + check.

`--model tiny` builds a 2-layer random ModernBERT on the fly (runs in seconds on a CPU); any other
value is a folder or hub id loaded with `packedenc.load` (e.g. a base-size model on a GPU).
Under torchrun, `distributed_device` joins the process group (one process per GPU, gloo for
`--device cpu`); alone, it changes nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile

import torch

import packedenc as pe
from packedenc.cudagraphs import graphed_step
from packedenc.models import modernbert
from packedenc.train import AdamW, TrainState, make_step
from packedenc.train import distributed as pdist

TINY = modernbert.ModernBertConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, local_attention=16, pad_token_id=0, cls_token_id=1,
                                   sep_token_id=2, bos_token_id=1, eos_token_id=2)


def parser(doc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc)
    p.add_argument("--model", default="tiny", help="'tiny' (random, CPU-friendly) or a folder / hub id")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--lr", type=float, default=None,
                   help="AdamW learning rate (default: 1e-3 for 'tiny', 2e-5 for a loaded checkpoint)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="where to save the fine-tuned model (default: a temp folder)")
    return p


def parse_args(doc: str) -> argparse.Namespace:
    """The examples' command line. A loaded (base-size, pretrained) model fine-tunes at 2e-5: the
    tiny model's 1e-3 made a random ModernBERT-base's contrastive loss go up (CPU, 30 steps)."""
    args = parser(doc).parse_args()
    if args.lr is None:
        args.lr = 1e-3 if args.model == "tiny" else 2e-5
    return args


def load_model(name: str, device: str, heads: tuple[str, ...] = (), num_labels: int = 0):
    """fp32 master weights on `device`; the forward runs in bf16 on CUDA (compute_dtype)."""
    if name == "tiny":
        params = pe.init(_with_labels(TINY, num_labels), torch.Generator().manual_seed(0), heads=heads)
    else:
        params = with_heads(pe.load(name, dtype=torch.float32), heads, num_labels)
    return pe.tree_to(params, device)


def _with_labels(cfg, num_labels: int):
    if not num_labels or cfg.num_labels == num_labels:
        return cfg
    return dataclasses.replace(cfg, id2label=tuple((i, f"LABEL_{i}") for i in range(num_labels)))


def with_heads(params, heads: tuple[str, ...], num_labels: int = 0):
    """A loaded checkpoint with the task heads the example needs. Pieces the checkpoint lacks (a bare
    encoder has no MLM decoder or classifier; a classifier of another label count does not fit)
    are freshly initialised, as transformers' `from_pretrained` does for a task class; every piece
    the checkpoint has is kept."""
    cfg = _with_labels(params.config, num_labels)
    fits = {"mlm": params.decoder is not None,
            "classifier": params.classifier is not None and cfg is params.config}
    if all(fits[h] for h in heads):
        return params
    fresh = pe.init(cfg, torch.Generator().manual_seed(0), heads=tuple(heads))
    keep = {"embeddings": params.embeddings, "layers": params.layers, "final_norm": params.final_norm}
    if params.head is not None:
        keep["head"] = params.head
    if fits["mlm"]:
        keep["decoder"] = params.decoder
    if fits["classifier"]:
        keep["classifier"] = params.classifier
    return dataclasses.replace(fresh, **keep)


def compute_dtype(device: str) -> torch.dtype | None:
    return torch.bfloat16 if device.startswith("cuda") else None


def train_step(loss_fn, params, lr: float, *, compute_dtype=None, pad=None, max_tokens: int = 4096,
               max_seqs: int = 64):
    """The training step: AdamW (weight decay 0.01) on fp32 master weights, the loss on their casts to
    `compute_dtype` (bf16 on a GPU: `compute_dtype(device)`), replayed as CUDA graphs on a
    GPU (`graphed_step`: one graph per padded bucket; batches over the budget run eagerly), the same
    padded phases run eagerly on a CPU. The params tree is donated: read it back from `.state.params`.
    Under torchrun the gradients are averaged over the ranks inside the step."""
    step = make_step(loss_fn, AdamW(lr=lr, weight_decay=0.01), compute_dtype=compute_dtype)
    return graphed_step(step, TrainState.create(params, step.optimizer), max_tokens=max_tokens, max_seqs=max_seqs,
                        pad=pad)


def random_sequences(n: int, lo: int, hi: int, vocab: int, g: torch.Generator) -> list[list[int]]:
    """CLS + random body + SEP, lengths uniform in [lo, hi]; ids 3.. avoid the special tokens."""
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [[1, *torch.randint(3, vocab, (k,), generator=g).tolist(), 2] for k in lens]


def save_and_check(params, out: str | None) -> str:
    """Save with packedenc.save, then load the folder in transformers when it is installed."""
    folder = out or tempfile.mkdtemp(prefix="packedenc-finetuned-")
    pe.save(torch.utils._pytree.tree_map(lambda t: t.detach().cpu(), params), folder)
    try:
        import transformers
    except ImportError:
        print(f"saved to {folder} (transformers not installed: load check skipped)")
        return folder
    import json
    import os

    arch = json.load(open(os.path.join(folder, "config.json")))["architectures"][0]
    model = getattr(transformers, arch).from_pretrained(folder)  # the task class, heads included
    print(f"saved to {folder}; transformers loads it as {type(model).__name__}")
    return folder


def distributed_device(device: str) -> str:
    """Under torchrun: join the process group and return this rank's device ("cuda" becomes
    cuda:LOCAL_RANK; "cpu" uses gloo). Alone: `device` as given, no process group."""
    if "WORLD_SIZE" not in os.environ:
        return device
    dev = pdist.init("gloo" if device == "cpu" else None)
    if pdist.rank() == 0:
        print(f"data parallel over {pdist.world_size()} processes ({torch.distributed.get_backend()})")
    return device if device == "cpu" else str(dev)


def mean_over_ranks(x: torch.Tensor) -> float:
    """The mean of a scalar over all ranks (each rank's loss is over its own share of the batch)."""
    if not pdist.is_initialized():
        return x.item()
    x = x.detach().clone()
    torch.distributed.all_reduce(x)  # SUM: gloo has no AVG
    return x.item() / pdist.world_size()


def report(losses: list) -> None:
    """`losses`: the steps' losses (device scalars: read once, at the end, no sync per step)."""
    losses = torch.stack([torch.as_tensor(x, dtype=torch.float32).cpu() for x in losses]).tolist()
    k = max(1, len(losses) // 5)
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    print(f"loss: first {k} steps {first:.4f} -> last {k} steps {last:.4f}")
    if not last < first:
        raise SystemExit("loss did not go down")
