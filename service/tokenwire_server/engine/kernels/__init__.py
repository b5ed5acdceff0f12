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
  step at 16 rows;
- ``lora_add_``: each row's LoRA adapter delta after a GEMM, every row and adapter of the
  step in one call (``engine/lora.py``), where stock torch would run two GEMMs per adapter;
  ``panel_linear_lora``, the panels' GEMM and it in one call, the adapters' pass run by the
  GEMM's own threads;
- ``decoder_layers``: every decoder layer of a step in one call, where every GEMM is the
  panels: the same functions in the same order as the native pass's Python loop.
- ``row_top``, ``row_argmax``, ``near`` and ``noise_uniform``: the sampler's passes over a
  step's rows of logits (a top k, the greedy argmax, the tokens near enough to win a free
  row's draw, the hash under its noise), one pass each (``sampling.RowOps``).

The source is compiled on first use (about 15 s on 2 cores) into
``<cache>/kernels/<key>/`` (``$TOKENWIRE_KERNEL_DIR``, else ``$TOKENWIRE_CACHE_DIR`` or the
default model cache), keyed by the source, torch's version and the flags, and loaded as
``torch.ops.tokenwire``; the compiler's output lies beside it (``BUILD_LOG``).

Building and running are two questions. Building needs an x86-64 C++ compiler only: the
AVX2/FMA intrinsics are compiled with ``-mavx2 -mfma`` whatever the build machine's own
CPU (``build_reason``). Running needs an AVX2+FMA CPU (``cpu_reason``). Where either is
missing, or the build fails, ``load()`` says why and the native pass keeps stock torch
ops (``--kernels auto``; the "batched engine forward pass" log line gives the reason).

``python -m tokenwire_server.engine.kernels`` (``make kernels``) builds it ahead of time;
the container image does so in its builder stage. It exits 0 without building, and says
why, on a host that cannot build (not x86-64, no compiler): a server there runs the torch
ops, and ``make test`` and the image build go on. It exits 1 only when a compiler is
there and the build or the load fails: that is a defect in the source, not in the host.

The build uses ``torch.utils.cpp_extension`` for what the library must agree with torch
on (the compiler it picks, ``$CXX`` else ``c++``; its ABI check; torch's include and
library paths, the headers as ``-isystem`` as it passes them) but not its ``load()``: that
drives the build through ninja (a second build tool where a compiler should be enough),
and loading through it runs ninja and the compiler again in every process, which the
runtime image has neither of; it also either prints ninja's raw output to the process's
stdout (``verbose``) or drops the compiler's warnings. Here the warnings (``-Wall
-Wextra``, the source's own: torch's headers are system headers) are printed by ``make
kernels`` and logged by a server that builds it, never hidden.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
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
BUILD_LOG = "cpu_ops.build.log"  # beside the library: what the compiler printed building it (empty: no warning)
FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-std=c++20", "-fPIC", "-shared", "-Wall", "-Wextra")
KERNEL_DIR_ENV = "TOKENWIRE_KERNEL_DIR"
# The compiled decode attention's limits (cpu_ops.cpp: kMaxGroup; head dim a multiple of 8):
# the native pass checks them when it loads, and reads with stock torch where a model is past them.
MAX_QUERY_HEADS_PER_KV_HEAD = 16
CACHE_DIR_ENV = "TOKENWIRE_CACHE_DIR"
X86_64 = ("x86_64", "amd64")


@dataclasses.dataclass(frozen=True)
class Kernel:
    """The loaded ops (``torch.ops.tokenwire``), or None and why not."""

    ops: Any | None
    reason: str | None = None
    path: Path | None = None
    built_s: float = 0.0  # compile time in this process (0: found built)
    warnings: str = ""  # the compiler's, when it was built in this process


@dataclasses.dataclass(frozen=True)
class Built:
    """A library on disk: where, the seconds spent compiling it (0: found built), the compiler's warnings."""

    path: Path
    seconds: float = 0.0
    warnings: str = ""


class CannotBuild(RuntimeError):
    """The library is not built, and this host cannot build it (``build_reason``)."""


_lock = threading.Lock()
_loaded: Kernel | None = None


def cpu_reason() -> str | None:
    """Why this CPU cannot run the library (None: it can)."""
    if platform.machine().lower() not in X86_64:
        return f"not an x86-64 CPU ({platform.machine()})"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):  # torch's AVX2 level requires FMA too
        return f"the CPU lacks AVX2+FMA (torch capability {capability})"
    return None


def compiler() -> str | None:
    """The C++ compiler to build with: ``$CXX`` where set (and only it), else ``c++`` or ``g++`` on PATH."""
    from torch.utils import cpp_extension

    configured = os.environ.get("CXX")
    if configured:
        return shutil.which(cpp_extension.get_cxx_compiler())  # type: ignore[no-untyped-call]
    return shutil.which("c++") or shutil.which("g++")


