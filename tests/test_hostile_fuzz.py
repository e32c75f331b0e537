"""Fuzzing `encode` (issue 23): random cu_seqlens / ids / positions give the reference's answer or a
packedenc error, never anything else."""

import random

import pytest
import torch

import packedenc as pe
from packedenc.models import bert, modernbert

BERT = pe.init(bert.PRESETS["tiny"], torch.Generator().manual_seed(0))  # vocab 128, 64 positions
MODERNBERT = modernbert.init(modernbert.ModernBertConfig(
    vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
    local_attention=4), torch.Generator().manual_seed(1))


# ---- fuzz: random inputs give the reference's answer or a packedenc error -----------------------


def _valid(params, ids, cu, max_seqlen, positions, limit):
    """An oracle written independently of packedenc's checks: are these inputs a valid call?"""
    vocab = params.config.vocab_size
    if not (isinstance(ids, torch.Tensor) and ids.dtype in (torch.int32, torch.int64) and ids.dim() == 1
            and ids.numel() > 0 and int(ids.min()) >= 0 and int(ids.max()) < vocab):
        return False
    if not (isinstance(cu, torch.Tensor) and cu.dtype in (torch.int32, torch.int64) and cu.dim() == 1
            and cu.numel() >= 2):
        return False
    c = cu.tolist()
    if c[0] != 0 or c[-1] != ids.numel() or any(b <= a for a, b in zip(c, c[1:])):
        return False
    longest = max(b - a for a, b in zip(c, c[1:]))
    if max_seqlen is not None and (type(max_seqlen) is not int or max_seqlen < longest):
        return False
    if (max_seqlen or longest) > (limit or 10**9):
        return False
    if positions is not None:
        if not (isinstance(positions, torch.Tensor) and positions.dtype in (torch.int32, torch.int64)
                and positions.shape == ids.shape and int(positions.min()) >= 0
                and (limit is None or int(positions.max()) < limit)):
            return False
    return True


def _random_call(rng, vocab, limit):
    n = rng.randint(1, 5)
    lengths = [rng.randint(1, 9) for _ in range(n)]
    T = sum(lengths)
    ids = torch.randint(0, vocab, (T,))
    cu = torch.tensor([0] + [sum(lengths[: i + 1]) for i in range(n)], dtype=torch.int32)
    positions = torch.cat([torch.arange(x) for x in lengths]) if rng.random() < 0.3 else None
    max_seqlen = max(lengths) + rng.choice([0, 0, 3]) if rng.random() < 0.5 else None
    for _ in range(rng.choice([0, 0, 1, 1, 2])):  # mutations that a hostile caller might make
        what = rng.randrange(9)
        if what == 0 and ids.numel():
            ids = ids.clone().view(-1)
            ids[rng.randrange(ids.numel())] = rng.choice([-1, vocab, vocab + 50])
        elif what == 1:
            ids = ids.to(rng.choice([torch.int16, torch.float32, torch.int32, torch.uint8]))
        elif what == 2:
            cu = cu.clone()
            cu[rng.randrange(cu.numel())] += rng.choice([-2, -1, 1, 2])
        elif what == 3:
            cu = cu.to(rng.choice([torch.int64, torch.float32, torch.int16]))
        elif what == 4:
            cu = cu[: rng.randint(0, cu.numel())]
        elif what == 5:
            positions = torch.randint(-2, (limit or 100) + 3, (T + rng.choice([0, 0, 1]),))
        elif what == 6:
            max_seqlen = rng.choice([0, 1, -3, 2.0, max(lengths) - 1, 10**6])
        elif what == 7:
            ids = ids[: rng.randint(0, T)]
        else:
            ids = ids.view(1, -1) if ids.numel() else ids
    return ids, cu, max_seqlen, positions


def _reference(params, ids, cu, positions):
    """Each sequence encoded on its own: what a packed call must return on its tokens."""
    c = cu.tolist()
    parts = []
    for a, b in zip(c, c[1:]):
        pos = None if positions is None else positions[a:b]
        parts.append(pe.encode(params, ids[a:b], torch.tensor([0, b - a], dtype=torch.int32), positions=pos,
                               backend="reference"))
    return torch.cat(parts)


@pytest.fixture
def one_thread():
    """Tiny ops: one thread is faster than a pool that the other CPU users keep busy."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("params,limit", [(BERT, 64), (MODERNBERT, None)], ids=["bert", "modernbert"])
def test_fuzz_encode_gives_the_reference_or_a_packedenc_error(params, limit, one_thread):
    rng = random.Random(23)
    outcomes = {"answer": 0, "error": 0}
    for case in range(300):
        ids, cu, max_seqlen, positions = _random_call(rng, params.config.vocab_size, limit)
        valid = _valid(params, ids, cu, max_seqlen, positions, limit)
        where = f"case {case}: ids={ids.tolist()} {ids.dtype} cu={cu.tolist()} {cu.dtype} max_seqlen={max_seqlen!r} " \
                f"positions={None if positions is None else positions.tolist()}"
        try:
            out = pe.encode(params, ids, cu, max_seqlen, positions, backend="reference")
        except pe.PackedEncError as e:
            assert not valid, f"{where}: valid input refused: {e}"
            outcomes["error"] += 1
            continue
        assert valid, f"{where}: invalid input returned an answer (silent)"
        torch.testing.assert_close(out, _reference(params, ids, cu, positions), atol=1e-5, rtol=1e-5, msg=where)
        outcomes["answer"] += 1
    assert outcomes["answer"] >= 40 and outcomes["error"] >= 40, outcomes  # both sides were exercised
