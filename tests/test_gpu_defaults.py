"""GPU defaults, checked without a GPU: the dtype rule, the KV budget against free memory,
and the GPU gauges (exported only where there is something to report)."""

from __future__ import annotations

import types

import pytest
import torch
from prometheus_client import generate_latest
from tokenwire_server.metrics import CUDA_METRIC_NAMES, NVML_METRIC_NAMES, Metrics
from tokenwire_server.model import ModelLoadError, auto_dtype, fit_kv_budget, kv_bytes_per_token


@pytest.mark.parametrize(
    ("device", "capability", "expected"),
    [
        ("cpu", None, torch.float32),
        ("cuda", (7, 0), torch.float16),  # V100: bf16 only emulated
        ("cuda", (7, 5), torch.float16),  # T4
        ("cuda", (8, 0), torch.bfloat16),  # A100
        ("cuda", (8, 9), torch.bfloat16),  # L4
        ("cuda", (9, 0), torch.bfloat16),  # H100/H200
    ],
)
def test_auto_dtype_is_bf16_only_where_the_gpu_computes_it(device, capability, expected):
    assert auto_dtype(device, capability) is expected


def test_kv_bytes_per_token_counts_keys_and_values_of_every_layer():
    smollm2_135m = types.SimpleNamespace(
        num_attention_heads=9, num_key_value_heads=3, hidden_size=576, num_hidden_layers=30
    )
    assert kv_bytes_per_token(smollm2_135m, torch.bfloat16) == 2 * 30 * 3 * 64 * 2
    assert kv_bytes_per_token(smollm2_135m, torch.float32) == 2 * 30 * 3 * 64 * 4


def test_a_derived_budget_that_does_not_fit_is_lowered_and_an_explicit_one_refuses():
    per_token = 1000
    assert fit_kv_budget(500, True, per_token, 1_000_000) == (500, "")  # fits in 90% of 1 MB
    budget, warning = fit_kv_budget(5000, True, per_token, 1_000_000)
    assert budget == 900 and "lowered to 900" in warning
    with pytest.raises(ModelLoadError, match="--kv-cache-tokens 5000 needs .* at most 900"):
        fit_kv_budget(5000, False, per_token, 1_000_000)


def exposition(metrics: Metrics) -> str:
    return generate_latest(metrics.registry).decode()


def test_gpu_gauges_appear_only_with_a_probe():
    plain = Metrics()
    plain.watch_gpu(None, None)
    text = exposition(plain)
    assert not any(name in text for name in CUDA_METRIC_NAMES + NVML_METRIC_NAMES)

    gpu = Metrics()
    gpu.watch_gpu(lambda: {"cuda:0": (3 << 30, 4 << 30, 80 << 30)}, lambda: {"cuda:0": (0.75, 5 << 30)})
    registry = gpu.registry
    assert registry.get_sample_value("tokenwire_gpu_memory_allocated_bytes", {"device": "cuda:0"}) == 3 << 30
    assert registry.get_sample_value("tokenwire_gpu_memory_reserved_bytes", {"device": "cuda:0"}) == 4 << 30
    assert registry.get_sample_value("tokenwire_gpu_memory_total_bytes", {"device": "cuda:0"}) == 80 << 30
    assert registry.get_sample_value("tokenwire_gpu_utilization_ratio", {"device": "cuda:0"}) == 0.75
    assert registry.get_sample_value("tokenwire_gpu_memory_used_bytes", {"device": "cuda:0"}) == 5 << 30
    text = exposition(gpu)
    assert all(f"# TYPE {name} gauge" in text for name in CUDA_METRIC_NAMES + NVML_METRIC_NAMES)


def test_the_nvml_probe_reads_the_real_bindings_and_goes_without_a_driver(monkeypatch):
    """nvidia-ml-py (the gpu extra: the image has it, and so does this venv) is what the probe
    calls: here, with no NVIDIA driver, it finds none and the server has no NVML gauges; with
    one (a stand-in for the driver's answers, through the real module's names) each GPU's busy
    fraction and memory used."""
    import types

    import pynvml
    from tokenwire_server.metrics import nvml_probe

    assert nvml_probe() is None  # no driver here: nvmlInit fails, and no gauge is made
    answers = {
        "nvmlInit": lambda: None,
        "nvmlDeviceGetCount": lambda: 2,
        "nvmlDeviceGetHandleByIndex": lambda i: i,
        "nvmlDeviceGetUtilizationRates": lambda h: types.SimpleNamespace(gpu=40 + h),
        "nvmlDeviceGetMemoryInfo": lambda h: types.SimpleNamespace(used=(h + 1) << 30),
    }
    for name, answer in answers.items():
        assert hasattr(pynvml, name), name  # the names the probe calls are the bindings' own
        monkeypatch.setattr(pynvml, name, answer)
    probe = nvml_probe()
    assert probe is not None and probe() == {"cuda:0": (0.40, 1 << 30), "cuda:1": (0.41, 2 << 30)}


def test_on_one_gpu_the_weights_load_straight_onto_it(tiny_model_dir, monkeypatch):
    """No full copy in host RAM first: ``from_pretrained`` places each tensor on the device
    (``device_map``), and nothing is moved afterwards. (Faked: this machine has no GPU.)"""
    import transformers
    from tokenwire_server import model as model_module

    seen: dict = {}

    def from_pretrained(folder, **kwargs):
        seen.update(kwargs)
        raise RuntimeError("stop here")

    monkeypatch.setattr(model_module, "resolve_device", lambda device: "cuda")
    monkeypatch.setattr(model_module, "resolve_dtype", lambda dtype, device, gain=None: torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    with pytest.raises(model_module.ModelLoadError, match="stop here"):
        model_module.load_model(str(tiny_model_dir))
    assert seen["device_map"] == "cuda" and seen["dtype"] is torch.bfloat16
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(model_module.ModelLoadError, match="stop here"):
        model_module.load_model(str(tiny_model_dir))
    assert seen["device_map"] == "auto"  # several GPUs: accelerate spreads the layers


def test_a_process_capped_by_a_memory_fraction_sizes_from_its_cap_not_the_whole_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A 24 GB card tested on a 141 GB one (``set_per_process_memory_fraction``), or a shared
    GPU: the cap is the total, and free is the cap less what torch's allocator holds."""
    import torch
    from tokenwire_server.model import device_memory

    gib = 2**30
    device = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (120 * gib, 141 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: 16 * gib)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda d=None: 1.0)
    assert device_memory(device) == (141 * gib, 120 * gib)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda d=None: 24 / 141)
    total, free = device_memory(device)
    assert total == int(141 * gib * 24 / 141) and free == total - 16 * gib
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: 30 * gib)
    assert device_memory(device)[1] == 0  # past its cap: nothing free, never negative
