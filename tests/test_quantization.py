"""Weight quantization (``--quantization``, ``service/tokenwire_server/quantize.py``).

- What is offered where: int8 on any device; int4 and fp8 on CUDA only (fp8 from compute
  capability 8.9), each refusal saying why and what to use; a checkpoint that came
  quantized is refused on a CPU by name, with exit status 2, before any weight is read.
- An int8 layer: torchao's per-channel scales, close to the full-precision layer, both
  kernels (PyTorch's CPU weight-pack kernel and the dequantizing one every device runs)
  agree, and a row computes the same alone and beside other rows.
- On the tiny model: int8 replaces the linear weights (memory), the native pass runs the
  int8 layers with its fused q/k/v and gate/up and matches transformers' forward over the
  same layers, and a server says ``quantization: int8`` in ModelInfo.
- ``--dtype auto`` on a CPU: float32 without native bf16 or outside the native pass's packed
  GEMMs; else bf16 when its packed GEMMs measure at least ``BF16_GAIN_BAR`` faster (measured
  once per host and shapes, kept in the model cache); the reason names the instruction sets
  and the figures.
- (e2e) The default model answers the Paris question identically in none and int8.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import tokenwire_server.quantize as quantize
import torch
from engine_support import fresh_cache, run_all, slot_segment
from tokenwire_server.domain import FinishEvent, GenerationRequest, SamplingOptions
from tokenwire_server.engine import create_engine
from tokenwire_server.engine import native as native_module
from tokenwire_server.engine.base import EngineLimits
from tokenwire_server.engine.native import NativeForward, gemm_shapes, packed_gemm_gain, unsupported_reason
from tokenwire_server.model import (
    BF16_GAIN_BAR,
    ModelLoadError,
    bf16_gain,
    cpu_name,
    cpu_precision,
    load_model,
    precision_key,
)
from tokenwire_server.quantize import (
    INT8_GROUP,
    INT8_LAYERS,
    INT8_LAYOUT,
    Int8GroupLinear,
    Int8Linear,
    QuantizationError,
    int8_panel_library,
    int8_scheme,
    offered,
    pack_int8_panels,
    prequantized_method,
    quality_host,
    quality_mode,
    quantize_int8,
    quantize_int8_groups,
    quantize_model,
    unpack_int8_panels,
    weight_bytes,
)

pytestmark = pytest.mark.timeout(300)
CPU = torch.device("cpu")


def test_int8_is_offered_everywhere_int4_and_fp8_on_cuda_only_each_refusal_saying_why() -> None:
    assert offered("none", CPU) is None and offered("int8", CPU) is None
    assert "int8" in (offered("int4", CPU) or "") and "CPU" in (offered("int4", CPU) or "")
    assert "CUDA" in (offered("fp8", CPU) or "")
    cuda = torch.device("cuda")
    assert offered("int4", cuda, (8, 0)) is None
    assert offered("fp8", cuda, (9, 0)) is None and offered("fp8", cuda, (8, 9)) is None
    assert "8.9" in (offered("fp8", cuda, (8, 0)) or "")
    assert "unknown" in (offered("int3", CPU) or "")
    with pytest.raises(QuantizationError, match="--quantization int4"):
        quantize_model(torch.nn.Linear(4, 4), "int4", CPU)


@pytest.mark.parametrize(("mode", "config_name"), [("int4", "Int4WeightOnlyConfig"), ("fp8", "Float8WeightOnlyConfig")])
def test_int4_and_fp8_on_cuda_hand_the_model_to_torchaos_weight_only_configs(
    mode: str, config_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No GPU here: torchao's quantize_ is replaced by a recorder, to check the wiring (the
    config, its group size and packing: PyTorch's own tinygemm kernel for int4)."""
    import torchao.quantization as ao

    seen: list[object] = []
    monkeypatch.setattr(ao, "quantize_", lambda model, config: seen.append(config))
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    report = quantize_model(model, mode, torch.device("cuda"), (9, 0))
    (config,) = seen
    assert type(config).__name__ == config_name and report["kernel"] == "torchao" and report["linear_layers"] == 2
    if mode == "int4":
        assert config.group_size == 128 and config.int4_packing_format == "tile_packed_to_4d"  # type: ignore[attr-defined]


