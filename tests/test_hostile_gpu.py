"""Issue 23 on the GPU: the entry checks never sync with the host unless asked, validate=True refuses
on CUDA tensors what the CPU refuses (a fuzz run against the CPU reference), and a forced GPU
backend runs where it can. Skipped without a GPU."""

import random

import pytest
import torch

import packedenc as pe
from packedenc.models.common import prepare_inputs
from tests.test_hostile_fuzz import BERT, MODERNBERT, _random_call, _reference, _valid

pytestmark = pytest.mark.gpu


def test_entry_checks_do_not_sync_with_the_gpu():
    b = pe.pack([[1, 2, 3], [4, 5], [6]], device="cuda")
    h = torch.randn(b.num_tokens, 8, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any device -> host copy or sync raises
    try:
        prepare_inputs(b.ids, b.cu_seqlens, b.max_seqlen, b.positions, 128, False, max_positions=64)
        pe.pool_mean(h, b.cu_seqlens)
        pe.pool_first(h, b.cu_seqlens)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    with pytest.raises(pe.InputError, match="must end at the number of packed tokens"):
        pe.pool_mean(h[:5], b.cu_seqlens, validate=True)  # asked: reads the GPU values


@pytest.mark.parametrize("params,limit", [(BERT, 64), (MODERNBERT, None)], ids=["bert", "modernbert"])
def test_validate_true_on_cuda_refuses_what_the_cpu_refuses(params, limit):
    gpu = pe.tree_to(params, "cuda")
    rng = random.Random(7)
    seen = {"answer": 0, "error": 0}
    for case in range(120):
        ids, cu, max_seqlen, positions = _random_call(rng, params.config.vocab_size, limit)
        valid = _valid(params, ids, cu, max_seqlen, positions, limit)
        move = lambda t: t.cuda() if isinstance(t, torch.Tensor) else t  # noqa: E731
        try:
            out = pe.encode(gpu, move(ids), move(cu), max_seqlen, move(positions), validate=True)
        except pe.PackedEncError as e:
            assert not valid, f"case {case}: valid input refused: {e}"
            seen["error"] += 1
            continue
        assert valid, f"case {case}: invalid input returned an answer on the GPU"
        ref = _reference(params, ids, cu, positions)
        cos = torch.nn.functional.cosine_similarity(out.float().cpu(), ref, dim=-1)
        assert float(cos.min()) > 0.9999, (case, float(cos.min()))
        seen["answer"] += 1
    assert seen["answer"] >= 20 and seen["error"] >= 20, seen


@pytest.mark.parametrize("backend", ["triton", "flash"])
def test_a_forced_backend_runs_on_cuda_tensors(backend):
    b = pe.pack([[1, 2, 3, 4, 5, 6, 7], [8, 9]], device="cuda")
    params = pe.tree_to(MODERNBERT, "cuda")
    got = pe.encode(pe.tree_cast(params, torch.bfloat16), b.ids, b.cu_seqlens, b.max_seqlen, backend=backend)
    ref = pe.encode(params, b.ids, b.cu_seqlens, b.max_seqlen, backend="reference")  # fp32
    cos = torch.nn.functional.cosine_similarity(got.float(), ref, dim=-1)
    assert float(cos.min()) >= 0.999, float(cos.min())


def test_load_to_cuda_and_refuse_a_missing_device_index(tmp_path):
    pe.save(BERT, tmp_path / "m")
    params = pe.load(tmp_path / "m", device="cuda", dtype=torch.bfloat16)
    assert params.embeddings.word_embeddings.weight.device.type == "cuda"
    with pytest.raises(pe.InputError, match="there are only"):
        pe.load(tmp_path / "m", device=f"cuda:{torch.cuda.device_count()}")
