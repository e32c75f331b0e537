"""`embed(model, texts)`: texts in, embeddings out, in the caller's order.

The job: sort the texts by length (longest first, so a memory problem shows up in the first
batch, not after an hour), tokenize them on a background thread in chunks, cut each chunk into
padding-free batches of at most `max_tokens` tokens, run the backbone and the
sentence-transformers module chain on the device, and write each result back at its caller's
index. Truncation is counted over the whole job and reported in one warning.

Shapes: N texts, T packed tokens, D output width.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import threading
import time
import weakref
from typing import Any, Iterator, Sequence

import numpy as np
import torch
from torch import Tensor

from packedenc.errors import ConfigError, InputError, InputTypeError
from packedenc.checks import as_device, float_dtype
from packedenc.kernels import get_ops
from packedenc.packing import Packed
from packedenc.text.sentence_transformers import (
    POOLING_MODES, Normalize, Pooling, SentenceModel, _MODE_ALIASES, load_sentence_transformer, run_modules,
)
from packedenc.text.embed_stats import EmbedStats
from packedenc.text.token_ids import TokenIds
from packedenc.text.tokenizer import check_texts, check_unicode, encode_texts, warn_truncated

__all__ = ["embed", "EmbedStats", "TokenEmbeddings", "tokenize_for"]

# What the background thread tokenizes per step. A chunk holds about one batch's worth of text
# (max_tokens x _CHARS_PER_TOKEN characters: English runs 4-5 characters a WordPiece / BPE token),
# so the device works on batch k while chunk k + 1 is tokenized; the first chunk holds a quarter of
# that, so the device starts early. Chunks of a fixed number of texts left 4,000 passages in one
# chunk, tokenized whole before the first batch ran. _CHUNK_TEXTS caps a chunk of very short texts.
_CHARS_PER_TOKEN = 4
_CHUNK_TEXTS = 8192


@dataclasses.dataclass(frozen=True)
class TokenEmbeddings:
    """One vector per token (ColBERT models), packed: text i is `values[cu_seqlens[i]:cu_seqlens[i+1]]`.

    Fields:
        values: (T, D) float32. cu_seqlens: (N+1,) int32, in the caller's order.
    """

    values: Tensor
    cu_seqlens: Tensor

    def __len__(self) -> int:
        return self.cu_seqlens.numel() - 1

    def __getitem__(self, i: int) -> Tensor:
        return self.values[int(self.cu_seqlens[i]):int(self.cu_seqlens[i + 1])]

    def unpack(self) -> list[Tensor]:
        return list(torch.split(self.values, (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist()))


def embed(model: Any, texts: Sequence[str], *, max_tokens: int = 65536, pooling: str | None = None,
          normalize: bool | None = None, progress: bool = True, device: torch.device | str | None = None,
          dtype: torch.dtype | None = None, prompt: str | None = None, query: bool = False,
          max_length: int | None = None, truncate: bool = True, backend: str = "auto",
          graphs: bool | None = None, stats: EmbedStats | None = None) -> Tensor | TokenEmbeddings:
    """Embed texts with a sentence-transformers / PyLate / HF model.

    Arguments:
        model: a model folder or hub id (a sentence-transformers folder, or a bare HF folder which
            gets mean pooling and no normalization, as `SentenceTransformer(folder)` does), or a
            `SentenceModel` from `packedenc.load_sentence_transformer`.
        texts: a list of non-empty strings.
        max_tokens: token budget per packed batch (the memory knob; no padding is ever added).
        pooling: override the model's pooling: "cls", "mean", "max", "lasttoken", "weightedmean"
            or "mean_sqrt_len_tokens". normalize: force L2 normalization on (True) or off (False);
            None keeps the model's Normalize module.
        progress: show a tqdm bar on long jobs (more than 64 texts, and only after 2 seconds).
        device: where to compute; default CUDA when available for a folder, else the model's device.
        dtype: cast the weights (e.g. torch.bfloat16 on a GPU). prompt: a prompt name from the
            model's config_sentence_transformers.json or literal text prepended to every text.
        query: ColBERT models: encode as queries ([Q] prefix, [MASK] expansion) instead of documents.
        max_length: tokens per text, special tokens included (default: the model's limit).
        truncate: cut longer texts (one `TruncationWarning` with the count) or raise `InputError`.
        backend: kernel backend for the backbone ("auto", "reference", ...).
        graphs: replay the backbone as CUDA graphs (`packedenc.cudagraphs.graphed`, lazy: a batch
            shape seen once runs eagerly, a repeated one replays). Default: on for a CUDA model,
            off elsewhere; the graphed encoder is kept with the model and reused by later calls.
        stats: an `EmbedStats` to fill with this call's breakdown: wall time, batches, the
            background tokenizer's time, the time the device loop waited for it, and (CUDA) the
            summed device time of the batches. None (default) records nothing.
    Every batch is checked as it is packed, on the host (token ids against the model's vocabulary,
    lengths against its limit), so the device never sees an id it cannot embed and no check reads
    GPU data.
    Return:
        (N, D) float32 CPU tensor, row i for texts[i]; for multi-vector (ColBERT) models a
        `TokenEmbeddings` holding one vector per kept token.
    """
    t_call = time.perf_counter()
    texts = _check_args(texts, max_tokens, prompt)
    if stats is not None and not isinstance(stats, EmbedStats):
        raise InputTypeError(f"stats must be a packedenc.text.embed.EmbedStats or None, got {type(stats).__name__}")
    if stats is not None:
        stats.reset()
    model = _as_model(model, as_device(device), float_dtype(dtype))
    get_ops(backend, model.device)  # an unknown backend, or one that cannot run there, fails before any work
    modules = _override(model, pooling, normalize)
    n = len(texts)
    out: Tensor | None = None
    per_text: list[Tensor | None] = [None] * n
    cut_total: list[int] = []
    limit_used: list[int | None] = [None]
    from tqdm.auto import tqdm

    # Long jobs only: a bar for a handful of texts is noise (and `delay` hides short ones anyway).
    bar = tqdm(total=n, unit="text", desc="embed", disable=not progress or n <= 64, delay=2.0, leave=False)
    encode = _encoder(model, backend, max_tokens, model.device.type == "cuda" if graphs is None else graphs)
    pending = None  # the previous batch's results: read back while the device runs the next batch
    try:
        with torch.inference_mode():
            for idx, batch, prompt_length in _batches(model, texts, max_tokens, prompt, query, max_length,
                                                      truncate, cut_total, limit_used, stats=stats):
                batch = batch.to(model.device)
                start = None if stats is None else stats.start_batch(model.device)
                f = run_modules(modules, encode(batch), batch, prompt_length=prompt_length,
                                task="query" if query else "document")
                if stats is not None:
                    stats.end_batch(start, len(idx), batch.num_tokens)
                current = _read_back(idx, f, model.multi_vector)
                if pending is not None:
                    out = _store(pending, out, per_text, n)
                    bar.update(len(pending[0]))
                pending = current
            if pending is not None:
                out = _store(pending, out, per_text, n)
                bar.update(len(pending[0]))
    finally:
        bar.close()
    if stats is not None:
        stats.finish(time.perf_counter() - t_call)
    if cut_total:
        warn_truncated(len(cut_total), n, limit_used[0], min(cut_total))
    if out is not None:
        return out
    lengths = torch.tensor([0] + [t.shape[0] for t in per_text])
    return TokenEmbeddings(torch.cat(per_text), torch.cumsum(lengths, 0).to(torch.int32))


def _check_args(texts: Any, max_tokens: Any, prompt: Any) -> list[str]:
    texts = check_texts(texts)
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens <= 0:
        raise InputError(f"max_tokens must be a positive int, got {max_tokens!r}")
    if prompt is not None and not isinstance(prompt, str):
        raise InputTypeError(f"prompt must be a prompt name or a text, got {type(prompt).__name__}")
    if prompt is not None:
        check_unicode("prompt", prompt)
    return texts


# A model's graphed encoders, kept with the model (not its folder: a reload is a new params tree)
_GRAPHED: "weakref.WeakKeyDictionary[SentenceModel, dict[tuple, Any]]" = weakref.WeakKeyDictionary()


def _encoder(model: SentenceModel, backend: str, max_tokens: int, graphs: bool):
    """batch -> hidden states: the eager encode, or the model's graphed one for this budget."""
    from packedenc.models import encode

    def eager(batch: Packed) -> Tensor:
        return encode(model.params, batch.ids, batch.cu_seqlens, batch.max_seqlen, batch.positions, backend=backend)

    if not graphs:
        return eager
    if model.device.type != "cuda":
        raise ConfigError(f"graphs=True needs a CUDA model, this one is on {model.device}; use graphs=False")
    from packedenc.cudagraphs import graphed

    # A token-budget batch of short texts holds many sequences: budget them at one per 8 tokens
    # (shorter texts' batches exceed it and run eagerly).
    key = (backend, max_tokens)
    g = _GRAPHED.setdefault(model, {}).get(key)
    if g is None:
        g = _GRAPHED[model][key] = graphed(model.params, max_tokens=max_tokens, max_seqs=max(64, max_tokens // 8),
                                           backend=backend, lazy=True)

    def replayed(batch: Packed) -> Tensor:
        if not g.fits(batch.num_tokens, batch.num_seqs, batch.max_seqlen):
            return eager(batch)
        return g(batch.ids, batch.cu_seqlens, batch.max_seqlen, batch.positions)

    return replayed


def _read_back(idx: np.ndarray, f: dict[str, Any], multi_vector: bool) -> tuple:
    """Start copying a batch's results to the host (pinned, asynchronous on CUDA)."""
    if "sentence_embedding" in f and not multi_vector:
        vals, cu = f["sentence_embedding"].float(), None
    else:
        vals, cu = f["token_embeddings"].float(), f["cu_seqlens"]
    if vals.is_cuda:
        host = torch.empty(vals.shape, dtype=vals.dtype, pin_memory=True)
        host.copy_(vals, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return idx, host, None if cu is None else cu.cpu(), done
    return idx, vals, None if cu is None else cu, None


def _store(pending: tuple, out: Tensor | None, per_text: list, n: int) -> Tensor | None:
    """Write a batch's read-back results at its caller indices (waits for its copy)."""
    idx, vals, cu, done = pending
    if done is not None:
        done.synchronize()
    if cu is None:
        if out is None:
            out = torch.empty(n, vals.shape[1], dtype=torch.float32)
        # numpy's row scatter by the index array as it comes: half the time of index_put with an
        # index tensor built from a list (4,096 x 384 rows), and no intra-op thread pool
        out.numpy()[idx] = vals.numpy()
        return out
    bounds = cu.tolist()
    for j, i in enumerate(idx.tolist()):
        per_text[i] = vals[bounds[j]:bounds[j + 1]]
    return out


def _as_model(model: Any, device: torch.device | str | None, dtype: torch.dtype | None) -> SentenceModel:
    if isinstance(model, (str, os.PathLike)):
        dev = device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
        return load_sentence_transformer(model, device=dev, dtype=dtype)
    if isinstance(model, SentenceModel):
        if device is not None and torch.device(device) != model.device:
            model = model.to(device)
        return model if dtype is None else model.to(dtype=dtype)
    raise InputTypeError(
        f"embed() needs a model folder, a hub id or a SentenceModel, got {type(model).__name__}; a params "
        "tree has no tokenizer: use packedenc.load_sentence_transformer(folder) or pass the folder"
    )


def _override(model: SentenceModel, pooling: str | None, normalize: bool | None) -> tuple[Any, ...]:
    """The model's module chain with the caller's pooling / normalize choices applied."""
    modules = list(model.modules)
    out_name = "token_embeddings" if model.multi_vector else "sentence_embedding"
    if pooling is not None:
        mode = _MODE_ALIASES.get(pooling, pooling)
        if mode not in POOLING_MODES:
            raise InputError(f"unknown pooling {pooling!r}; choose one of {POOLING_MODES}")
        if model.multi_vector:
            raise ConfigError("this is a multi-vector (ColBERT) model: it returns token embeddings and has no pooling")
        i = next(i for i, m in enumerate(modules) if isinstance(m, Pooling))
        modules[i] = dataclasses.replace(modules[i], modes=(mode,))
    if normalize is False:
        modules = [m for m in modules if not (isinstance(m, Normalize) and m.output_name == out_name)]
    elif normalize and not (modules and isinstance(modules[-1], Normalize) and modules[-1].output_name == out_name):
        modules.append(Normalize(out_name, out_name))
    return tuple(modules)


def _chunks(chars_N: np.ndarray, max_tokens: int, chunk_texts: int) -> list[np.ndarray]:
    """Caller indices, longest text first (ties in the caller's order), cut into tokenization
    chunks: about max_tokens x _CHARS_PER_TOKEN characters each, the first a quarter of that, at
    most `chunk_texts` texts, at least one."""
    order_N = np.argsort(-chars_N, kind="stable")
    cum_N = np.cumsum(chars_N[order_N])
    budget = max_tokens * _CHARS_PER_TOKEN
    chunks, a = [], 0
    while a < len(order_N):
        done = int(cum_N[a - 1]) if a else 0
        z = int(np.searchsorted(cum_N, done + (budget // 4 if a == 0 else budget), side="right"))
        z = min(max(z, a + 1), a + chunk_texts)
        chunks.append(order_N[a:z])
        a = z
    return chunks


def _batches(model: SentenceModel, texts: list[str], max_tokens: int, prompt: str | None, query: bool,
             max_length: int | None, truncate: bool, cut_total: list[int], limit_used: list[int | None],
             *, chunk_texts: int = _CHUNK_TEXTS, stats: EmbedStats | None = None
             ) -> Iterator[tuple[np.ndarray, Packed, int]]:
    """Yield (caller indices (B,) int64, packed batch, prompt length), tokenizing the next chunk
    (`_chunks`: about one batch of text, at most `chunk_texts` texts) on a background thread while
    the caller runs the device on the current one. `stats` gets the thread's tokenize and pack
    time and the caller's wait for it."""
    assert chunk_texts > 0, chunk_texts
    chars_N = np.fromiter(map(len, texts), dtype=np.int64, count=len(texts))
    chunks = _chunks(chars_N, max_tokens, chunk_texts)
    q: queue.Queue = queue.Queue(maxsize=8)
    stop = threading.Event()

    def produce() -> None:
        try:
            for chunk_N in chunks:
                t0 = time.perf_counter()
                ids, cut, limit, plen = tokenize_for(model, [texts[i] for i in chunk_N.tolist()], prompt=prompt,
                                                     query=query, max_length=max_length, truncate=truncate)
                t1 = _tally(stats, "tokenize_s", t0)
                cut_total.extend(chunk_N[cut].tolist())
                limit_used[0] = limit
                _check_vocab(ids, model)
                by_len_N, ids = ids.longest_first()
                caller_N, positions_T = chunk_N[by_len_N], ids.positions_T()
                # the budget cuts the length-sorted chunk into runs: each batch is a slice of `ids`
                for a, z in ids.budget_runs(max_tokens):
                    item = (caller_N[a:z], ids.packed(a, z, positions_T), plen)
                    _tally(stats, "pack_s", t1)
                    while not stop.is_set():
                        try:
                            q.put(item, timeout=0.1)
                            break
                        except queue.Full:
                            continue
                    if stop.is_set():
                        return
                    t1 = time.perf_counter()  # the wait for room in the queue is not packing
            q.put(None)
        except BaseException as e:  # re-raised on the caller's thread
            q.put(e)

    worker = threading.Thread(target=produce, name="packedenc-tokenize", daemon=True)
    worker.start()
    try:
        while True:
            t0 = time.perf_counter()
            item = q.get()
            _tally(stats, "wait_s", t0)
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        worker.join(timeout=5)


def _tally(stats: EmbedStats | None, field: str, since: float) -> float:
    """Add the time since `since` to `stats.<field>` (when recording); return now."""
    now = time.perf_counter()
    if stats is not None:
        setattr(stats, field, getattr(stats, field) + now - since)
    return now


def _check_vocab(ids: TokenIds, model: SentenceModel) -> None:
    """Host-side guard (the ids are still on the host): a tokenizer that does not belong to the
    weights would otherwise index past the embedding table on the device."""
    vocab = getattr(model.params.config, "vocab_size", None)
    top = ids.max_id()
    if vocab is not None and top >= vocab:
        raise InputError(
            f"the tokenizer produced id {top} but the model's vocabulary has {vocab} entries: the tokenizer "
            f"files in {model.folder} do not belong to these weights"
        )


def tokenize_for(model: SentenceModel, texts: list[str], *, prompt: str | None = None, query: bool = False,
                 max_length: int | None = None, truncate: bool = True
                 ) -> tuple[TokenIds, list[int], int | None, int]:
    """Token ids the way the model's folder says: prompts, and ColBERT's [Q]/[D] prefix and query
    [MASK] expansion. Return: (the texts' ids, truncated indices, limit, prompt length in tokens)."""
    tok = model.tokenizer
    c = model.colbert
    if c is None:
        if query:
            raise ConfigError("query=True is for multi-vector (ColBERT) models; use prompt=... for others")
        text_prompt = _resolve_prompt(model, prompt)
        if text_prompt:
            texts = [text_prompt + t for t in texts]
        ids, cut, limit = encode_texts(tok, texts, max_length, truncate)
        return ids, cut, limit, _prompt_length(tok, text_prompt) if text_prompt else 0
    prefix = c.query_prefix if query else c.document_prefix
    limit = min(c.query_length if query else c.document_length, tok.max_length or 10**9)
    if max_length is not None:
        limit = max_length
    prefix_id = tok.token_id(prefix) if prefix else None
    if prefix_id is None and prefix:
        prefix_id = tok.token_id(prefix.strip())
    if prefix_id is not None:  # PyLate inserts the prefix token right after [CLS]
        ids, cut, _ = encode_texts(tok, texts, limit - 1, truncate)
        ids = ids.with_token_after_first(prefix_id)
    else:  # not a token of this vocabulary: prepended as text, as sentence-transformers does
        ids, cut, _ = encode_texts(tok, [prefix + t for t in texts], limit, truncate)
    if query and c.query_expansion:
        if not c.attend_to_expansion_tokens:
            raise ConfigError(
                "this ColBERT model expands queries with [MASK] tokens that the other tokens do not attend to "
                "(attend_to_expansion_tokens=false); packedenc's packed attention cannot express that yet. "
                "Encode documents (query=False), or use PyLate for queries"
            )
        mask = tok.token_id("[MASK]") if tok.token_id("[MASK]") is not None else tok.token_id("<mask>")
        if mask is None:
            raise ConfigError("query expansion needs a [MASK] token, and this tokenizer has none")
        ids = ids.padded_to(limit, mask)
    return ids, cut, limit, 0


def _resolve_prompt(model: SentenceModel, prompt: str | None) -> str | None:
    prompts = dict(model.prompts)
    if prompt is None:
        return prompts.get(model.default_prompt_name) if model.default_prompt_name else None
    return prompts.get(prompt, prompt)


def _prompt_length(tok: Any, prompt: str) -> int:
    """Tokens of the prompt alone, less a trailing special token (ST's `_get_prompt_length`)."""
    (ids,), _ = tok.encode([prompt])
    special = {i for i, t in tok.backend.get_added_tokens_decoder().items() if t.special}
    return len(ids) - (1 if ids and ids[-1] in special else 0)