def test_weight_bytes_counts_what_torchaos_tensors_hold() -> None:
    """int4/fp8 on CUDA leave torchao tensor subclasses in the model; the start-up log's
    before/after bytes count their inner tensors (here torchao's int8 tensor, on a CPU)."""
    from torchao.quantization import Int8WeightOnlyConfig
    from torchao.quantization import quantize_ as ao_quantize

    model = torch.nn.Sequential(torch.nn.Linear(256, 128, bias=False))
    assert weight_bytes(model) == 256 * 128 * 4
    ao_quantize(model, Int8WeightOnlyConfig(set_inductor_config=False))
    assert type(model[0].weight).__name__ == "Int8Tensor"
    assert 256 * 128 <= weight_bytes(model) <= 256 * 128 + 128 * 8 + 64


def test_an_int8_layer_is_close_to_its_full_precision_layer_and_both_kernels_agree() -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 96, bias=True)
    qdata, scale = quantize_int8(linear.weight)
    assert qdata.dtype == torch.int8 and qdata.shape == (96, 256) and scale.shape == (96,)
    # Symmetric per channel (torchao: scale = largest |w| / 127.5): every row's largest
    # weight lands at the end of the int8 range.
    assert int(qdata.abs().amax(dim=1).min()) >= 126
    dequantized = qdata.float() * scale[:, None]
    assert (dequantized - linear.weight).abs().max() <= scale.max() / 2 + 1e-6
    x = torch.randn(5, 256)
    want = linear(x)
    for kernel in ("int8pack", "dequant"):
        layer = Int8Linear.from_linear(linear, kernel)
        got = layer(x)
        assert got.dtype == torch.float32 and got.shape == (5, 96)
        # bf16 activations (int8pack) round at ~3 significant digits: a few parts in a thousand.
        assert (got - want).abs().max() / want.abs().max() < 0.02, kernel
    three_d = Int8Linear.from_linear(linear, "dequant")(x.view(5, 1, 256))
    assert three_d.shape == (5, 1, 96)


@pytest.mark.parametrize("kernel", ["int8pack", "dequant"])
def test_an_int8_row_computes_the_same_alone_and_beside_other_rows(kernel: str) -> None:
    """PyTorch's CPU kernel computes each row on its own: bit for bit. The dequantizing
    kernel is a float GEMM, whose blocking (and so its rounding) may follow the row count,
    as F.linear's does: equal to float32 rounding."""
    torch.manual_seed(1)
    layer = Int8Linear.from_linear(torch.nn.Linear(576, 960, bias=False), kernel)
    x = torch.randn(16, 576)
    together = layer(x)
    for row in range(16):
        alone = layer(x[row : row + 1])[0]
        if kernel == "int8pack":
            assert torch.equal(alone, together[row]), row
        else:
            assert (alone - together[row]).abs().max() < 1e-5, row


def _tiny_int8(tiny_model_dir: Path):  # type: ignore[no-untyped-def]
    return load_model(str(tiny_model_dir), device="cpu", dtype="float32", quantization="int8")


def test_int8_replaces_every_linear_weight_and_says_so(tiny_model_dir: Path) -> None:
    full = load_model(str(tiny_model_dir), device="cpu", dtype="float32")
    quantized = _tiny_int8(tiny_model_dir)
    assert quantized.quantization == "int8" and full.quantization == "none"
    linears = [m for m in quantized.model.modules() if isinstance(m, torch.nn.Linear)]
    int8 = [m for m in quantized.model.modules() if isinstance(m, INT8_LAYERS)]
    assert linears == [] and len(int8) == 7 * quantized.model.config.num_hidden_layers + 1
    # One scheme for every layer: the groups where this CPU runs the compiled 8-bit panels.
    assert {m.kernel for m in int8} == ({"groups"} if int8_scheme(CPU) == "groups" else {"int8pack"})
    full_linear = sum(m.weight.numel() * 4 for m in full.model.modules() if isinstance(m, torch.nn.Linear))
    # Each linear weight: 1 byte instead of 4, plus its scales (and zero points: 48 bytes per
    # 16 columns and group, float16 scales); the embedding stays as it was.
    per_weight = 1 + 48 / (16 * INT8_GROUP) if int8_scheme(CPU) == "groups" else 1 + 4 / 64
    assert weight_bytes(full.model) - weight_bytes(quantized.model) == pytest.approx(
        full_linear * (1 - per_weight / 4) - full.model.get_input_embeddings().weight.numel() * 4, rel=0.01
    )


