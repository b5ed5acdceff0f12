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
from tokenwire.v1 import generation_pb2 as pb
from tokenwire.v1 import generation_pb2_grpc as pb_grpc

JS = Path(__file__).resolve().parent / "js"
NODE = shutil.which("node")


CHAT = {"messages": [{"role": "user", "content": "What is the capital of France?"}]}


def run_js(target: str, requests: dict[str, dict]) -> dict[str, dict]:
    assert NODE, "node is needed for the grpc-js client (a Debian/npm install)"
    assert (JS / "node_modules" / "@grpc" / "grpc-js").is_dir(), "run `make js-deps` (npm ci in tests/js)"
    done = subprocess.run(
        [NODE, str(JS / "client.mjs"), target, json.dumps(requests)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return {r["name"]: r for r in map(json.loads, done.stdout.splitlines())}


@pytest.fixture(scope="module")
def full(tiny_server: ServerProcess) -> dict:
    request = {"chat": CHAT, "sampling": {"temperature": 0}, "stopping": {"max_new_tokens": 48, "ignore_eos": True},
               "output": {"token_ids": True}}  # fmt: skip
    return run_js(tiny_server.target, {"length48": request})["length48"]


def test_48_tokens_with_ids_and_text_as_the_python_stub_reads_them(full: dict, tiny_server: ServerProcess) -> None:
    """Interop, not the text rule (test_server.py holds "text == decode(ids)"): grpc-js
    reads the same greedy answer, ids and text, that the Python stub does."""
    assert (full["code"], full["finish_reason"], full["completion_tokens"]) == ("OK", "FINISH_REASON_LENGTH", 48)
    assert len(full["ids"]) == 48 and full["indexes"] == list(range(len(full["indexes"])))
    request = pb.GenerateRequest(
        chat=pb.Chat(messages=[pb.ChatMessage(role="user", content=CHAT["messages"][0]["content"])]),
        sampling=pb.SamplingParams(temperature=0),
        stopping=pb.StoppingCriteria(max_new_tokens=48, ignore_eos=True),
        output=pb.OutputOptions(token_ids=True),
    )
    with tiny_server.channel() as channel:
        chunks = list(pb_grpc.TextGenerationStub(channel).Generate(request, timeout=60))
    assert full["ids"] == [t.id for c in chunks for t in c.tokens]
    assert full["text"] == "".join(c.text for c in chunks)


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