def build_reason() -> str | None:
    """Why this host cannot build the library (None: it can). Not its CPU's AVX2: the
    flags ask for it whatever the build machine runs."""
    if platform.machine().lower() not in X86_64:
        return f"not an x86-64 host ({platform.machine()}): the ops are AVX2 intrinsics"
    if compiler() is None:
        configured = os.environ.get("CXX")
        if configured:
            return f"no C++ compiler: $CXX ({configured}) is not on PATH"
        return "no C++ compiler (c++, g++ or $CXX) on PATH"
    return None


def kernel_dir() -> Path:
    configured = os.environ.get(KERNEL_DIR_ENV)
    if configured:
        return Path(configured).expanduser()
    return default_cache_dir(os.environ.get(CACHE_DIR_ENV, "")) / "kernels"


def library_path(directory: Path | None = None) -> Path:
    """Where the library for this source, torch and flags is built and looked for."""
    return (directory or kernel_dir()) / build_key() / LIBRARY


def command(cxx: str, source: Path, target: Path) -> list[str]:
    from torch.utils import cpp_extension

    abi = int(bool(torch._C._GLIBCXX_USE_CXX11_ABI))
    libraries = cpp_extension.library_paths()[0]
    return [
        cxx,
        *FLAGS,
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        # As cpp_extension passes them: torch's headers are system headers, so -Wall
        # reports the source's own warnings, not theirs.
        *(flag for path in cpp_extension.include_paths() for flag in ("-isystem", path)),
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
    for part in (
        SOURCE.read_bytes(),
        torch.__version__.encode(),
        str(torch._C._GLIBCXX_USE_CXX11_ABI).encode(),
        " ".join(FLAGS).encode(),
    ):
        digest.update(part)
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def build(directory: Path | None = None) -> Built:
    """The built library (compiled here unless already built). Needs a compiler, not an
    AVX2 CPU. Raises CannotBuild where the host cannot build it, RuntimeError with the
    compiler's output where the build fails."""
    target = library_path(directory)
    if target.exists():
        return Built(target)
    reason = build_reason()
    if reason is not None:
        raise CannotBuild(f"not built in {target.parent}, and this host cannot build it: {reason}")
    cxx = compiler()
    assert cxx is not None  # build_reason checked
    from torch.utils import cpp_extension

    warnings = []
    compatible, version = cpp_extension.get_compiler_abi_compatibility_and_version(cxx)
    if not compatible:
        warnings.append(
            f"{cxx} {version} may not be ABI-compatible with torch {torch.__version__} (torch.utils.cpp_extension)"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    # Built beside the target under a temporary name, then renamed: a process that loads
    # it never sees half a file, and two that build at once both end with a whole one.
    # The compiler's output goes beside it first, so a library on disk has its log.
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        partial = Path(scratch) / LIBRARY
        done = subprocess.run(command(cxx, SOURCE, partial), capture_output=True, text=True, check=False, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"{cxx} failed ({done.returncode}): {done.stderr.strip()[-4000:]}")
        (Path(scratch) / BUILD_LOG).write_text(done.stderr)
        os.replace(Path(scratch) / BUILD_LOG, target.with_name(BUILD_LOG))
        os.replace(partial, target)
    if done.stderr.strip():
        warnings.append(done.stderr.strip())
    return Built(target, time.perf_counter() - started, "\n".join(warnings))


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
        built = build()
        if built.warnings:
            log.warning(
                "compiled CPU ops: the compiler warned", extra={"path": str(built.path), "warnings": built.warnings}
            )
        torch.ops.load_library(str(built.path))  # type: ignore[no-untyped-call]
    except CannotBuild as exc:
        log.warning("compiled CPU ops unavailable", extra={"error": str(exc)})
        return Kernel(None, str(exc))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("compiled CPU ops unavailable", extra={"error": str(exc)})
        return Kernel(None, f"build or load failed: {exc}")
    return Kernel(torch.ops.tokenwire, None, built.path, built.seconds, built.warnings)


def main() -> int:
    """``make kernels``: 0 when built, or when this host cannot build it (the reason on
    stdout: the server here runs stock torch ops); 1 when the build or the load fails."""
    reason = build_reason()
    if reason is not None:
        print(f"compiled CPU ops not built: {reason}; the server here runs stock torch ops (--kernels auto)")
        return 0
    try:
        built = build()
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        print(f"compiled CPU ops: the build failed: {exc}", file=sys.stderr)
        return 1
    if built.warnings:
        print(f"compiled CPU ops: the compiler warned:\n{built.warnings}", file=sys.stderr)
    how = f"built in {built.seconds:.1f} s" if built.seconds else "already built"
    cannot_run = cpu_reason()
    if cannot_run is not None:
        print(f"{built.path} ({how}); not loaded: {cannot_run}, so a server on this machine runs stock torch ops")
        return 0
    kernel = load()  # proves the library links against this torch and registers its ops
    if kernel.ops is None:
        print(f"compiled CPU ops: {kernel.reason}", file=sys.stderr)
        return 1
    print(f"{built.path} ({how})")
    return 0
