"""Shared fixtures: tiny random models with the real tokenizer, and real servers on them.

Most tests need a model but not its quality: a 2-layer random Llama with the
default model's tokenizer (and chat template) loads in a second and decodes
fast and deterministically. A few end-to-end tests use the real default model.

`make test-fast` (`-m "not e2e"`) leaves out every test on the real model's weights,
so those tests carry the `e2e` mark, and this file sees to it that none can lack it:

- at collection, a test that uses ``default_server`` (directly or through another
  fixture), or that takes ``default_model_dir`` as an argument of its own (to load the
  weights from it), is marked ``e2e`` (``pytest_collection_modifyitems`` below);
- at run time, a test without the mark fails as soon as it starts a server on the real
  model (``ServerProcess`` with ``--model default``, the converted folder or a .gguf,
  or no ``--model`` at all) or loads the converted folder's weights with transformers
  (``_real_model_guard``).

The tiny model is built from ``default_model_dir`` too, but only its tokenizer files are
read (``build_tiny_model``): tests on the tiny model, and those that only tokenize with
the real tokenizer, are not end-to-end tests on the real model and stay in test-fast.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

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
from zygote import ZYGOTE, spawner  # noqa: E402

# Servers start as forks of a process that has imported torch and transformers already,
# where a fork behaves as exec would (tests/zygote.py says when it cannot; TOKENWIRE_TEST_EXEC=1
# exec's them all).
ServerProcess.spawner = staticmethod(spawner)  # type: ignore[assignment]

_hypothesis.register_profile("ci", derandomize=True, database=None, print_blob=True)
_hypothesis.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "default"))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# `make test` runs the suite in parallel (pytest-xdist, one worker per core, at most 4). Each
# worker and each server a test starts then computes on one thread: torch's default, one per
# core in every process, puts two or more threads on each core, and the in-process engine
# tests ran ~40 % slower that way on 2 cores (README, "Development"). A test that is about
# threads sets its own counts (`--torch-threads`, ``torch.set_num_threads``), which win.
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if XDIST_WORKER:
    os.environ.setdefault("TOKENWIRE_TORCH_THREADS", "1")


def pytest_configure(config: pytest.Config) -> None:
    if XDIST_WORKER:
        import torch

        torch.set_num_threads(1)


@pytest.fixture
def two_threads() -> Iterator[None]:
    """torch on at least two threads for the test, whatever the worker's one: the compiled ops'
    parallel loops split their rows only then (tests/test_cpu_ops.py)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(max(2, before))
    try:
        yield
    finally:
        torch.set_num_threads(before)


# Fixtures that give a test the real model's weights: a server on them, or the folder a test
# loads them from when it asks for it itself (fixtures such as tiny_model_dir that take
# default_model_dir read its tokenizer alone).
REAL_MODEL_SERVER_FIXTURES = {"default_server"}
REAL_MODEL_DIR_ARGUMENTS = {"default_model_dir"}


def needs_real_model(item: pytest.Item) -> bool:
    """Whether a collected test uses the real default model's weights, as far as its fixtures tell."""
    if REAL_MODEL_SERVER_FIXTURES & set(getattr(item, "fixturenames", ())):
        return True
    info = getattr(item, "_fixtureinfo", None)
    own = set(getattr(info, "argnames", ()))  # the test function's own arguments
    return bool(REAL_MODEL_DIR_ARGUMENTS & own)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """How the session's servers started: forked from the zygote, or exec'd and why."""
    if ZYGOTE.started:
        counts = ", ".join(f"{why}: {n}" for why, n in ZYGOTE.started.most_common())
        terminalreporter.write_line(f"tokenwire servers started: {counts}")


@pytest.hookimpl(tryfirst=True)  # before `-m "not e2e"` deselects by the marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("e2e") is None and needs_real_model(item):
            item.add_marker(pytest.mark.e2e)


def _default_model_folder() -> Path:
    from tokenwire_server.model import _CONVERTED_DIR, default_cache_dir

    return (default_cache_dir() / _CONVERTED_DIR).resolve()


def serves_real_model(args: Sequence[str], env: dict[str, str] | None) -> bool:
    """Whether ``tokenwire_server`` with these arguments serves the real default model."""
    args = list(args)
    model = (env or {}).get("TOKENWIRE_MODEL") or os.environ.get("TOKENWIRE_MODEL") or "default"
    for i, arg in enumerate(args):
        if arg == "--model" and i + 1 < len(args):
            model = args[i + 1]
        elif arg.startswith("--model="):
            model = arg.split("=", 1)[1]
    if model == "default" or model.endswith(".gguf"):
        return True
    return Path(model).expanduser().resolve() == _default_model_folder()


