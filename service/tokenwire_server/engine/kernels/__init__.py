"""Compiled CPU operations of the native pass, built once with the host's C++ compiler.

``cpu_ops.cpp`` holds the work around the GEMMs of a step, each as one call:

- ``decode_attention``: the one-token rows' attention over the slot cache.
  ``scaled_dot_product_attention`` does the same work at about half the memory
  bandwidth on a small x86 CPU: each call pads every row to the longest one's columns
  behind a mask, and its flash kernel is tuned for long query blocks, not the three
  query rows a decode step gives each KV head (``make bench-kernels``, docs/benchmarks.md);
- ``rms_norm``, ``silu_mul``, ``rope_`` and ``store_kv``: Llama's RMSNorm, SiLU(gate)*up,
  the rotary embedding and the K/V cache write, which stock torch runs as 2-8 small ops
  each (with a dispatch, an allocation and often a strided copy apiece): ~2,000 ops a
  step at 16 rows.

The source is compiled on first use (about 15 s on 2 cores) into
``<cache>/kernels/<key>/`` (``$TOKENWIRE_KERNEL_DIR``, else the model cache), keyed by
the source, torch's version and the flags, and loaded as ``torch.ops.tokenwire``. Where
there is no compiler, no AVX2+FMA, or the build fails, ``load()`` says why and the
native pass keeps stock torch ops (``--kernels auto``). ``python -m
tokenwire_server.engine.kernels`` (``make kernels``) builds it ahead of time; the
container image does so in its builder stage.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from ...model import default_cache_dir

log = logging.getLogger("tokenwire.engine")

SOURCE = Path(__file__).with_name("cpu_ops.cpp")
LIBRARY = "cpu_ops.so"
FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-std=c++20", "-fPIC", "-shared", "-w")
KERNEL_DIR_ENV = "TOKENWIRE_KERNEL_DIR"


@dataclasses.dataclass(frozen=True)
class Kernel:
    """The loaded ops (``torch.ops.tokenwire``), or None and why not."""

    ops: Any | None
    reason: str | None = None
    path: Path | None = None
    built_s: float = 0.0  # compile time in this process (0: found built)


_lock = threading.Lock()
_loaded: Kernel | None = None


def cpu_reason() -> str | None:
    """Why this CPU cannot run the kernel (None: it can)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"not an x86-64 CPU ({platform.machine()})"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):  # torch's AVX2 level requires FMA too
        return f"the CPU lacks AVX2+FMA (torch capability {capability})"
    return None


def compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")


def kernel_dir() -> Path:
    configured = os.environ.get(KERNEL_DIR_ENV)
    return Path(configured).expanduser() if configured else default_cache_dir() / "kernels"


def command(cxx: str, source: Path, target: Path) -> list[str]:
    from torch.utils import cpp_extension

    abi = int(bool(torch._C._GLIBCXX_USE_CXX11_ABI))
    libraries = cpp_extension.library_paths()[0]
    return [
        cxx,
        *FLAGS,
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *(f"-I{path}" for path in cpp_extension.include_paths()),
        str(source),
        f"-L{libraries}",
        "-lc10",
        "-ltorch_cpu",
        f"-Wl,-rpath,{libraries}",
        "-o",
        str(target),
    ]


def build_key() -> str:
    """What the library depends on: the source, torch's version and ABI, the flags (not
    the compiler's version: a runtime image has the library but no compiler)."""
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), torch.__version__.encode(), str(torch._C._GLIBCXX_USE_CXX11_ABI).encode(), " ".join(FLAGS).encode()):
        digest.update(part)
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def build(directory: Path | None = None) -> tuple[Path, float]:
    """The built library's path and the seconds spent compiling it (0: already built)."""
    target_dir = (directory or kernel_dir()) / build_key()
    target = target_dir / LIBRARY
    if target.exists():
        return target, 0.0
    cxx = compiler()
    if cxx is None:
        raise RuntimeError(f"not built in {target_dir}, and no C++ compiler (c++, g++ or $CXX) on PATH to build it")
    target_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    # Built beside the target under a temporary name, then renamed: a process that loads
    # it never sees half a file, and two that build at once both end with a whole one.
    with tempfile.TemporaryDirectory(dir=target_dir) as scratch:
        partial = Path(scratch) / LIBRARY
        done = subprocess.run(command(cxx, SOURCE, partial), capture_output=True, text=True, check=False, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"{cxx} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
        os.replace(partial, target)
    return target, time.perf_counter() - started


def load() -> Kernel:
    """``torch.ops.tokenwire``, built and loaded once per process."""
    global _loaded
    with _lock:
        if _loaded is None:
            _loaded = _load()
        return _loaded


def _load() -> Kernel:
    reason = cpu_reason()
    if reason is not None:
        return Kernel(None, reason)
    try:
        path, seconds = build()
        torch.ops.load_library(str(path))  # type: ignore[no-untyped-call]
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("compiled CPU ops unavailable", extra={"error": str(exc)})
        return Kernel(None, f"build or load failed: {exc}")
    return Kernel(torch.ops.tokenwire, None, path, seconds)


def main() -> int:
    kernel = load()
    if kernel.ops is None:
        print(f"not built: {kernel.reason}")
        return 1
    how = f"built in {kernel.built_s:.1f} s" if kernel.built_s else "already built"
    print(f"{kernel.path} ({how})")
    return 0


