"""The contract from another gRPC stack: a grpc-js (Node.js) client, loading the .proto
itself, against the engine under test (batched under `make test`, vllm under `make test-vllm`).

It needs node and `npm ci` in tests/js (`make js-deps`, which `make test` runs).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from servers import ServerProcess
from transformers import AutoTokenizer

JS = Path(__file__).resolve().parent / "js"
NODE = shutil.which("node")


CHAT = {"messages": [{"role": "user", "content": "What is the capital of France?"}]}


def run_js(target: str, requests: dict[str, dict]) -> dict[str, dict]:
    assert NODE, "node is needed for the grpc-js client (a Debian/npm install)"
    assert (JS / "node_modules" / "@grpc" / "grpc-js").is_dir(), "run `make js-deps` (npm ci in tests/js)"
    done = subprocess.run(
        [NODE, str(JS / "client.mjs"), target, json.dumps(requests)], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    return {r["name"]: r for r in map(json.loads, done.stdout.splitlines())}


@pytest.fixture(scope="module")
def full(tiny_server: ServerProcess) -> dict:
    request = {"chat": CHAT, "sampling": {"temperature": 0}, "stopping": {"max_new_tokens": 48, "ignore_eos": True},
               "output": {"token_ids": True}}  # fmt: skip
    return run_js(tiny_server.target, {"length48": request})["length48"]


def test_48_tokens_with_ids_and_text_equal_to_their_decoding(full: dict, tiny_model_dir: Path) -> None:
    assert (full["code"], full["finish_reason"], full["completion_tokens"]) == ("OK", "FINISH_REASON_LENGTH", 48)
    assert len(full["ids"]) == 48 and full["indexes"] == list(range(len(full["indexes"])))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert full["text"] == tokenizer.decode(full["ids"], skip_special_tokens=True, clean_up_tokenization_spaces=False)


def test_a_stop_sequence_ends_the_stream_and_is_withheld(full: dict, tiny_server: ServerProcess) -> None:
    text = full["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]  # a piece of what the model will write again
    cut = text.index(stop)
    request = {"chat": CHAT, "sampling": {"temperature": 0}, "stopping": {"max_new_tokens": 48, "ignore_eos": True,
               "stop_sequences": [stop]}}  # fmt: skip
    r = run_js(tiny_server.target, {"stop": request})["stop"]
    assert (r["code"], r["finish_reason"]) == ("OK", "FINISH_REASON_STOP_SEQUENCE")
    assert r["text"] == text[:cut]  # everything before the stop, none of it


def test_a_negative_temperature_is_invalid_argument_naming_the_field(tiny_server: ServerProcess) -> None:
    r = run_js(tiny_server.target, {"bad": {"prompt": "hi", "sampling": {"temperature": -1}}})["bad"]
    assert r["code"] == "INVALID_ARGUMENT" and r["details"].startswith("sampling.temperature:")
