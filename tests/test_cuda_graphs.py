"""CUDA-graphed encode (issue 3, item 3).

CPU: the bucket plan and the padded layout (the dummy tail sequences are valid varlen input and
never touch a real token), the LRU, the budget and config errors, and the same padded path run
eagerly (`capture=False`) against plain `encode`. GPU (`gpu` marker): graph replay against eager
encode on the same padded buffers (bitwise) and on the real batch (bf16 noise), bucket reuse,
eviction and recapture.
"""

import dataclasses
import functools

import pytest
import torch

import packedenc as pe
from packedenc.cudagraphs import (
    Bucket,
    default_seq_buckets,
    default_token_buckets,
    fill_padded,
    graphed,
    pad_batch,
    plan_bucket,
)
from packedenc.models import modernbert
from packedenc.packing import check_cu_seqlens, positions_from_cu_seqlens

CFG = modernbert.ModernBertConfig(vocab_size=50, hidden_size=16, intermediate_size=24, num_hidden_layers=3,
                                  num_attention_heads=2, local_attention=4)
PARAMS = pe.init(CFG, torch.Generator().manual_seed(0))


def ragged(lengths, vocab=50, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return pe.pack([torch.randint(1, vocab, (n,), generator=g) for n in lengths], device=device)


# ---- buckets and padding ------------------------------------------------------------------------


def test_default_token_buckets_are_aligned_increasing_and_waste_little():
    b = default_token_buckets(70_000)
    assert b[0] == 64 and b[-1] >= 70_000 and b[-2] < 70_000
    assert all(x % 64 == 0 for x in b) and all(x < y for x, y in zip(b, b[1:]))
    # past 1024 tokens a batch is padded by at most 1/16 of its size (64-token steps below)
    assert max(y / x for x, y in zip(b, b[1:]) if x >= 1024) <= 1.0625


def test_default_seq_buckets():
    assert default_seq_buckets(128) == (1, 2, 4, 8, 16, 32, 64, 128)
    assert default_seq_buckets(100) == (1, 2, 4, 8, 16, 32, 64, 100)
    assert default_seq_buckets(1) == (1,)


@pytest.mark.parametrize("T, S, L", [
    (1, 1, 1),          # smallest batch
    (3500, 128, 128),   # query traffic: S equals its bucket, one dummy slot
    (3500, 65, 128),    # S just past a power of two: 64 dummy slots need 64 tokens
    (200, 100, 2),      # many short sequences: dummies longer than any real one
    (8192, 256, 4096),  # the budget's corner
])
def test_plan_bucket_invariants(T, S, L):
    tb, sb = default_token_buckets(8192 + 256), default_seq_buckets(256)
    b = plan_bucket(T, S, L, token_buckets=tb, seq_buckets=sb)
    n_dummy = b.seqs + 1 - S
    assert b.seqs == min(x for x in sb if x >= S)
    assert b.tokens == min(x for x in tb if x >= T + n_dummy)  # each dummy gets >= 1 token
    assert b.max_seqlen >= max(L, -(-(b.tokens - T) // n_dummy)) and b.max_seqlen <= b.tokens
    assert b.max_seqlen & (b.max_seqlen - 1) == 0 or b.max_seqlen == b.tokens


@pytest.mark.parametrize("lengths", [[1], [3, 1, 7], [5] * 8, [1, 40, 2, 17, 9, 64, 3]])
@pytest.mark.parametrize("with_positions", [False, True])
def test_pad_batch_layout(lengths, with_positions):
    batch = ragged(lengths)
    T, S = batch.num_tokens, batch.num_seqs
    b = plan_bucket(T, S, batch.max_seqlen, token_buckets=(64, 128, 256), seq_buckets=(1, 4, 8, 16),
                    positions=with_positions)
    ids, cu, pos = pad_batch(batch.ids, batch.cu_seqlens, b, batch.positions if with_positions else None, pad_id=7)
    assert ids.shape == (b.tokens,) and cu.shape == (b.seqs + 2,) and cu.dtype == torch.int32
    check_cu_seqlens(cu, b.tokens)  # valid varlen input: starts at 0, no empty sequence, ends at T_b
    assert torch.equal(cu[: S + 1], batch.cu_seqlens)  # real boundaries untouched
    assert torch.equal(ids[:T], batch.ids) and bool((ids[T:] == 7).all())
    assert int((cu[1:] - cu[:-1]).max()) <= b.max_seqlen
    if with_positions:
        assert torch.equal(pos, positions_from_cu_seqlens(cu, b.tokens))
    else:
        assert pos is None


# ---- the padded path run eagerly (CPU) ----------------------------------------------------------


@pytest.mark.parametrize("lengths", [
    [1],                            # one token
    [3, 1, 7, 12],                  # S = 4 fills its bucket exactly: one dummy slot
    [9, 2, 30, 1, 5],               # S = 5 -> bucket 8: four dummy slots
    [4] * 16,                       # S at the budget
    [1, 1, 1, 60, 60, 60, 20, 40],  # near the token budget
])
@pytest.mark.parametrize("with_positions", [False, True])
def test_padded_path_matches_encode(lengths, with_positions):
    batch = ragged(lengths)
    g = graphed(PARAMS, max_tokens=256, max_seqs=16, capture=False)
    pos = batch.positions if with_positions else None
    out = g(batch.ids, batch.cu_seqlens, batch.max_seqlen, pos)
    ref = pe.encode(PARAMS, batch.ids, batch.cu_seqlens, batch.max_seqlen)
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_dummy_tokens_do_not_leak_into_real_ones():
    batch = ragged([9, 2, 30, 1, 5])
    a = graphed(PARAMS, max_tokens=256, max_seqs=16, capture=False, pad_id=0)
    b = graphed(PARAMS, max_tokens=256, max_seqs=16, capture=False, pad_id=33)
    # same bucket, same shapes: only the dummy ids differ, so real rows must be bitwise equal
    assert torch.equal(a(batch.ids, batch.cu_seqlens, batch.max_seqlen), b(batch.ids, batch.cu_seqlens, batch.max_seqlen))


@pytest.mark.parametrize("max_tokens, max_seqs", [(256, 16), (1000, 2), (300, 64)])
def test_budget_bucket_is_the_largest_batch_in_short_sequences(max_tokens, max_seqs):
    g = graphed(PARAMS, max_tokens=max_tokens, max_seqs=max_seqs, capture=False)
    b = g.budget_bucket()
    assert b.tokens == g.token_buckets[-1] >= max_tokens and b.seqs >= g.seq_buckets[-1]
    assert b.max_seqlen <= 128
    # a valid varlen batch of dummy sequences, each within max_seqlen, that the encode accepts
    entry = g._new_entry(b)
    fill_padded(b, torch.zeros(0, dtype=torch.int64), torch.zeros(1, dtype=torch.int32), None, entry.ids, entry.cu, None)
    lengths = entry.cu.diff()
    assert entry.cu[0] == 0 and entry.cu[-1] == b.tokens and lengths.min() >= 1 and lengths.max() <= b.max_seqlen
    g._run_budget_batch()


def test_bucket_reuse_refreshes_buffers():
    g = graphed(PARAMS, max_tokens=256, max_seqs=16, capture=False)
    x, y = ragged([5, 9, 3], seed=1), ragged([2, 11, 6], seed=2)  # same (T, S): same bucket
    ox = g(x.ids, x.cu_seqlens, x.max_seqlen)
    oy = g(y.ids, y.cu_seqlens, y.max_seqlen)
    assert g.num_graphs == 1
    torch.testing.assert_close(oy, pe.encode(PARAMS, y.ids, y.cu_seqlens), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ox, pe.encode(PARAMS, x.ids, x.cu_seqlens), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(ox[:3], oy[:3])  # the second call did not replay stale inputs


def test_buffers_made_in_inference_mode_still_work_outside_it():
    g = graphed(PARAMS, max_tokens=256, max_seqs=16, capture=False)
    x = ragged([5, 9, 3], seed=1)
    with torch.inference_mode():
        a = g(x.ids, x.cu_seqlens, x.max_seqlen)
    b = g(x.ids, x.cu_seqlens, x.max_seqlen)  # writes the same buffers outside inference mode
    assert torch.equal(a, b) and not b.is_inference()


def test_lru_eviction():
    g = graphed(PARAMS, max_tokens=256, max_seqs=16, capture=False, max_graphs=2)
    small, mid, big = ragged([3]), ragged([3, 4, 5]), ragged([60, 60, 60])
    for b in (small, mid, small, big):
        g(b.ids, b.cu_seqlens, b.max_seqlen)
    key = lambda b: g.bucket_for(b.num_tokens, b.num_seqs, b.max_seqlen)  # noqa: E731
    assert g.buckets == (key(small), key(big))  # `mid` was least recently used


def test_max_seqlen_none_and_validate():
    batch = ragged([3, 8, 2])
    g = graphed(PARAMS, max_tokens=64, max_seqs=8, capture=False)
    torch.testing.assert_close(g(batch.ids, batch.cu_seqlens), pe.encode(PARAMS, batch.ids, batch.cu_seqlens),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(pe.InputError, match="max_seqlen=4 is smaller"):
        g(batch.ids, batch.cu_seqlens, 4, validate=True)
    with pytest.raises(pe.InputError, match="outside the vocabulary"):
        g(torch.tensor([1, 2, 99]), torch.tensor([0, 3], dtype=torch.int32), 3, validate=True)


def test_callable_target():
    calls = []

    def fn(ids, cu, max_seqlen, positions):
        calls.append((ids.numel(), cu.numel(), max_seqlen))
        return pe.encode(PARAMS, ids, cu, max_seqlen, positions, backend="reference")

    g = graphed(fn, max_tokens=64, max_seqs=8, capture=False)
    batch = ragged([3, 8, 2])
    out = g(batch.ids, batch.cu_seqlens, batch.max_seqlen)
    b = g.buckets[0]
    assert calls == [(b.tokens, b.seqs + 2, b.max_seqlen)]
    torch.testing.assert_close(out, pe.encode(PARAMS, batch.ids, batch.cu_seqlens), rtol=1e-5, atol=1e-5)


# ---- errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize("lengths, match", [
    ([40, 40], "80 tokens in 2 sequences exceeds"),
    ([1] * 9, "9 sequences exceeds"),
])
def test_budget_errors(lengths, match):
    g = graphed(PARAMS, max_tokens=64, max_seqs=8, capture=False)
    batch = ragged(lengths)
    with pytest.raises(pe.InputError, match=match) as e:
        g(batch.ids, batch.cu_seqlens, batch.max_seqlen)
    assert "token_budget_batches" in str(e.value)
    assert not g.fits(batch.num_tokens, batch.num_seqs)


def test_input_errors():
    g = graphed(PARAMS, max_tokens=64, max_seqs=8, capture=False)
    with pytest.raises(pe.InputError, match="1-D"):
        g(torch.ones(2, 3, dtype=torch.long), torch.tensor([0, 6], dtype=torch.int32))
    with pytest.raises(pe.InputError, match="positions shape"):
        g(torch.ones(3, dtype=torch.long), torch.tensor([0, 3], dtype=torch.int32), 3, torch.zeros(2, dtype=torch.long))
    with pytest.raises(pe.InputError, match="positions must be an int64 or int32 tensor, got torch.float32"):
        g(torch.ones(3, dtype=torch.long), torch.tensor([0, 3], dtype=torch.int32), 3, torch.zeros(3))


def test_config_errors():
    with pytest.raises(pe.ConfigError, match="CUDA graphs need a CUDA device"):
        graphed(PARAMS, max_tokens=64, max_seqs=8, device="cpu")
    with pytest.raises(pe.ConfigError, match="max_tokens must be a positive int"):
        graphed(PARAMS, max_tokens=0, max_seqs=8, capture=False)
    with pytest.raises(pe.ConfigError, match="strictly increasing"):
        graphed(PARAMS, max_tokens=64, max_seqs=8, token_buckets=(128, 64), capture=False)
    with pytest.raises(pe.ConfigError, match="not a packedenc params tree"):
        graphed({"w": torch.ones(2)}, max_tokens=64, max_seqs=8, capture=False)
    with pytest.raises(pe.ConfigError, match="backend= applies to a params target"):
        graphed(lambda *a: None, max_tokens=64, max_seqs=8, backend="reference", capture=False)
    with pytest.raises(pe.ConfigError, match="pad_id 50 is outside"):
        graphed(PARAMS, max_tokens=64, max_seqs=8, pad_id=50, capture=False)


def test_wrong_output_is_a_type_error():
    g = graphed(lambda ids, cu, L, pos: ids[:1].float(), max_tokens=64, max_seqs=8, capture=False)
    with pytest.raises(TypeError, match="one tensor with a row per packed token"):
        g(torch.ones(3, dtype=torch.long), torch.tensor([0, 3], dtype=torch.int32), 3)


def test_user_buckets_are_extended_to_cover_the_budget():
    g = graphed(PARAMS, max_tokens=100, max_seqs=8, token_buckets=(32, 64), seq_buckets=(2,), capture=False)
    assert g.seq_buckets == (2, 8) and g.token_buckets == (32, 64, 108)
    batch = ragged([50, 50])
    assert g(batch.ids, batch.cu_seqlens, 50).shape == (100, CFG.hidden_size)
    assert g.buckets == (Bucket(108, 2, 64, False),)


# ---- GPU: real graphs ---------------------------------------------------------------------------

# head_dim 64 and a 128-token window like ModernBERT-base; 4 layers (global, local, local, global)
GPU_CFG = modernbert.ModernBertConfig(vocab_size=1000, hidden_size=256, intermediate_size=384,
                                      num_hidden_layers=4, num_attention_heads=4)
GPU_LENGTHS = [
    [1],                                        # one token
    [1, 63, 64, 65, 128, 129, 130],             # window edges
    [24] * 128,                                 # a query batch that fills its sequence bucket
    [int(x) for x in torch.randint(4, 129, (100,), generator=torch.Generator().manual_seed(3))],
    [2047, 1, 300],                             # long sequence, dummy tail after it
]


@functools.lru_cache(maxsize=None)
def _gpu_params():
    return pe.tree_to(pe.init(GPU_CFG, torch.Generator().manual_seed(0), dtype=torch.bfloat16), "cuda")


def _cosine_rows(a, b):
    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_gpu_replay_matches_eager(backend):
    params = _gpu_params()
    # the budget covers every batch of GPU_LENGTHS (the largest is ~7.2k tokens in 100 sequences)
    g = graphed(params, max_tokens=8192, max_seqs=256, backend=backend)
    for i, lengths in enumerate(GPU_LENGTHS):
        batch = ragged(lengths, vocab=GPU_CFG.vocab_size, seed=i, device="cuda")
        out = g(batch.ids, batch.cu_seqlens, batch.max_seqlen)
        # eager on the very same padded buffers: the replay must be bitwise identical
        b = g.bucket_for(batch.num_tokens, batch.num_seqs, batch.max_seqlen)
        ids, cu, _ = pad_batch(batch.ids, batch.cu_seqlens, b)
        padded = pe.encode(params, ids, cu, b.max_seqlen, backend=backend)[: batch.num_tokens]
        assert torch.equal(out, padded), f"{lengths[:8]}: max diff {(out.float() - padded.float()).abs().max()}"
        # eager on the real batch: other GEMM shapes, so bf16 noise only
        eager = pe.encode(params, batch.ids, batch.cu_seqlens, batch.max_seqlen, backend=backend)
        assert _cosine_rows(out, eager).min() >= 0.999
        assert (out.float() - eager.float()).abs().max() <= 0.05 * eager.float().abs().max()


@pytest.mark.gpu
def test_gpu_bucket_reuse_eviction_and_inference_mode():
    params = _gpu_params()
    g = graphed(params, max_tokens=4096, max_seqs=256, max_graphs=1)
    x = ragged([24] * 128, vocab=GPU_CFG.vocab_size, seed=10, device="cuda")
    y = ragged([24] * 128, vocab=GPU_CFG.vocab_size, seed=11, device="cuda")  # same bucket, new ids
    z = ragged([300, 7], vocab=GPU_CFG.vocab_size, seed=12, device="cuda")  # another bucket
    ref = {k: pe.encode(params, b.ids, b.cu_seqlens, b.max_seqlen) for k, b in (("x", x), ("y", y), ("z", z))}
    ox = g(x.ids, x.cu_seqlens, x.max_seqlen)
    with torch.inference_mode():  # buffers made outside inference mode still work inside, and back
        oy = g(y.ids, y.cu_seqlens, y.max_seqlen)
    assert g.num_graphs == 1
    oz = g(z.ids, z.cu_seqlens, z.max_seqlen)  # evicts x/y's graph
    ox2 = g(x.ids, x.cu_seqlens, x.max_seqlen)  # recaptured
    assert g.num_graphs == 1
    for out, k in ((ox, "x"), (oy, "y"), (oz, "z"), (ox2, "x")):
        assert _cosine_rows(out, ref[k]).min() >= 0.999, k
    assert torch.equal(ox, ox2)
    # clear() then capture again while an output of the old graphs is still alive (it keeps the
    # old pool's blocks in use): torch 2.11 asserted when that pool was handed to a new capture
    g.clear()
    assert g.num_graphs == 0
    oz2 = g(z.ids, z.cu_seqlens, z.max_seqlen)
    assert torch.equal(oz, oz2) and g.num_graphs == 1
    with pytest.raises(pe.InputError, match="exceeds this graphed encode's budget"):
        big = ragged([4000, 200], vocab=GPU_CFG.vocab_size, device="cuda")
        g(big.ids, big.cu_seqlens, big.max_seqlen)


@pytest.mark.gpu
def test_gpu_graphs_hold_about_one_batch_of_memory():
    """Ten buckets captured: warm-ups, captures and outputs share one pool and one output buffer,
    so the graphs add about one batch of activations, not one per bucket."""
    cfg = dataclasses.replace(GPU_CFG, hidden_size=512, intermediate_size=1024)  # activations dominate
    params = pe.tree_to(pe.init(cfg, torch.Generator().manual_seed(0), dtype=torch.bfloat16), "cuda")
    batches = [ragged([n] * 8, vocab=cfg.vocab_size, seed=n, device="cuda") for n in range(1100, 2100, 100)]
    g = graphed(params, max_tokens=16384, max_seqs=8)
    # what one eager batch of the budget's size (the pool-sizing batch) reserves
    budget = g.budget_bucket()
    ids, cu, _ = pad_batch(torch.zeros(0, dtype=torch.int64, device="cuda"),
                           torch.zeros(1, dtype=torch.int32, device="cuda"), budget)
    torch.cuda.synchronize()
    # allocated, not reserved: in a full test run, tensors other tests keep alive (module caches)
    # pin cached segments whose free space an eager batch reuses without reserving more, so a
    # reserved delta measured 180 MB there against 272+ MB alone; the graphs' private pool cannot
    # reuse that space
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.inference_mode():
        pe.encode(params, ids, cu, budget.max_seqlen)
    eager_budget = torch.cuda.max_memory_allocated() - base
    del ids, cu
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    outs = [g(b.ids, b.cu_seqlens, b.max_seqlen) for b in batches]
    assert g.num_graphs == len({g.bucket_for(b.num_tokens, b.num_seqs, b.max_seqlen) for b in batches}) >= 5
    del outs
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # the pool's blocks stay: they belong to live graphs
    held = torch.cuda.memory_reserved() - before
    out_buffer = budget.tokens * cfg.hidden_size * 2
    # about one pool-sizing batch plus the shared output buffer (ten graphs that each pinned their
    # own activations would hold five batches or more). The bound is 2x: the eager batch's figure is
    # its allocated peak, while the pool is counted in reserved segments, and the eager path writes
    # its norms in place (a small allocated peak) where the pool keeps whole segments per size.
    # On an H200: graphs 308 MB held, the eager budget batch 158 MB allocated.
    assert held <= 2.0 * eager_budget + out_buffer + (8 << 20), (held / 2**20, eager_budget / 2**20)
    for b in batches[:3]:  # and the replays are still right
        out = g(b.ids, b.cu_seqlens, b.max_seqlen)
        assert _cosine_rows(out, pe.encode(params, b.ids, b.cu_seqlens, b.max_seqlen)).min() >= 0.999


def test_dummy_sequences_stay_within_the_models_position_limit():
    """A BERT-like model refuses sequences longer than its position table: the token tail's dummy
    sequences must stay within it (more dummy slots: a larger sequence bucket), and L_b too."""
    from packedenc.cudagraphs.buckets import plan_bucket

    tb, sb = (64, 128, 256, 512, 1024, 2048), (1, 2, 4, 8, 16)
    free = plan_bucket(700, 3, 90, token_buckets=tb, seq_buckets=sb)
    assert (free.tokens, free.seqs, free.max_seqlen) == (1024, 4, 256)  # 2 dummies of 162 tokens, unbounded
    capped = plan_bucket(700, 3, 90, token_buckets=tb, seq_buckets=sb, max_len=100)
    assert (capped.tokens, capped.seqs, capped.max_seqlen) == (1024, 8, 100)  # 6 dummies of 54; L_b capped
    with pytest.raises(pe.InputError, match="dummy slots"):
        plan_bucket(700, 3, 90, token_buckets=tb, seq_buckets=(4,), max_len=100)


def test_graphed_encode_knows_the_limit_of_a_bert_params_tree():
    from packedenc.models import bert

    cfg = bert.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                          intermediate_size=48, max_position_embeddings=40)
    params = pe.init(cfg, torch.Generator().manual_seed(0))
    g = graphed(params, max_tokens=256, max_seqs=8, capture=False, backend="reference")
    assert g.max_len == 40
    b = pe.pack([[5] * 30, [6] * 25, [7] * 3])
    assert g.fits(b.num_tokens, b.num_seqs, b.max_seqlen)
    out = g(b.ids, b.cu_seqlens, b.max_seqlen)
    torch.testing.assert_close(out, pe.encode(params, b.ids, b.cu_seqlens, b.max_seqlen, backend="reference"),
                               atol=1e-5, rtol=1e-5)
    assert all(bk.max_seqlen <= 40 for bk in g.buckets)
