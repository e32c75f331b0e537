"""The README's Python examples run (on the CPU, with a tiny random ModernBERT and synthetic data)."""

import re
from pathlib import Path

import torch

import packedenc as pe
from packedenc.models import modernbert
from packedenc.train.losses import classification_loss

README = Path(__file__).resolve().parents[1] / "README.md"
TINY = modernbert.ModernBertConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, local_attention=8, pad_token_id=0,
                                   id2label=((0, "a"), (1, "b")))


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_the_training_step_example_trains():
    (code,) = [b for b in _blocks() if "graphed_step" in b]
    g = torch.Generator().manual_seed(0)
    params = pe.init(TINY, g, heads=("classifier",))
    batches = []
    for _ in range(12):
        seqs = [torch.randint(3, 60, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
                for _ in range(6)]
        labels = torch.tensor([int(7 in s) for s in seqs])
        batches.append({"text": pe.pack(seqs), "labels": labels})
    ns = {"pe": pe, "torch": torch, "modernbert": modernbert, "classification_loss": classification_loss,
          "params": params, "batches": batches * 3}
    exec(compile(code, str(README), "exec"), ns)
    loss, jstep = ns["loss"], ns["jstep"]
    assert loss.dim() == 0 and torch.isfinite(loss)
    assert jstep.state.opt.step.item() == 36  # one AdamW step per batch
    first = ns["step"].loss_fn(params, batches[0])  # `params` is the donated, trained tree now
    assert torch.isfinite(first)
