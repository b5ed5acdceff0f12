"""The intake (service/tokenwire_server/intake.py): a call's input work before admission,
bounded so that no caller's input starves the others'; and the error replies and log
lines a caller's values reach, bounded and escaped. No model: the real tokenizer only."""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path

import grpc
import pytest
from tokenwire.validation import MAX_JSON_SCHEMA_DEPTH, FieldViolation, json_depth_over, quoted
from tokenwire_server import intake as intake_module
from tokenwire_server.domain import ChatPrompt, InvalidResponseFormat, ResponseFormat, TextPrompt
from tokenwire_server.intake import BULK_CHARS, Intake
from tokenwire_server.logs import TextFormatter
from tokenwire_server.text import PromptEncoder
from tokenwire_server.transport.status import DESCRIPTION_BYTES, MESSAGE_BYTES, RpcFailure, invalid_argument


@pytest.fixture(scope="module")
def encoder(tokenizer_dir: Path) -> PromptEncoder:
    from transformers import AutoTokenizer

    return PromptEncoder(AutoTokenizer.from_pretrained(tokenizer_dir))


# -- a prompt's bound ---------------------------------------------------------------------


def test_the_character_bound_is_the_longest_token_times_the_limit(encoder: PromptEncoder) -> None:
    tokenizer = encoder._tokenizer.get()
    longest = max(len(entry) for entry in tokenizer.get_vocab())
    assert encoder.longest_token_chars == longest == 81
    assert encoder.max_chars(1000) == 81_000
    # No text of that many characters encodes to fewer tokens than the bound says: the
    # longest entry repeated (the worst case) takes at least one token per 81 characters.
    entry = max(tokenizer.get_vocab(), key=len)
    text = tokenizer.convert_tokens_to_string([entry]) * 50
    assert len(tokenizer(text)["input_ids"]) >= len(text) / longest


def test_a_text_past_the_bound_is_not_tokenized(encoder: PromptEncoder, monkeypatch: pytest.MonkeyPatch) -> None:
    limit = 100
    giant = "x" * (encoder.max_chars(limit) + 1)

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("tokenized a prompt that cannot fit")

    shared = encoder._tokenizer
    monkeypatch.setattr(shared, "get", lambda: type("T", (), {"__call__": never, "is_fast": True})())
    encoding = encoder.encode(TextPrompt(giant), max_tokens=limit)
    assert encoding.truncated and encoding.ids == [] and encoding.chars == len(giant)


def test_a_long_prompt_is_cut_one_past_the_limit(encoder: PromptEncoder) -> None:
    text = "a " * 500  # ~500 tokens
    full = encoder.encode(TextPrompt(text))
    assert len(full.ids) > 200 and not full.truncated
    cut = encoder.encode(TextPrompt(text), max_tokens=200)
    assert cut.truncated and cut.ids == full.ids[:201]
    fits = encoder.encode(TextPrompt(text), max_tokens=len(full.ids))
    assert not fits.truncated and fits.ids == full.ids
    # A chat is measured rendered, as the model reads it.
    chat = encoder.encode(ChatPrompt((("user", text),)), max_tokens=200)
    assert chat.truncated and len(chat.ids) == 201


# -- lanes -----------------------------------------------------------------------------------