@pytest.mark.skipif(sys.platform != "linux", reason="madvise and /proc are Linux's")
def test_quantizing_gives_the_checkpoints_pages_back(tiny_model_factory: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The checkpoint is mmapped, and quantizing reads every linear weight once: each layer's
    source pages go back as it is quantized, or the file stays resident beside its int8 copy
    (loading the default model in int8: 1.12 GB resident, 0.61 GB with them given back). An
    untied head (12 MiB here) is read whole; afterwards the mapping holds a page or two."""
    from test_native_forward import resident_kib

    folder = tiny_model_factory("untied", tie=False)

    def resident_after_load() -> int:
        loaded = load_model(str(folder), device="cpu", dtype="float32", quantization="int8", native_only=True)
        embed = loaded.model.model.embed_tokens.weight  # still in the mapping: its pages were never read
        return resident_kib(embed.data_ptr())

    assert resident_after_load() < 1024
    monkeypatch.setattr(native_module, "page_out", lambda *args, **kwargs: None)
    assert resident_after_load() > 12 * 1024  # the check can fail: without page_out the head stays


def _needs_int8_panels() -> Any:
    library = int8_panel_library()
    if library is None:
        pytest.skip("the compiled 8-bit panels need an x86 CPU with AVX-512BW and AVX512-VNNI and a C++ compiler")
    return library


@pytest.mark.parametrize("group", [16, 32])
def test_int8_groups_pack_torchaos_weights_and_the_panels_compute_their_product(
    group: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The groups scheme: torchao's asymmetric uint8 weights per channel and group (every group's
    smallest and largest weight at the ends of the range); the panels unpack to exactly its
    dequantized weight; ``panel_linear`` over them is that weight's product, the bias and the
    residual, up to the int16 rounding of the inputs (a few parts in 100,000)."""
    library = _needs_int8_panels()
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 96, bias=True)
    q, zero, scale = quantize_int8_groups(linear.weight, group)
    assert q.dtype == zero.dtype == torch.uint8 and q.shape == (96, 256)
    assert scale.shape == zero.shape == (96, 256 // group) and scale.dtype == torch.float16
    groups = q.view(96, -1, group)
    assert int(groups.amin(-1).max()) <= 1 and int(groups.amax(-1).min()) >= 254
    dequantized = ((groups.float() - zero[..., None].float()) * scale[..., None]).view(96, 256)
    assert (dequantized - linear.weight).abs().max() <= scale.max() / 2 + 1e-6
    panels = pack_int8_panels(q, zero, scale, group)
    assert panels.shape == (6, 256 // group, 16 * group + 48) and panels.dtype == torch.uint8
    assert torch.equal(unpack_int8_panels(panels), dequantized)
    x, residual = torch.randn(7, 256), torch.randn(7, 96)
    want = x.double() @ dequantized.double().T + linear.bias.double() + residual.double()
    got = library.panel_linear(x, panels, linear.bias.detach(), residual)
    assert ((got - want).norm() / want.norm()).item() < 1e-4
    layer = Int8GroupLinear(panels, linear.bias, library)
    # Quantized a block of rows at a time (as a vocabulary projection is): the same panels.
    monkeypatch.setattr(quantize, "QUANTIZE_ROWS", 32)
    assert torch.equal(Int8GroupLinear.from_weight(linear.weight, None, library, group).panels, panels)
    alone = library.panel_linear(x, panels, linear.bias.detach(), None)
    assert torch.equal(layer(x.view(7, 1, 256)).view(7, 96), alone)
    assert torch.equal(layer.plus(x, residual), got)


def test_int8_panels_refuse_what_they_cannot_read() -> None:
    library = _needs_int8_panels()
    panels = pack_int8_panels(*quantize_int8_groups(torch.randn(32, 64), 32), 32)
    with pytest.raises(RuntimeError, match="x has 96 columns, the 8-bit panels 64"):
        library.panel_linear(torch.randn(2, 96), panels, None, None)
    with pytest.raises(RuntimeError, match="group even"):
        library.panel_linear(torch.randn(2, 64), torch.zeros(2, 2, 81, dtype=torch.uint8), None, None)


def test_a_model_whose_layers_do_not_fill_the_panels_takes_per_channel_int8(caplog: pytest.LogCaptureFixture) -> None:
    """One scheme per model (fused layers share one): a layer of 40 outputs is no whole panel."""
    _needs_int8_panels()
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 40))
    report = quantize_model(model, "int8", CPU)
    assert report["kernel"] == "int8pack" and all(isinstance(m, Int8Linear) for m in model)
    assert "per-channel int8 instead" in caplog.text
    whole = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 48))
    assert quantize_model(whole, "int8", CPU)["kernel"] == "groups"
    assert all(isinstance(m, Int8GroupLinear) for m in whole)


