"""Shared fixtures: tiny random models with the real tokenizer, and real servers on them.

Most tests need a model but not its quality: a 2-layer random Llama with the
default model's tokenizer (and chat template) loads in a second and decodes
fast and deterministically. A few end-to-end tests use the real default model.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
for room in ("client", "service", ""):
    if str(REPO / room) not in sys.path:
        sys.path.insert(0, str(REPO / room))
sys.path.insert(0, str(Path(__file__).resolve().parent))

# Hypothesis: CI (CI=true) runs a derandomised search, the same examples every run, so a
# red CI is reproducible. Locally the search is random: `pytest tests/production/test_property.py`
# explores new examples each run, and `HYPOTHESIS_PROFILE=ci` reproduces CI's.
from hypothesis import settings as _hypothesis  # noqa: E402
from servers import ENGINE_ARGS, TEST_ENGINE, ServerProcess  # noqa: E402

_hypothesis.register_profile("ci", derandomize=True, database=None, print_blob=True)
_hypothesis.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "default"))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The real default model, converted into the cache (`make model` does this before tests)."""
    from tokenwire_server.model import prepare_default_model

    return prepare_default_model()


def build_tiny_model(
    target: Path, tokenizer_dir: Path, *, chat_template: bool = True, seed: int = 0, head_dim: int = 16
) -> Path:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    if not chat_template:
        tokenizer.chat_template = None
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=4 * head_dim,
        intermediate_size=8 * head_dim,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
        # Large weights give well-separated logits, so greedy choices do not flip
        # on float noise between batched and single-row runs.
        initializer_range=0.5,
    )
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    if not chat_template:
        template = target / "chat_template.jinja"
        if template.exists():
            template.unlink()
    return target


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    # vLLM's CPU attention kernels take head sizes of 32 and up: its tiny model is wider.
    head_dim = 64 if TEST_ENGINE == "vllm" else 16
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"), default_model_dir, head_dim=head_dim)


@pytest.fixture(scope="session")
def tiny_model_no_template_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    head_dim = 64 if TEST_ENGINE == "vllm" else 16
    return build_tiny_model(
        tmp_path_factory.mktemp("tiny-no-template"), default_model_dir, chat_template=False, head_dim=head_dim
    )


@pytest.fixture(scope="session")
def tiny_server(tiny_model_dir: Path) -> Iterator[ServerProcess]:
    """The engine under test (batched, or vllm under `make test-vllm`) on the tiny model,
    shared by the read-only tests."""
    with ServerProcess(["--model", str(tiny_model_dir), *ENGINE_ARGS, "--max-new-tokens-limit", "512"]) as server:
        yield server


@pytest.fixture(scope="session")
def tiny_simple_server(tiny_model_dir: Path) -> Iterator[ServerProcess]:
    with ServerProcess(["--model", str(tiny_model_dir), "--engine", "simple", "--workers", "2"]) as server:
        yield server


@pytest.fixture(scope="session")
def default_server(default_model_dir: Path) -> Iterator[ServerProcess]:
    """The real default model on the batched engine, for the end-to-end tests."""
    with ServerProcess(["--model", "default"]) as server:
        yield server