class GatedEncoder:
    """Encodes instantly, except texts holding "giant", which wait for ``release``."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.giants_started = threading.Event()

    def encode(self, prompt: TextPrompt, **kwargs: object) -> object:
        if "giant" in prompt.text:
            self.giants_started.set()
            assert self.release.wait(30)
        return prompt.text[:5]


def test_giant_prompts_wait_for_each_other_and_never_for_short_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    gated = GatedEncoder()
    trims: list[int] = []
    intake = Intake(gated, lambda fmt: None, timeout_s=5)  # type: ignore[arg-type]
    monkeypatch.setattr(intake, "_trim", lambda: trims.append(1))
    giant = "giant " + "x" * BULK_CHARS

    async def scenario() -> None:
        giants = [asyncio.ensure_future(intake.encode(TextPrompt(giant))) for _ in range(4)]
        await asyncio.get_running_loop().run_in_executor(None, gated.giants_started.wait, 10)
        # Four giants hold the bulk lane (one runs, three wait); short prompts go by on the pool.
        short = await asyncio.wait_for(asyncio.gather(*(intake.encode(TextPrompt(f"short {i}")) for i in range(8))), 10)
        assert short == ["short"] * 8
        assert not any(g.done() for g in giants)
        gated.release.set()
        assert await asyncio.wait_for(asyncio.gather(*giants), 10) == ["giant"] * 4

    try:
        asyncio.run(scenario())
    finally:
        gated.release.set()
        intake.close()
    assert len(trims) == 4  # memory handed back after each bulk encode, not after short ones


# -- compiling -------------------------------------------------------------------------------


def test_a_slow_format_is_too_complex_remembered_and_holds_only_its_tenants_slot() -> None:
    release = threading.Event()
    compiled: list[str] = []

    def compile_format(fmt: ResponseFormat) -> float:
        if fmt.spec.startswith("slow"):
            assert release.wait(30)
        compiled.append(fmt.spec)
        return 0.001

    intake = Intake(None, compile_format, timeout_s=0.2)  # type: ignore[arg-type]

    async def scenario() -> None:
        slow = [ResponseFormat("regex", spec=f"slow{i}") for i in range(3)]
        outcomes = [asyncio.ensure_future(intake.check_format(fmt, "alpha")) for fmt in slow]
        # alpha's runaway compiles hold one compile thread at most: beta's formats compile.
        assert await asyncio.wait_for(intake.check_format(ResponseFormat("regex", spec="quick"), "beta"), 5) == 0.001
        assert await asyncio.wait_for(intake.check_format(ResponseFormat("regex", spec="quick2"), "beta"), 5) == 0.001
        first = await asyncio.wait_for(asyncio.gather(outcomes[0], return_exceptions=True), 5)
        assert isinstance(first[0], InvalidResponseFormat) and "too complex" in str(first[0])
        assert first[0].field == "response_format.regex"
        # Its second and third formats wait for alpha's one slot, held until the compile ends.
        assert not outcomes[1].done() and compiled == ["quick", "quick2"]
        # The same format again is refused at once, without compiling.
        with pytest.raises(InvalidResponseFormat, match="too complex"):
            await asyncio.wait_for(intake.check_format(slow[0], "beta"), 0.1)
        release.set()
        rest = await asyncio.wait_for(asyncio.gather(*outcomes[1:], return_exceptions=True), 10)
        assert all(r == 0.001 or isinstance(r, InvalidResponseFormat) for r in rest)
        # Unlimited (the warm-up's): no time limit.
        assert await intake.check_format(ResponseFormat("regex", spec="quick3"), limited=False) == 0.001

    try:
        asyncio.run(scenario())
    finally:
        release.set()
        intake.close()


def test_the_too_complex_memory_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(intake_module, "TOO_COMPLEX_REMEMBERED", 3)
    release = threading.Event()
    intake = Intake(None, lambda fmt: release.wait(30) and None, timeout_s=0.01)  # type: ignore[arg-type]

    async def scenario() -> None:
        for i in range(5):
            with pytest.raises(InvalidResponseFormat):
                await intake.check_format(ResponseFormat("regex", spec=f"r{i}"), f"tenant{i}")
        assert len(intake._too_complex) == 3

    try:
        asyncio.run(scenario())
    finally:
        release.set()
        intake.close()


# -- what error replies and log lines hold ---------------------------------------------------


def test_json_depth_is_measured_without_recursion() -> None:
    assert not json_depth_over('{"a": [1, {"b": 2}]}', 3)
    assert json_depth_over('{"a": [1, {"b": 2}]}', 2)
    assert not json_depth_over('{"a": "[[[[[[{{{{\\"[[["}', 1)  # brackets in strings do not count
    deep = "[" * 100_000 + "]" * 100_000  # would overflow a recursive parser
    assert json_depth_over(deep, MAX_JSON_SCHEMA_DEPTH)


def test_quotes_and_replies_are_cut_to_their_bounds() -> None:
    assert quoted("robot") == "'robot'"
    long = quoted("r" * 9000)
    assert len(long) < 100 and long.endswith("(9000 characters)")
    failure = invalid_argument([FieldViolation(f"f{i}", "é" * 5000) for i in range(20)])
    assert isinstance(failure, RpcFailure) and failure.code is grpc.StatusCode.INVALID_ARGUMENT
    assert len(failure.message.encode()) <= MESSAGE_BYTES
    trailers = failure.trailing_metadata()
    details = dict(trailers)["grpc-status-details-bin"]
    assert len(details) < 8 * 1024
    from google.rpc import error_details_pb2, status_pb2

    status = status_pb2.Status.FromString(details)
    bad = error_details_pb2.BadRequest()
    status.details[0].Unpack(bad)
    assert len(bad.field_violations) == 8
    assert all(len(v.description.encode()) <= DESCRIPTION_BYTES for v in bad.field_violations)
    assert failure.message.endswith("characters)")


def test_text_logs_escape_control_characters() -> None:
    record = logging.LogRecord("tokenwire.requests", logging.INFO, "", 0, "request\rfinished", None, None)
    record.request_id = "x\r\n12:00:00 INFO    request finished  request_id=forged\x1b[2J\u2028"
    line = TextFormatter().format(record)
    assert "\n" not in line and "\r" not in line and "\x1b" not in line and "\u2028" not in line
    assert "request_id=x\\r\\n12:00:00" in line and "\\x1b[2J" in line and "request\\rfinished" in line