@pytest.mark.parametrize("kernel", ["dequant", "int8pack", "groups"])
def test_the_native_pass_runs_int8_layers_fused_and_matches_transformers_forward_on_them(
    tiny_model_dir: Path, kernel: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same int8 layers both ways. With float activations (``dequant``) only the order of
    float additions differs: within 1e-3, as for float32. ``groups`` rounds each row's inputs to
    int16 on the row's own scale: a last-bit difference upstream moves an input by one step of
    its 65,535, within a part in 1,000 of the logits' scale. With bf16 activations (``int8pack``)
    it can round a bf16 input the other way: within a few parts in a hundred of the logits'
    scale, and the same next token nearly everywhere."""
    if kernel == "groups":
        _needs_int8_panels()
    else:  # the per-channel scheme, as a CPU without the 8-bit panels takes it
        monkeypatch.setattr(quantize, "int8_panel_library", lambda: None)
    loaded = _tiny_int8(tiny_model_dir)
    model = loaded.model
    for module in model.modules():
        if isinstance(module, Int8Linear) and module.kernel != kernel:
            module.kernel, module.scale = (
                kernel,
                module.scale.float() if kernel == "dequant" else module.scale.to(torch.bfloat16),
            )
    assert unsupported_reason(model) is None
    native = NativeForward(model, fresh_cache(model), batch_hint=4)
    assert native.quantized
    layer_kind = Int8GroupLinear if kernel == "groups" else Int8Linear
    assert isinstance(native.layers[0].qkv, layer_kind) and isinstance(native.lm_head, layer_kind)
    assert native.layers[0].qkv.kernel == kernel
    heads, kv, dim = native.heads, native.kv_heads, native.head_dim
    assert native.layers[0].qkv.out_features == (heads + 2 * kv) * dim
    ids = torch.randint(10, loaded.vocab_size, (21,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.inference_mode():
        want = model(input_ids=torch.tensor([ids])).logits[0].float()
    got = native(torch.tensor(ids), torch.arange(21), [slot_segment(0, 0, 21)], list(range(21)))
    if kernel == "dequant":
        assert (got - want).abs().max().item() < 1e-3
    elif kernel == "groups":
        assert (got - want).abs().max().item() < 1e-3 * want.abs().max().item()
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    else:
        assert (got - want).abs().max().item() < 0.05 * want.abs().max().item()
        assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.9


@pytest.mark.parametrize("engine", ["batched", "simple"])
def test_a_server_with_int8_serves_and_says_so_in_model_info(tiny_model_dir: Path, engine: str) -> None:
    from servers import ServerProcess
    from tokenwire import Client

    args = ["--model", str(tiny_model_dir), "--engine", engine, "--quantization", "int8", "--allow-unmet-quality-bar"]
    with ServerProcess(args) as server, Client(server.target) as client:
        info = client.model_info()
        assert (info.quantization, info.engine) == ("int8", engine)
        last = list(client.generate("Hello", max_new_tokens=6, ignore_eos=True))[-1]
        assert last.usage is not None and last.usage.completion_tokens == 6


def _prequantized_folder(tmp_path: Path, tiny_model_dir: Path, method: str) -> Path:
    folder = tmp_path / f"{method}-model"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": method, "bits": 4, "group_size": 128}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_a_folder_converted_from_gguf_is_full_precision_not_prequantized(default_model_dir: Path) -> None:
    """The default model's folder keeps transformers' GGUF marker over float32 safetensors."""
    config = json.loads((default_model_dir / "config.json").read_text())
    assert prequantized_method(config) is None
    assert prequantized_method({"quantization_config": {"quant_method": "gguf"}}) is None
    assert prequantized_method({"quantization_config": {"quant_method": "awq"}}) == "awq"
    assert prequantized_method({}) is None


@pytest.mark.parametrize("method", ["gptq", "awq", "bitsandbytes"])
def test_a_prequantized_checkpoint_on_a_cpu_is_refused_by_name(
    tmp_path: Path, tiny_model_dir: Path, method: str
) -> None:
    folder = _prequantized_folder(tmp_path, tiny_model_dir, method)
    assert prequantized_method(json.loads((folder / "config.json").read_text())) == method
    with pytest.raises(ModelLoadError, match=rf"already quantized \({method}\).*CUDA.*--quantization int8"):
        load_model(str(folder), device="cpu")


def test_a_prequantized_checkpoint_stops_the_server_with_status_2_and_the_reason(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    folder = _prequantized_folder(tmp_path, tiny_model_dir, "gptq")
    proc = subprocess.run(
        [sys.executable, "-m", "tokenwire_server", "--model", str(folder), "--device", "cpu", "--port", "0",
         "--no-warmup"],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "already quantized (gptq)" in proc.stderr and "--quantization int8" in proc.stderr


def test_int4_on_a_cpu_stops_the_server_with_status_2_before_loading(tiny_model_dir: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "tokenwire_server", "--model", str(tiny_model_dir), "--quantization", "int4",
         "--port", "0", "--device", "cpu"],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "--quantization int4: int4 is not offered on a CPU" in proc.stderr


def _quality_table(path: Path, meets: bool, layout: str = INT8_LAYOUT) -> Path:
    entry = {
        "kl": 0.005,
        "kl_max": 0.01,
        "identical": 15 if meets else 5,
        "of": 16,
        "parted_median": 32,
        "meets_bar": meets,
        "bar_identical": 11,
        "host": "test",
        "measured": "now",
        "layout": layout,
    }
    # Every kind of CPU host has an entry, so the gate reads one whichever this CPU is.
    kinds = {"cpu-bf16-rounded": entry, "cpu-bf16-exact": entry}
    path.write_text(
        json.dumps(
            {
                "bar": {"kl": 0.01, "of": 16, "greedy_tokens": 32, "below_bf16": 2},
                # int8's two schemes, so the gate reads its entry whichever this CPU takes
                "modes": {"int8": kinds, "int8-channel": kinds},
            }
        )
    )
    return path


def test_the_quality_gate_refuses_a_mode_measured_below_the_bar_unless_the_operator_accepts_it(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tokenwire_server.quantize as quantize

    assert quantize.quality_verdict("int8", "cuda", _quality_table(tmp_path / "q.json", False))[0] is None
    assert quantize.quality_verdict("int8", "cpu", tmp_path / "missing.json")[0] is None
    meets, figures = quantize.quality_verdict("int8", "cpu", tmp_path / "q.json")
    assert meets is False and "5/16" in figures and "KL 0.0050" in figures and ">= 11/16" in figures
    # Figures of other kinds of host, or of other int8 panels, are not this host's verdict.
    assert quantize.quality_verdict("int8", "cpu", tmp_path / "q.json", host="cpu-other")[0] is None
    _quality_table(tmp_path / "old.json", False, layout="groups of 16, float32 scales")
    meets, figures = quantize.quality_verdict("int8", "cpu", tmp_path / "old.json")
    if quality_mode("int8", CPU) == "int8":  # the groups: their layout is checked
        assert meets is None and "other panels" in figures
    monkeypatch.setattr(quantize, "QUALITY_FILE", tmp_path / "q.json")
    with pytest.raises(ModelLoadError, match=r"misses the quality bar on cpu.*5/16.*--allow-unmet-quality-bar"):
        load_model(str(tiny_model_dir), device="cpu", quantization="int8", allow_unmet_quality_bar=False)
    assert (
        load_model(str(tiny_model_dir), device="cpu", quantization="int8", allow_unmet_quality_bar=True).quantization
        == "int8"
    )
    _quality_table(tmp_path / "q.json", True)
    assert (
        load_model(str(tiny_model_dir), device="cpu", quantization="int8", allow_unmet_quality_bar=False).quantization
        == "int8"
    )


def test_the_server_applies_the_measured_verdict_that_ships_with_it(tiny_model_dir: Path) -> None:
    """quality.json is what make bench-quality measured on the default model: a server asked
    for int8 on a CPU starts or refuses by it, and says why when it refuses."""
    from tokenwire_server.quantize import QUALITY_FILE

    # The verdict from the shipped figures against the bar, read here, not by the function under test.
    table = json.loads(QUALITY_FILE.read_text())
    # The repository ships a CPU measurement of int8's both schemes; this CPU takes one of them.
    assert {"int8", "int8-channel"} <= set(table["modes"])
    mode = quality_mode("int8", CPU)
    for kind, entry in table["modes"][mode].items():  # each stored verdict is the one its figures give
        bar = table["bar"]
        assert entry["bar_identical"] == table["modes"]["bfloat16"][kind]["identical"] - bar["below_bf16"], kind
        figured = entry["kl"] <= bar["kl"] and entry["identical"] >= entry["bar_identical"] and entry["of"] == bar["of"]
        assert entry["meets_bar"] is figured, (kind, entry)
    entry = table["modes"][mode].get(quality_host("cpu"))
    current = entry is not None and (mode != "int8" or entry.get("layout") == INT8_LAYOUT)
    meets = bool(entry["meets_bar"]) if current else None  # None: not measured on this kind of host (a warning)
    args = ["--model", str(tiny_model_dir), "--quantization", "int8", "--device", "cpu"]
    if meets is not False:
        from servers import ServerProcess
        from tokenwire import Client

        with ServerProcess(args) as server, Client(server.target) as client:
            assert client.model_info().quantization == "int8"
        return
    proc = subprocess.run(
        [sys.executable, "-m", "tokenwire_server", *args, "--port", "0"], capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "misses the quality bar on cpu" in proc.stderr and "--allow-unmet-quality-bar" in proc.stderr


def test_a_gpu_torch_cannot_use_is_said_at_start_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A host with an NVIDIA device node and a CPU-only torch (an image built without
    HAS_GPU=1) would serve on its CPU in silence: the start-up log says why instead."""
    from tokenwire_server.model import gpu_without_cuda

    assert gpu_without_cuda(str(tmp_path / "nvidia[0-9]*")) is None  # no GPU: nothing to say
    (tmp_path / "nvidia0").touch()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    said = gpu_without_cuda(str(tmp_path / "nvidia[0-9]*"))
    assert said is not None and "nvidia0 is present" in said and "sees no CUDA device" in said
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert gpu_without_cuda(str(tmp_path / "nvidia[0-9]*")) is None  # torch sees it: all is well


def never_measured() -> tuple[dict[int, float], str]:
    raise AssertionError("measured where it should not be")


def test_dtype_auto_on_a_cpu_takes_bf16_only_where_it_is_native_and_measured_faster() -> None:
    """float32 without native bf16 (never measured), or when the model would not run through
    the packed GEMMs; else bf16 when it measures at least the bar faster at 1 and 16 rows."""
    dtype, why = cpu_precision({"avx2": True, "fma3": True}, never_measured)
    assert dtype == torch.float32 and "no native bf16" in why and "avx2" in why
    amx = {"avx2": True, "avx512_f": True, "amx_tile": True, "amx_bf16": True}
    dtype, why = cpu_precision(amx)
    assert dtype == torch.float32 and "amx_bf16" in why and "packed GEMMs" in why and "--dtype bfloat16" in why

    def gain(one: float, sixteen: float) -> Any:
        return lambda: ({1: one, 16: sixteen}, "measured now in 0.40 s")

    dtype, why = cpu_precision(amx, gain(1.6, 1.5))
    assert dtype == torch.bfloat16
    assert why.startswith("bfloat16:") and "1.60x at 1 row, 1.50x at 16 rows" in why and "measured now" in why
    dtype, why = cpu_precision({"avx512_f": True, "avx512_bf16": True}, gain(1.6, BF16_GAIN_BAR - 0.01))
    assert dtype == torch.float32 and why.startswith("float32:") and "avx512_bf16" in why
    assert cpu_precision(amx, gain(BF16_GAIN_BAR, BF16_GAIN_BAR))[0] == torch.bfloat16  # the bar itself passes


def test_the_bf16_measurement_is_made_once_per_host_and_shapes_and_kept_in_the_model_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[list[tuple[int, int]]] = []

    def measure(shapes: list[tuple[int, int]], rows: tuple[int, ...]) -> dict[int, float]:
        calls.append(shapes)
        return {count: 1.5 + len(calls) / 10 for count in rows}

    monkeypatch.setattr(native_module, "packed_gemm_gain", measure)
    shapes = [(96, 64), (64, 64), (49152, 64)]
    gains, source = bf16_gain(shapes, str(tmp_path))
    assert gains == {1: 1.6, 16: 1.6} and source.startswith("measured now") and len(calls) == 1
    kept = json.loads((tmp_path / "precision.json").read_text())
    assert list(kept) == [precision_key(shapes)] and kept[precision_key(shapes)]["gains"] == {"1": 1.6, "16": 1.6}
    assert torch.__version__ in precision_key(shapes) and cpu_name() in precision_key(shapes)

    again, source = bf16_gain(shapes, str(tmp_path))  # read back, not measured
    assert again == gains and "measured on this host at" in source and len(calls) == 1
    other = [(128, 64), (49152, 64)]
    assert bf16_gain(other, str(tmp_path))[0] == {1: 1.7, 16: 1.7} and len(calls) == 2  # other shapes: measured
    assert len(json.loads((tmp_path / "precision.json").read_text())) == 2  # both kept

    (tmp_path / "precision.json").write_text("{not json")  # a broken file: measured again, and replaced
    assert bf16_gain(shapes, str(tmp_path))[0] == {1: 1.8, 16: 1.8} and len(calls) == 3
    assert list(json.loads((tmp_path / "precision.json").read_text())) == [precision_key(shapes)]
    unwritable = tmp_path / "file"
    unwritable.write_text("")  # a cache "dir" that cannot be made: measured, used, not kept
    assert bf16_gain(shapes, str(unwritable))[0] == {1: 1.9, 16: 1.9}


def test_replicas_starting_together_measure_once_and_choose_alike(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Starts that race on one host: the first measures under the file's lock, the others wait
    and read its figures (without the lock each measures, and a noisy host may part them)."""
    calls: list[float] = []

    def measure(shapes: list[tuple[int, int]], rows: tuple[int, ...]) -> dict[int, float]:
        calls.append(time.monotonic())
        time.sleep(0.3)  # long enough for every other start to reach the lock
        return {count: 1.2 + len(calls) / 10 for count in rows}

    monkeypatch.setattr(native_module, "packed_gemm_gain", measure)
    shapes = [(96, 64), (49152, 64)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:  # each opens the lock file itself
        results = list(pool.map(lambda _: bf16_gain(shapes, str(tmp_path)), range(4)))
    assert len(calls) == 1
    assert [gains for gains, _ in results] == [{1: 1.3, 16: 1.3}] * 4
    assert sum(source.startswith("measured now") for _, source in results) == 1


def test_the_packed_bf16_gemms_are_measured_as_the_pass_runs_them() -> None:
    """The measurement itself (small shapes: no claim about speed, only that both arms ran)."""
    gains = packed_gemm_gain([(64, 32), (32, 64)], (1, 4), repeats=1)
    assert set(gains) == {1, 4} and all(value > 0 and math.isfinite(value) for value in gains.values())
    smollm2 = SimpleNamespace(
        model_type="llama", hidden_act="silu", hidden_size=576, intermediate_size=1536, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, num_hidden_layers=30, vocab_size=49152,
    )  # fmt: skip
    shapes = gemm_shapes(smollm2)
    assert shapes is not None and len(shapes) == 4 * 30 + 1
    assert shapes[:4] == [(15 * 64, 576), (576, 576), (3072, 576), (576, 1536)] and shapes[-1] == (49152, 576)
    assert sum(o * i for o, i in shapes) == 134_479_872  # the default model's GEMM weights (its 135M, tied head)
    assert gemm_shapes(SimpleNamespace(model_type="gpt2")) is None
    assert gemm_shapes(SimpleNamespace(**{**vars(smollm2), "hidden_act": "gelu"})) is None


@pytest.mark.parametrize(
    ("isa", "gain", "packed_native", "quantization", "want"),
    [
        pytest.param({"avx512_bf16": True}, 2.0, True, "none", torch.bfloat16, id="native-faster"),
        pytest.param({"avx512_bf16": True}, 1.0, True, "none", torch.float32, id="native-not-faster"),
        pytest.param({"avx512_bf16": True}, None, False, "none", torch.float32, id="not-the-packed-pass"),
        pytest.param({"avx512_bf16": True}, None, True, "int8", torch.float32, id="int8"),
        pytest.param({"avx2": True}, None, True, "none", torch.float32, id="no-native-bf16"),
    ],
)
def test_load_model_weighs_bf16_only_for_the_packed_native_pass(
    tiny_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    isa: dict[str, bool],
    gain: float | None,
    packed_native: bool,
    quantization: str,
    want: torch.dtype,
) -> None:
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: isa)

    def measure(shapes: list[tuple[int, int]], rows: tuple[int, ...]) -> dict[int, float]:
        assert gain is not None, "measured where it should not be"
        config = json.loads((tiny_model_dir / "config.json").read_text(), object_hook=lambda d: SimpleNamespace(**d))
        assert shapes == gemm_shapes(config)
        return {count: gain for count in rows}

    monkeypatch.setattr(native_module, "packed_gemm_gain", measure)
    loaded = load_model(
        str(tiny_model_dir), device="cpu", dtype="auto", cache_dir=str(tmp_path), quantization=quantization,
        allow_unmet_quality_bar=True, packed_native=packed_native,
    )  # fmt: skip
    assert loaded.dtype == want and next(loaded.model.parameters()).dtype == want
    assert loaded.dtype_name == str(want).removeprefix("torch.")


@pytest.mark.e2e
def test_the_default_model_answers_the_paris_question_the_same_in_none_and_int8(default_model_dir: Path) -> None:
    """Through the batched engine (its native pass), greedy, to the end of the answer."""
    answers = []
    for mode in ("none", "int8"):
        loaded = load_model(str(default_model_dir), device="cpu", dtype="float32", quantization=mode)
        tok = loaded.tokenizer
        ids = tok.apply_chat_template(
            [{"role": "user", "content": "What is the capital of France?"}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        engine = create_engine("batched", loaded, EngineLimits(4, 4, 4 * 2048), workers=1)
        engine.start()
        try:
            (got,) = run_all(
                engine, [GenerationRequest(f"paris-{mode}", list(ids), SamplingOptions(temperature=0.0), 40)]
            )
        finally:
            engine.close()
        assert isinstance(got.last, FinishEvent)
        answers.append(got.text)
    assert "Paris" in answers[0]
    assert answers[1] == answers[0]
