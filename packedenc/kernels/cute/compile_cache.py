"""Compiled CuteDSL kernels kept on disk: a process loads in milliseconds what took a second to compile.

    PACKEDENC_CUTE_CACHE=/path    # the folder (default $XDG_CACHE_HOME/packedenc/cute, else ~/.cache/...)
    PACKEDENC_CUTE_CACHE=off      # compile in every process, keep kernels in memory only

Used by our own CuteDSL kernels (`geglu_gemm.py`); FlashAttention-4 has its own cache (see the
package docstring). `cute.compile` lowers a kernel to an object file holding its host launcher and
cubin; `export_to_c` writes that object and `cute.runtime.load_module` links it back into a
callable with the same arguments, without tracing or compiling anything.

Entries live under a fingerprint of everything that changes the binary: the kernel's source files,
the cutlass-dsl and Python versions, the target GPU architecture. One file per compile key (dtype,
sizes, tile), named by the key's hash. Kernels are compiled with TVM-FFI's calling convention
(`--enable-tvm-ffi`): the loaded function takes torch tensors and launches on torch's current
stream. A new kernel source or a cutlass upgrade gets a new folder; old folders are left as they
are (delete the cache folder to reclaim them).

Writes never destroy: an entry is exported under a temporary name in the same folder and renamed
into place, so a crash leaves no entry or a whole one, and two writers (processes or threads)
exporting the same key both write whole files. An entry that does not load (truncated by a full disk, another cutlass
build) is a miss: the kernel is compiled and the entry replaced. A cache folder that cannot be
written costs a warning, never the call. Nothing outside the cache folder is touched.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
import threading
import warnings
from pathlib import Path
from typing import Any, Callable, Hashable, Sequence

__all__ = ["cache_dir", "load_or_compile", "fingerprint", "ENV"]

ENV = "PACKEDENC_CUTE_CACHE"
_PREFIX = "kernel"  # the exported function's symbol prefix (one function per object file)


def cache_dir() -> Path | None:
    """The cache's root folder, or None when `PACKEDENC_CUTE_CACHE=off` (or 0 / false / no)."""
    value = os.environ.get(ENV, "").strip()
    if value.lower() in ("off", "0", "false", "no"):
        return None
    if value:
        return Path(value).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "packedenc" / "cute"


def _arch() -> str:
    """The architecture CuteDSL compiles for: CUTE_DSL_ARCH when set, else the current GPU's."""
    if os.environ.get("CUTE_DSL_ARCH"):
        return os.environ["CUTE_DSL_ARCH"]
    import torch

    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"sm_{major}{minor}"
    return "unknown"


@functools.lru_cache(maxsize=None)
def fingerprint(sources: tuple[Path, ...], versions: tuple[str, ...], arch: str) -> str:
    """A short hash of the kernel's source files, the tool versions and the target architecture."""
    h = hashlib.sha256()
    h.update(f"py{sys.version_info.major}.{sys.version_info.minor}|{arch}|{'|'.join(versions)}".encode())
    for src in sources:
        data = Path(src).read_bytes()
        h.update(Path(src).name.encode() + len(data).to_bytes(8, "little") + data)
    return h.hexdigest()[:16]


def _cutlass_version() -> str:
    import cutlass

    return f"cutlass={cutlass.__version__}"


def _export(fn: Any, folder: Path, stem: str) -> Path:
    """Write `fn` (compiled with TVM-FFI's calling convention) as the object file folder/stem.o."""
    path = folder / f"{stem}.o"
    fn.export_to_c(str(path), _PREFIX)
    return path


@functools.lru_cache(maxsize=1)
def _preload_runtime() -> None:
    # The loaded object calls into CuteDSL's CUDA runtime library and TVM-FFI's; they must be
    # visible to the dynamic linker globally (load_module opens them without RTLD_GLOBAL:
    # "undefined symbol" otherwise).
    import ctypes

    import cutlass.cute as cute

    for lib in cute.runtime.find_runtime_libraries(enable_tvm_ffi=True):
        if Path(lib).exists():
            ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)


def _load(path: Path) -> Any:
    import cutlass.cute as cute

    _preload_runtime()
    return getattr(cute.runtime.load_module(str(path), enable_tvm_ffi=True), _PREFIX)


def load_or_compile(key: Hashable, sources: Sequence[Path], compile: Callable[[], Any], *,
                    versions: Sequence[str] | None = None, arch: str | None = None,
                    export: Callable[[Any, Path, str], Path] = _export,
                    load: Callable[[Path], Any] = _load) -> tuple[Any, str]:
    """(the compiled kernel for `key`, "loaded" / "compiled" / "compiled, cache off" / "compiled, not
    cached: why"). `compile()` runs only when no loadable entry exists; `export` / `load` are the
    cutlass calls (tests pass fakes)."""
    root = cache_dir()
    if root is None:
        return compile(), "compiled, cache off"
    versions = tuple(versions) if versions is not None else (_cutlass_version(),)
    folder = root / fingerprint(tuple(Path(s) for s in sources), versions, arch or _arch())
    name = hashlib.sha256(repr(key).encode()).hexdigest()[:32]
    entry = folder / f"{name}.o"
    if entry.is_file():
        try:
            return load(entry), "loaded"
        except Exception:  # a bad entry is a miss: compiled below, and replaced
            pass
    fn = compile()
    tmp = f".{name}.{os.getpid()}.{threading.get_ident()}.tmp"  # one per writer: threads of one process too
    try:
        folder.mkdir(parents=True, exist_ok=True)
        os.replace(export(fn, folder, tmp), entry)
    except Exception as e:
        for leftover in (folder / f"{tmp}.o", folder / f"{tmp}.h"):
            try:
                leftover.unlink(missing_ok=True)
            except OSError:
                pass
        why = f"{type(e).__name__}: {e}"
        warnings.warn(f"packedenc: the CuteDSL compile cache at {folder} cannot be written ({why}); this "
                      f"kernel stays in memory only. Set {ENV} to a writable folder, or to off.", RuntimeWarning,
                      stacklevel=3)
        return fn, f"compiled, not cached: {why}"
    return fn, "compiled"
