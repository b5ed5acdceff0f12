"""A Llama checkpoint read without transformers' model code (``tokenwire_server.checkpoint``):
the same weights, config and answers as transformers' reading, a converted copy kept in the
cache, transformers for whatever it cannot read exactly, and the start-up it exists for."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import typing
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_support import run_all
from tokenwire_server import checkpoint
from tokenwire_server.domain import GenerationRequest, SamplingOptions
from tokenwire_server.engine import create_engine
from tokenwire_server.engine.base import EngineLimits
from tokenwire_server.model import load_model, load_tokenizer, record_added_tokens

# What the engine and the server read from a model's config.
CONFIG_FIELDS = (
    "model_type", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size",
    "intermediate_size", "rms_norm_eps", "vocab_size", "max_position_embeddings", "tie_word_embeddings",
    "hidden_act", "pretraining_tp", "bos_token_id", "eos_token_id", "pad_token_id",
)  # fmt: skip


@pytest.fixture(scope="module")
def untied_dir(tiny_model_factory: Any) -> Path:
    return Path(tiny_model_factory("tiny-untied", tie=False, seed=3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_reads_the_weights_config_and_rope_transformers_reads(
    tiny_model_dir: Path, untied_dir: Path, dtype: torch.dtype, tied: bool
) -> None:
    from transformers import AutoModelForCausalLM

    folder = tiny_model_dir if tied else untied_dir
    assert checkpoint.refusal(folder) is None
    plain = checkpoint.load(folder, dtype)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    ours, theirs = dict(plain.named_parameters()), dict(reference.named_parameters())
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype and torch.equal(ours[name], tensor), name
    head_is_table = plain.lm_head.weight.data_ptr() == plain.model.embed_tokens.weight.data_ptr()
    assert head_is_table == tied
    for field in CONFIG_FIELDS:
        assert getattr(plain.config, field) == getattr(reference.config, field), field
    assert plain.generation_config.to_dict() == reference.generation_config.to_dict()
    positions = torch.tensor([[0, 1, 7, 100, 1023]])
    for x in (torch.zeros(1, dtype=torch.float32), torch.zeros(1, dtype=torch.bfloat16)):
        for ours_table, theirs_table in zip(
            plain.model.rotary_emb(x, positions), reference.model.rotary_emb(x, positions), strict=True
        ):
            assert torch.equal(ours_table, theirs_table)


def test_llama_defaults_are_transformers_own(tmp_path: Path) -> None:
    """A config.json that leaves fields out reads as LlamaConfig would fill them."""
    from transformers import LlamaConfig

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    ours = checkpoint._config(tmp_path)
    theirs = LlamaConfig()
    for field in CONFIG_FIELDS[1:]:
        assert ours[field] == getattr(theirs, field), field
    assert checkpoint._rope_theta(ours) == theirs.rope_parameters["rope_theta"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_native_pass_answers_the_same_on_either_reading(tiny_model_dir: Path, dtype: str) -> None:
    prompts = [[1, 2, 3, 4, 5], [7] * 19, list(range(30, 60))]
    answers = {}
    for native_only in (False, True):
        loaded = load_model(str(tiny_model_dir), dtype=dtype, native_only=native_only)
        assert isinstance(loaded.model, checkpoint.PlainLlama) == native_only
        engine = create_engine("batched", loaded, EngineLimits(4, 8, 4096), forward="native")
        engine.start()
        try:
            requests = [
                GenerationRequest(f"r{i}", p, SamplingOptions(temperature=0.0), 16, ignore_eos=True, want_tokens=True)
                for i, p in enumerate(prompts)
            ] + [GenerationRequest("s", prompts[0], SamplingOptions(temperature=0.9, seed=5), 16, ignore_eos=True)]
            answers[native_only] = [rec.token_ids or rec.text for rec in run_all(engine, requests, 120)]
        finally:
            engine.close()
    assert answers[True] == answers[False]
    assert all(answers[True])


def _edited(source: Path, target: Path, **changes: Any) -> Path:
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    config.update(changes)
    (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.mark.parametrize(
    ("changes", "why"),
    [
        ({"architectures": ["MistralForCausalLM"]}, "architectures"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}, "rope type 'linear'"),
        ({"attention_bias": True}, "attention_bias"),
        ({"quantization_config": {"quant_method": "gguf"}}, "quantization_config"),
        ({"num_hidden_layers": 3}, "missing ['model.layers.2."),
        ({"vocab_size": 1000}, "model.embed_tokens.weight (49152, 64) (config: (1000, 64))"),
        ({"num_key_value_heads": 4}, "model.layers.0.self_attn.k_proj.weight (32, 64) (config: (64, 64))"),
    ],
    ids=["architecture", "rope-scaling", "bias", "quantized", "tensor-names", "vocab-size", "kv-heads"],
)
def test_what_it_cannot_read_exactly_is_refused_with_why(
    tiny_model_dir: Path, tmp_path: Path, changes: dict[str, Any], why: str
) -> None:
    folder = _edited(tiny_model_dir, tmp_path / "model", **changes)
    reason = checkpoint.refusal(folder)
    assert reason is not None and why in reason


def test_a_refused_checkpoint_is_read_by_transformers(tiny_model_factory: Any) -> None:
    biased = Path(tiny_model_factory("tiny-bias", bias=True))
    assert checkpoint.refusal(biased) == "attention_bias"
    loaded = load_model(str(biased), native_only=True)
    assert not isinstance(loaded.model, checkpoint.PlainLlama)
    assert type(loaded.model).__name__ == "LlamaForCausalLM"


def test_it_runs_through_the_native_pass_only(tiny_model_dir: Path) -> None:
    loaded = load_model(str(tiny_model_dir), native_only=True)
    with pytest.raises(ValueError, match="read for the native pass alone"):
        create_engine("batched", loaded, EngineLimits(4, 8, 4096), forward="transformers")
    with pytest.raises(RuntimeError, match="native pass only"):
        loaded.model(input_ids=torch.tensor([[1, 2]]))


def test_a_converted_copy_is_kept_in_the_cache_and_mapped_next_time(tiny_model_dir: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    folder = cache / "model"
    shutil.copytree(tiny_model_dir, folder)
    first = checkpoint.load(folder, torch.bfloat16, cache)
    kept = cache / "converted" / "model.bfloat16.safetensors"
    assert kept.is_file()
    second = checkpoint.load(folder, torch.bfloat16, cache)
    for (name, a), (_, b) in zip(first.named_parameters(), second.named_parameters(), strict=True):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b), name
    # A checkpoint newer than its copy is converted again (and the copy replaced).
    os.utime(kept, (1, 1))
    checkpoint.load(folder, torch.bfloat16, cache)
    assert kept.stat().st_mtime > 1
    # Weights already in the dtype asked for are mapped as they are: no copy.
    checkpoint.load(folder, torch.float32, cache)
    assert not (cache / "converted" / "model.float32.safetensors").exists()
    # A folder outside the cache is not written beside.
    outside = checkpoint.load(tiny_model_dir, torch.bfloat16, cache)
    assert sorted(p.name for p in (cache / "converted").iterdir()) == ["model.bfloat16.safetensors"]
    assert outside.dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gemm_panels_are_kept_in_the_cache_and_mapped_next_time(
    tiny_model_dir: Path, tmp_path: Path, dtype: torch.dtype
) -> None:
    """The native pass's panels, laid out at a first start, are kept beside the converted
    weights; the next start maps them, bit for bit the layout it would make, and lays out again
    whatever does not match: a panel of another shape, weights newer than the file."""
    from engine_support import fresh_cache
    from tokenwire_server.engine import native, panel_store

    if native.panel_library() is None:
        pytest.skip("the panels run on the compiled ops, on an AVX-512F CPU")
    cache = tmp_path / "cache"
    folder = cache / "model"
    shutil.copytree(tiny_model_dir, folder)

    def start() -> native.NativeForward:
        model = checkpoint.load(folder, dtype, cache)
        return native.NativeForward(model, fresh_cache(model), 16, release_weights=True)

    def panels(forward: native.NativeForward) -> dict[str, torch.Tensor]:
        gemms = {"lm_head": forward.lm_head}
        for i, layer in enumerate(forward.layers):
            gemms |= {f"layers.{i}.{n}": getattr(layer, n) for n in ("qkv", "out", "gate_up", "down")}
        return {name: typing.cast(torch.Tensor, native.panel_weights(gemm)) for name, gemm in gemms.items()}

    first = start()
    laid_out = panels(first)
    assert first.panels_mapped == 0 and all(p is not None for p in laid_out.values())
    (kept,) = (cache / "packed").iterdir()
    assert kept.name.startswith(f"model.{str(dtype).removeprefix('torch.')}.panels16")
    written = kept.stat().st_mtime_ns
    second = start()
    assert second.panels_mapped == len(laid_out)
    mapped = panels(second)
    for name, tensor in laid_out.items():
        assert mapped[name].dtype == tensor.dtype and torch.equal(mapped[name], tensor), name
    assert kept.stat().st_mtime_ns == written  # all mapped: nothing to write
    # One panel of another shape: that layer is laid out again, and the file written afresh.
    wrong = dict(laid_out)
    wrong["layers.0.out"] = laid_out["layers.0.out"][:, :8].contiguous()
    checkpoint.write_safetensors(kept, wrong, {"layout": str(panel_store.LAYOUT)})
    third = start()
    assert third.panels_mapped == len(laid_out) - 1
    assert torch.equal(panels(third)["layers.0.out"], laid_out["layers.0.out"])
    assert start().panels_mapped == len(laid_out)
    # Weights newer than the file: all laid out again.
    os.utime(kept, (1, 1))
    assert start().panels_mapped == 0 and kept.stat().st_mtime > 1 and kept.stat().st_mtime_ns != written
    # Another layout's file is not read.
    checkpoint.write_safetensors(kept, laid_out, {"layout": "0"})
    assert start().panels_mapped == 0
    # A folder outside the cache keeps nothing.
    outside = checkpoint.load(tiny_model_dir, dtype, cache)
    assert native.NativeForward(outside, fresh_cache(outside), 16).panels_mapped == 0
    assert [p.name for p in (cache / "packed").iterdir()] == [kept.name]


def test_the_direct_tokenizer_is_the_one_autotokenizer_picks(default_model_dir: Path, tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer
    from transformers.models.auto.tokenization_auto import MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS

    assert "llama" not in MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS  # else AutoTokenizer picks another class
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi ünïcode 🙂"}]
    for folder in (default_model_dir, tiny_model_dir):
        ours, theirs = load_tokenizer(folder), AutoTokenizer.from_pretrained(folder)
        assert type(ours) is type(theirs) and type(ours).__name__ == "TokenizersBackend"
        for text in ("Hello world", "  spaces\tand\nlines ", "<|im_start|>user\nñ 🙂 中文<|im_end|>"):
            assert ours(text)["input_ids"] == theirs(text)["input_ids"]
            ids = theirs(text)["input_ids"]
            assert ours.decode(ids) == theirs.decode(ids)
        assert ours.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == (
            theirs.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        )
        assert ours.all_special_ids == theirs.all_special_ids and len(ours) == len(theirs)


def test_recorded_added_tokens_spare_parsing_tokenizer_json(
    default_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The converted folder's tokenizer_config.json carries the added tokens
    (``record_added_tokens``), so loading the tokenizer does not parse the 3.5 MB tokenizer.json
    with Python's json (docs/benchmarks.md, "Start-up"), and gives the same tokenizer as the
    folder transformers 5 saves, which lacks them."""
    import transformers.tokenization_utils_base as base

    assert "added_tokens_decoder" in json.loads((default_model_dir / "tokenizer_config.json").read_text())
    folders = {}
    for name in ("saved", "recorded"):
        folder = folders[name] = tmp_path / name
        folder.mkdir()
        for file in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            shutil.copy(default_model_dir / file, folder / file)
        settings = json.loads((folder / "tokenizer_config.json").read_text())
        del settings["added_tokens_decoder"]  # as transformers 5's save_pretrained writes it
        (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    record_added_tokens(folders["recorded"])
    parsed: list[str] = []
    real_load = base.json.load

    def load(handle: Any, *args: Any, **kwargs: Any) -> Any:
        parsed.append(Path(handle.name).name)
        return real_load(handle, *args, **kwargs)

    monkeypatch.setattr(base.json, "load", load)
    tokenizers = {}
    for name, folder in folders.items():
        parsed.clear()
        tokenizers[name] = load_tokenizer(folder)
        assert ("tokenizer.json" in parsed) == (name == "saved"), (name, parsed)
    saved, recorded = tokenizers["saved"], tokenizers["recorded"]
    assert {i: vars(t) for i, t in recorded.added_tokens_decoder.items()} == {
        i: vars(t) for i, t in saved.added_tokens_decoder.items()
    }
    assert len(saved.added_tokens_decoder) > 0
    assert recorded.all_special_ids == saved.all_special_ids and len(recorded) == len(saved)
    assert recorded.special_tokens_map == saved.special_tokens_map
    chat = [{"role": "user", "content": "Hi <|im_end|> ñ 🙂"}]
    assert recorded.apply_chat_template(chat, add_generation_prompt=True) == saved.apply_chat_template(
        chat, add_generation_prompt=True
    )
    ids = saved("<|im_start|>user\nHello<|im_end|>")["input_ids"]
    assert recorded("<|im_start|>user\nHello<|im_end|>")["input_ids"] == ids
    assert recorded.decode(ids, skip_special_tokens=True) == saved.decode(ids, skip_special_tokens=True)
    # Recording twice changes nothing.
    before = (folders["recorded"] / "tokenizer_config.json").read_text()
    record_added_tokens(folders["recorded"])
    assert (folders["recorded"] / "tokenizer_config.json").read_text() == before


def test_a_server_start_imports_no_transformers_model_code(tiny_model_dir: Path) -> None:
    """What start-up saves (docs/benchmarks.md, "Start-up"): reading the tiny Llama for the
    batched engine, building it and generating does not import transformers' Llama code,
    torch._dynamo or sympy (together more than a second of every start)."""
    script = f"""
import sys
from tokenwire_server.model import load_model
from tokenwire_server.engine import create_engine
from tokenwire_server.engine.base import EngineLimits
from tokenwire_server.domain import GenerationRequest, SamplingOptions
sys.path.insert(0, {str(Path(__file__).parent)!r})
from engine_support import run_all
loaded = load_model({str(tiny_model_dir)!r}, native_only=True)
engine = create_engine("batched", loaded, EngineLimits(4, 8, 4096))
engine.start()
[rec] = run_all(engine, [GenerationRequest("r", [1, 2, 3], SamplingOptions(temperature=0.0), 4, ignore_eos=True)])
engine.close()
assert rec.text, rec.events
print(sorted(m for m in ("transformers.models.llama.modeling_llama", "torch._dynamo", "sympy") if m in sys.modules))
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"