@pytest.fixture(autouse=True)
def _real_model_guard(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A test without the e2e mark fails the moment it starts a server on the real model or
    loads its weights: `make test-fast` would run it otherwise. (Session fixtures are set up
    before this one: default_server is covered at collection.)"""
    if request.node.get_closest_marker("e2e") is not None:
        return
    from benchmarks.launcher import ServerProcess as Launched

    start = Launched.__init__

    def guarded_start(self: Any, args: Sequence[str], env: dict[str, str] | None = None, *a: Any, **kw: Any) -> None:
        if serves_real_model(args, env):
            pytest.fail(f"{request.node.nodeid} starts a server on the real default model: mark it e2e", pytrace=False)
        start(self, args, env, *a, **kw)

    monkeypatch.setattr(Launched, "__init__", guarded_start)
    if "torch" in sys.modules or "transformers" in sys.modules:  # else this test cannot load weights yet
        from transformers.modeling_utils import PreTrainedModel as base

        load = base.__dict__["from_pretrained"].__func__

        def guarded_load(cls: Any, path: Any, *a: Any, **kw: Any) -> Any:
            if not kw.get("gguf_file") and Path(str(path)).expanduser().resolve() == _default_model_folder():
                pytest.fail(f"{request.node.nodeid} loads the real default model's weights: mark it e2e", pytrace=False)
            return load(cls, path, *a, **kw)

        monkeypatch.setattr(base, "from_pretrained", classmethod(guarded_load))


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The real default model, converted into the cache (`make model` does this before tests)."""
    from tokenwire_server.model import prepare_default_model

    return prepare_default_model()


def build_tiny_model(
    target: Path,
    tokenizer_dir: Path,
    *,
    chat_template: bool = True,
    seed: int = 0,
    head_dim: int = 16,
    context_length: int = 1024,
    heads: int = 4,
    kv_heads: int = 2,
    tie: bool = True,
    bias: bool = False,
    initializer_range: float = 0.5,
) -> Path:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    if not chat_template:
        tokenizer.chat_template = None
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=heads * head_dim,
        intermediate_size=2 * heads * head_dim,
        head_dim=head_dim,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        attention_bias=bias,
        mlp_bias=bias,
        max_position_embeddings=context_length,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=tie,
        # Large weights give well-separated logits, so greedy choices do not flip
        # on float noise between batched and single-row runs.
        initializer_range=initializer_range,
    )
    model = LlamaForCausalLM(config).eval()
    if bias:  # transformers starts biases at zero: draw them, so a pass that drops them shows
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.endswith(".bias"):
                    parameter.normal_(0.0, 0.5)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    if not chat_template:
        template = target / "chat_template.jinja"
        if template.exists():
            template.unlink()
    return target


@pytest.fixture(scope="session")
def tokenizer_dir() -> Path:
    """The default model's tokenizer files: ``$TOKENWIRE_TOKENIZER_DIR`` where set (a bare GPU
    machine, benchmarks/gpu-check.sh: no GGUF there to convert), else the converted default model."""
    from benchmarks.gpu_bench import tokenizer_source

    return tokenizer_source()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    # vLLM's CPU attention kernels take head sizes of 32 and up: its tiny model is wider.
    head_dim = 64 if TEST_ENGINE == "vllm" else 16
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"), tokenizer_dir, head_dim=head_dim)


@pytest.fixture(scope="session")
def tiny_wide_model_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    """The tiny model 256 wide (every projection's inputs a multiple of int4's 128-wide
    groups): for the int4 and fp8 modes on a GPU (tests/gpu)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-wide"), tokenizer_dir, head_dim=64)


@pytest.fixture(scope="session")
def tiny_long_model_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """The tiny model (weights redrawn) with an 8192-token context: streams long enough to
    outlast a deadline set from this machine's own pace (tests/client)."""
    head_dim = 64 if TEST_ENGINE == "vllm" else 16
    return build_tiny_model(
        tmp_path_factory.mktemp("tiny-long"), tiny_model_dir, head_dim=head_dim, context_length=8192
    )


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Any:
    """``tiny_model_factory(name, heads=8, kv_heads=1, ...)``: ``build_tiny_model`` into a fresh
    folder, with the tokenizer's files. A fixture, because a test module's ``import conftest``
    finds whichever conftest.py comes first on sys.path (tests/production has its own)."""
    return lambda name, **shape: build_tiny_model(tmp_path_factory.mktemp(name), tiny_model_dir, **shape)


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
    """The real default model on the batched engine, for the end-to-end tests (a test that
    uses it is marked e2e at collection). On two threads, as on a 2-core host, whatever the
    parallel suite's one per worker: the compiled ops' parallel loops are under test here."""
    with ServerProcess(["--model", "default", "--torch-threads", "2"]) as server:
        yield server
