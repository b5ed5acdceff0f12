"""Every `tokenwire` command against a real server (the tiny model), run as a user runs
it: the installed console script in a subprocess, reading its stdout, stderr and exit status."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from servers import ServerProcess

TOKENWIRE = shutil.which("tokenwire", path=str(Path(sys.executable).parent)) or shutil.which("tokenwire")


def tokenwire(*args: str, stdin: str = "", timeout: float = 120) -> subprocess.CompletedProcess[str]:
    assert TOKENWIRE, "the tokenwire console script comes with the package (`make setup`)"
    return subprocess.run(
        [TOKENWIRE, *args], input=stdin, capture_output=True, text=True, timeout=timeout, env={"PATH": "/usr/bin:/bin"}
    )


@pytest.fixture(scope="module")
def target(tiny_server: ServerProcess) -> str:
    return tiny_server.target


def test_generate_streams_text_and_reports_usage(target: str) -> None:
    done = tokenwire("generate", "--target", target, "--temperature", "0", "--max-new-tokens", "8", "--ignore-eos",
                     "--usage", "Once upon a time")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()
    assert "finish_reason: length" in done.stderr.lower() and "completion_tokens=8" in done.stderr


def test_generate_json_chunks_are_the_stream(target: str) -> None:
    done = tokenwire("generate", "--target", target, "--json", "--token-ids", "--temperature", "0",
                     "--max-new-tokens", "5", "--ignore-eos", "--chat", "Hello")  # fmt: skip
    assert done.returncode == 0, done.stderr
    chunks = [json.loads(line) for line in done.stdout.splitlines()]
    assert [c["index"] for c in chunks] == list(range(len(chunks)))
    assert sum(len(c["tokens"]) for c in chunks) == 5


def test_score_and_prompt_logprobs(target: str) -> None:
    scored = tokenwire("score", "--target", target, "--json", "Once upon a", " time", " banana split")
    assert scored.returncode == 0, scored.stderr
    lines = [json.loads(line) for line in scored.stdout.splitlines()]
    assert [line["continuation"] for line in lines] == [" time", " banana split"]
    assert all(line["logprob"] == sum(line["logprobs"]) < 0 and line["token_ids"] for line in lines)
    plain = tokenwire("score", "--target", target, "Once upon a", " time")
    assert plain.returncode == 0 and "' time'" in plain.stdout and f"{lines[0]['logprob']:10.4f}" in plain.stdout

    only = tokenwire("generate", "--target", target, "--prompt-logprobs", "--prompt-top-logprobs", "1",
                     "--max-new-tokens", "0", "--usage", "Once upon a time")  # fmt: skip
    assert only.returncode == 0, only.stderr
    assert only.stdout == "" and "prompt logprobs:" in only.stderr and "completion_tokens=0" in only.stderr
    assert "ended this raw prompt" not in only.stderr  # no hint that the model stopped at once: nothing was asked
    refused = tokenwire("generate", "--target", target, "--max-new-tokens", "0", "hi")
    assert refused.returncode == 2 and "stopping.max_new_tokens" in refused.stderr


def test_generate_n_prints_each_sample_apart(target: str) -> None:
    done = tokenwire("generate", "--target", target, "--n", "3", "--seed", "5", "--temperature", "1",
                     "--max-new-tokens", "5", "--ignore-eos", "--usage", "Once upon a time")  # fmt: skip
    assert done.returncode == 0, done.stderr
    headers = [line for line in done.stdout.splitlines() if line.startswith("--- sample ")]
    assert sorted(h.split()[2] for h in headers) == ["0", "1", "2"]
    assert all("finish_reason: length" in h and "completion_tokens=5" in h for h in headers)


def test_generate_exit_status_follows_the_grpc_code(target: str) -> None:
    bad = tokenwire("generate", "--target", target, "--temperature", "-1", "hi")
    assert bad.returncode == 2 and "temperature" in bad.stderr
    unreachable = tokenwire("generate", "--target", "127.0.0.1:1", "--timeout", "5", "--retries", "0", "hi")
    assert unreachable.returncode == 4


def test_chat_repl_keeps_the_conversation(target: str) -> None:
    done = tokenwire("chat", "--target", target, "--temperature", "0", "--max-new-tokens", "6",
                     stdin="Hello!\nAnd again?\n/exit\n")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "tokenwire chat with" in done.stderr
    assert done.stdout.strip()  # the two answers


def test_info_tokenize_health_and_bench(target: str) -> None:
    info = tokenwire("info", "--target", target, "--json")
    assert info.returncode == 0, info.stderr
    described = json.loads(info.stdout)
    assert described["engine"] == "batched" and described["limits"]["max_new_tokens_limit"] == 512

    tokens = tokenwire("tokenize", "--target", target, "--tokens", "Hello world")
    assert tokens.returncode == 0, tokens.stderr
    assert "Hello" in tokens.stdout

    health = tokenwire("health", "--target", target)
    assert health.returncode == 0 and "SERVING" in health.stdout
    unknown = tokenwire("health", "--target", target, "--service", "no.such.Service")
    assert unknown.returncode != 0

    bench = tokenwire(
        "bench", "--target", target, "-c", "2", "-n", "4", "--max-new-tokens", "8", "--json", "--no-progress"
    )
    assert bench.returncode == 0, bench.stderr
    report = json.loads(bench.stdout)
    assert (report["requests"], report["succeeded"], report["failed"], report["errors"]) == (4, 4, 0, {})
    assert report["output_tokens"] == 4 * 8 and report["output_tokens_per_s"] > 0


def test_generate_follows_a_json_schema_a_regex_and_a_choice(target: str, tmp_path: Path) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green"]}},
        "required": ["ok", "color"],
    }
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    base = ("generate", "--target", target, "--temperature", "0", "--max-new-tokens", "40", "--usage")
    done = tokenwire(*base, "--json-schema", str(tmp_path / "schema.json"), "Describe it as JSON")
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    assert (
        set(answer) == {"ok", "color"}
        and answer["color"] in ("red", "green")
        and "finish_reason: eos" in done.stderr.lower()
    )
    choice = tokenwire(*base, "--choice", "yes,no, maybe", "Well?")
    assert choice.returncode == 0 and choice.stdout.strip() in ("yes", "no", "maybe"), choice
    code = tokenwire(*base, "--regex", "[0-9]{3}-[a-z]{2}", "Code?")
    assert code.returncode == 0 and re.fullmatch(r"[0-9]{3}-[a-z]{2}", code.stdout.strip()), code
    (tmp_path / "g.ebnf").write_text('root ::= "x=" [0-9]')
    grammar = tokenwire(*base, "--grammar", str(tmp_path / "g.ebnf"), "x?")
    assert grammar.returncode == 0 and re.fullmatch(r"x=[0-9]", grammar.stdout.strip()), grammar
    bad = tokenwire(*base, "--regex", "a(b", "Code?")
    assert bad.returncode == 2 and "response_format.regex" in bad.stderr and "parenthesis" in bad.stderr
    both = tokenwire(*base, "--regex", "a", "--json-object", "x")
    assert both.returncode == 2 and "not allowed with" in both.stderr
