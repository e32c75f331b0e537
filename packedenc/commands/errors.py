"""The `packedenc` command's errors and exit codes. Every user or environment error ends the command
with one line on stderr and a documented exit code; `--debug` shows the Python traceback instead.

The classes live here, not in `cli.py`: under `python -m packedenc.cli` that module is `__main__`,
and a second import of it would make second, uncaught copies of its exception classes.
"""

from __future__ import annotations

import errno
import os
import sys
import traceback
from typing import Any, Callable

EXIT_CODES = """exit codes:
  0    success
  1    internal error: a bug (rerun with --debug and report the traceback)
  2    bad arguments or input: no texts, an empty or invalid text, an unreadable input file, a bad option
       value, an output path in a folder that does not exist, --device cuda without a GPU
  3    model problem: folder or hub id not found, damaged or unsupported checkpoint or config, no tokenizer
  4    output not written: a read-only output folder, a full disk, a checkpoint there that needs --overwrite
  5    environment problem: a file that cannot be read, out of memory, a closed output pipe
  130  interrupted (Ctrl-C)
"""


class UsageError(Exception):
    """Bad arguments or input: exit code 2."""


class OutputError(Exception):
    """The output could not be written: exit code 4."""


def exit_code(e: BaseException) -> int:
    """The documented exit code of an exception that ended a command."""
    from packedenc.errors import CheckpointError, ConfigError, InputError

    if isinstance(e, (UsageError, InputError)):
        return 2
    if isinstance(e, (CheckpointError, ConfigError)):
        return 3
    if isinstance(e, OutputError):
        return 4
    if isinstance(e, KeyboardInterrupt):
        return 130
    if isinstance(e, (OSError, MemoryError)) or _is_oom(e):
        return 5
    return 1


def _is_oom(e: BaseException) -> bool:
    import torch

    return isinstance(e, torch.OutOfMemoryError)


def message(e: BaseException) -> str:
    """One line saying what went wrong (and, for an environment problem, what to try)."""
    code = exit_code(e)
    if isinstance(e, KeyboardInterrupt):
        return "interrupted"
    if isinstance(e, BrokenPipeError):
        return "the output pipe was closed before all output was written"
    if isinstance(e, OSError):
        where = f" {e.filename}" if e.filename else ""
        hint = {errno.ENOSPC: ": free some space", errno.EACCES: ": check the permissions",
                errno.EROFS: ": the file system is read-only"}.get(e.errno or 0, "")
        return f"cannot access{where}: {e.strerror or e}{hint}"
    if code == 5:  # out of memory
        return f"out of memory ({str(e).splitlines()[0] if str(e) else type(e).__name__}); lower --max-tokens"
    if code == 1:
        return f"internal error: {type(e).__name__}: {e} (rerun with --debug for the traceback, and please report it)"
    return " ".join(str(e).split()) or type(e).__name__


def run_command(func: Callable[[Any], int], args: Any, command: str, debug: bool) -> int:
    """Run a subcommand: its return code, or one line on stderr and the exit code of what it raised."""
    try:
        code = func(args)
        sys.stdout.flush()  # a closed pipe shows here, not at exit (where Python would print a traceback)
        return code
    except (Exception, KeyboardInterrupt) as e:
        if debug and not isinstance(e, KeyboardInterrupt):
            traceback.print_exc()
        if isinstance(e, BrokenPipeError):  # nothing more can go to stdout; keep Python from complaining
            _silence_stdout()
        print(f"packedenc {command}: {'error: ' if exit_code(e) != 130 else ''}{message(e)}", file=sys.stderr)
        return exit_code(e)


def _silence_stdout() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass


def safe_streams() -> None:
    """Print what cannot be encoded (an argument with an undecodable byte) escaped, never as a crash."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(errors="backslashreplace")
        except (AttributeError, ValueError, OSError):
            pass
