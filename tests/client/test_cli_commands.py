"""The tokenwire command, run as a subprocess against the fake server."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from fakes import SERVICE_NAME
from tokenwire.cli import EXIT_CODES, build_parser
from tokenwire.validation import Rule

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def tw(fake, cli_env):
    def run(*args: str, target: str | None = None, input: str | None = None, env: dict | None = None):
        command = [sys.executable, "-m", "tokenwire", *args, "--target", target or fake.address]
        return subprocess.run(
            command, capture_output=True, text=True, input=input, timeout=30, env={**cli_env, **(env or {})}
        )

    return run


def test_generate_streams_text(tw, fake):
    result = tw("generate", "hello from the cli", "--max-new-tokens", "3", "--temperature", "0")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "hello from the"
    request = fake.servicer.requests[-1]
    assert request.stopping.max_new_tokens == 3 and request.sampling.temperature == 0


def test_generate_json_lines(tw):
    result = tw("generate", "a b c", "--json", "--token-ids", "--request-id", "cli-1")
    assert result.returncode == 0, result.stderr
    chunks = [json.loads(line) for line in result.stdout.splitlines()]
    assert [c["text"] for c in chunks] == ["a", " b", " c", ""]
    assert all(c["request_id"] == "cli-1" for c in chunks)
    assert chunks[-1]["finish_reason"] == "eos" and chunks[-1]["usage"]["completion_tokens"] == 3
    assert chunks[0]["tokens"][0]["text"] == "a"


def test_generate_chat_with_system_and_stdin(tw, fake):
    result = tw("generate", "--chat", "--system", "be kind", "--stop", "zz", "--usage", input="from stdin")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "from stdin"
    assert "finish_reason: eos" in result.stderr
    messages = [(m.role, m.content) for m in fake.servicer.requests[-1].chat.messages]
    assert messages == [("system", "be kind"), ("user", "from stdin")]
    assert list(fake.servicer.requests[-1].stopping.stop_sequences) == ["zz"]


def test_generate_stops_at_a_stop_token_id_and_says_which_stop_matched(tw, fake):
    result = tw("generate", "a b c d", "--stop-token-id", "2", "--stop-token-id", "9", "--usage")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "a b"  # the stop token's " c" is left out
    assert "finish_reason: stop_token matched_stop=2" in result.stderr
    assert list(fake.servicer.requests[-1].stopping.stop_token_ids) == [2, 9]
    by_sequence = tw("generate", "a b c d", "--stop", "c", "--usage")
    assert by_sequence.stdout == "a b " and "finish_reason: stop_sequence matched_stop='c'" in by_sequence.stderr


def test_generate_passes_penalties_min_p_and_logit_bias(tw, fake):
    result = tw(
        "generate", "a b", "--presence-penalty", "0.5", "--frequency-penalty", "-1", "--min-p", "0.05",
        "--logit-bias", "12=-100", "--logit-bias", "7=2.5",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    sampling = fake.servicer.requests[-1].sampling
    assert (sampling.presence_penalty, sampling.frequency_penalty) == (0.5, -1.0)
    assert sampling.min_p == pytest.approx(0.05) and dict(sampling.logit_bias) == {12: -100.0, 7: 2.5}
    bad = tw("generate", "a b", "--logit-bias", "12")
    assert bad.returncode == 2 and "ID=BIAS" in bad.stderr
    refused = tw("generate", "a b", "--min-p", "2")
    assert refused.returncode == 2 and "sampling.min_p" in refused.stderr


def test_invalid_argument_exits_2_with_the_rule(tw, fake):
    result = tw("generate", "x", "--top-p", "1.5")
    assert result.returncode == 2
    assert "sampling.top_p: " + Rule.TOP_P.error(value=1.5) in result.stderr
    result = tw("generate", "x", "--max-new-tokens", "1000")  # over the fake's cap: the server says so
    assert result.returncode == 2
    assert Rule.MAX_NEW_TOKENS_CAP.error(value=1000, limit=100) in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("code", "status"),
    [
        ("UNAVAILABLE", 4),
        ("RESOURCE_EXHAUSTED", 5),
        ("FAILED_PRECONDITION", 3),
        ("INTERNAL", 1),
        ("PERMISSION_DENIED", 7),
        ("NOT_FOUND", 8),
    ],
)
def test_exit_code_by_status(tw, code, status):
    result = tw("generate", f"error:{code} x", "--retries", "0")
    assert result.returncode == status, result.stderr
    assert code in result.stderr and "Traceback" not in result.stderr


def test_overloaded_is_retried_then_reported(tw, fake):
    fake.script.refuse_always = True
    result = tw("generate", "x", "--retries", "2")
    assert result.returncode == 5
    assert fake.servicer.refused == 3
    assert "retry after" in result.stderr


def test_retries_default_to_four_and_to_none_for_bench():
    parser = build_parser()
    assert parser.parse_args(["generate", "x"]).retries == 4
    assert parser.parse_args(["chat"]).retries == 4
    assert parser.parse_args(["bench"]).retries == 0


def test_a_cut_stream_is_resumed_unless_no_resume(tw, fake):
    resumed = tw("generate", "fail-after:2 a b c d", "--usage")
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stdout == "a b c d" and "resumes=1" in resumed.stderr
    assert list(fake.servicer.requests[-1].resume.generated_token_ids) == [0, 1]
    cut = tw("generate", "fail-after:2 a b c d", "--no-resume")
    assert cut.returncode != 0 and cut.stdout == "a b"
    assert not fake.servicer.requests[-1].HasField("resume")


def test_deadline_exit_code(tw):
    result = tw("generate", "slow:0.3 a b c", "--timeout", "0.3")
    assert result.returncode == 6, result.stderr


def test_unreachable_server(tw):
    result = tw("info", "--retries", "0", target="127.0.0.1:1")
    assert result.returncode == 4 and "UNAVAILABLE" in result.stderr


def test_token_from_file_and_environment(tw, fake, tmp_path):
    fake.script.required_token = "t0k"
    assert tw("generate", "x").returncode == 7
    token_file = tmp_path / "token"
    token_file.write_text("t0k\n")
    assert tw("generate", "x", "--token-file", str(token_file)).returncode == 0
    assert tw("generate", "x", env={"TOKENWIRE_TOKEN": "t0k"}).returncode == 0
    assert fake.servicer.metadata[-1]["authorization"] == "Bearer t0k"


def test_target_from_environment(fake, cli_env):
    result = subprocess.run(
        [sys.executable, "-m", "tokenwire", "health"],
        capture_output=True,
        text=True,
        timeout=30,
        env={**cli_env, "TOKENWIRE_TARGET": fake.address},
    )
    assert result.returncode == 0 and result.stdout.strip() == "SERVING"


def test_info(tw):
    result = tw("info")
    assert result.returncode == 0
    assert "echo-a" in result.stdout and "max_new_tokens_limit" in result.stdout
    info = json.loads(tw("info", "--json").stdout)
    assert info["vocab_size"] == 1000 and info["has_chat_template"] is True


def test_tokenize(tw):
    result = tw("tokenize", "hello big world", "--tokens", "--offsets")
    assert result.returncode == 0
    assert result.stdout.startswith("count: 3\nids: ")
    assert "' big'" in result.stdout and "[5, 9)" in result.stdout
    data = json.loads(tw("tokenize", "hi", "--chat", "--json").stdout)
    assert data["text"] == "<user>hi<assistant>"


def test_health_exit_codes(tw, fake):
    assert tw("health").returncode == 0
    ready = tw("health", "--service", SERVICE_NAME)
    assert ready.returncode == 0 and ready.stdout.strip() == "SERVING"
    fake.set_serving(False)
    not_ready = tw("health", "--service", SERVICE_NAME)
    assert not_ready.returncode == 9 and not_ready.stdout.strip() == "NOT_SERVING"
    assert tw("health", "--service", "no.such.Service").returncode == 9
    assert tw("health", target="127.0.0.1:1").returncode == 4


def test_usage_errors_and_help(cli_env):
    def run(*args):
        return subprocess.run(
            [sys.executable, "-m", "tokenwire", *args], capture_output=True, text=True, timeout=30, env=cli_env
        )

    assert run().returncode == 2
    assert run("generate", "--temperature", "hot").returncode == 2
    assert run("bench", "--concurrency", "0").returncode == 2
    help_text = run("--help").stdout
    assert "exit status:" in help_text and "RESOURCE_EXHAUSTED" in help_text
    assert "exit status:" in run("generate", "--help").stdout


def test_exit_codes_are_distinct_per_failure_kind():
    parser = build_parser()
    assert parser.prog == "tokenwire"
    codes = set(EXIT_CODES.values())
    assert {2, 3, 4, 5, 6}.issubset(codes)
