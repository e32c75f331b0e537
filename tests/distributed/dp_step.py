"""One data-parallel training step (run under torchrun, or alone for the single-process reference).

Usage: dp_step.py OUT_FILE {ddp|fsdp|single}. Writes the updated params (rank 0) to OUT_FILE.
"""

import sys

import torch
import torch.utils._pytree as pytree

import packedenc as pe
from packedenc.train import distributed as pdist
from packedenc.train.losses import classification_loss
from packedenc.models import modernbert

CFG = modernbert.ModernBertConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                  num_attention_heads=4, local_attention=4, id2label=((0, "a"), (1, "b"), (2, "c")))


def data():
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, 64, (int(n),), generator=g).tolist() for n in torch.randint(1, 20, (8,), generator=g)]
    return seqs, torch.randint(0, 3, (8,), generator=g)


def loss_fn(params, batch, labels):
    h = pe.encode(params, batch.ids, batch.cu_seqlens, batch.max_seqlen)
    return classification_loss(modernbert.classify(params, h, batch.cu_seqlens), labels)


def step(mode):
    """One SGD step; returns the updated leaves. The DDP / FSDP objects die when this returns,
    before the process group is destroyed (a DDP reducer outliving its gloo group can hang)."""
    params = pe.init(CFG, torch.Generator().manual_seed(0), heads=("classifier",))
    seqs, labels = data()
    mine = range(len(seqs)) if mode == "single" else pdist.rank_range(len(seqs))
    batch = pe.pack([seqs[i] for i in mine])
    model = pdist.wrap(params, fsdp=(mode == "fsdp"))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    loss = model(loss_fn, batch, labels[list(mine)])
    loss.backward()
    opt.step()
    leaves = pytree.tree_leaves(pdist.unwrap(model))
    return [(t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone() for t in leaves]


def main(out, mode):
    import faulthandler

    faulthandler.dump_traceback_later(120, exit=True)  # a hang prints its stack instead of idling
    pdist.init()
    leaves = step(mode)
    if pdist.rank() == 0:
        torch.save(leaves, out)
    if pdist.is_initialized():
        torch.distributed.barrier()
    pdist.finish()  # collects the FSDP2 / DDP objects before the group goes
    faulthandler.cancel_dump_traceback_later()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
