"""tokenwire.Client against the fake server: every call, every error, retries and cancellation."""

from __future__ import annotations

import gc
import re
import threading
import time

import grpc
import pytest
import tokenwire
from fakes import SERVICE_NAME, FakeServer
from tokenwire import FinishReason, HealthStatus, Message, RetryPolicy
from tokenwire.validation import Rule

pytestmark = pytest.mark.timeout(30)

FAST_RETRY = RetryPolicy(max_attempts=4, initial_backoff=0.01, max_backoff=0.05)


@pytest.fixture
def client(fake: FakeServer):
    with tokenwire.Client(fake.address, timeout=10, retry=FAST_RETRY) as c:
        yield c


# -- the calls ----------------------------------------------------------------------------


def test_generate_streams_chunks_in_order(client, fake):
    chunks = list(client.generate("the quick brown fox", token_ids=True))
    assert [c.text for c in chunks] == ["the", " quick", " brown", " fox", ""]
    assert [c.index for c in chunks] == [0, 1, 2, 3, 4]
    assert all(c.finish_reason is None and c.usage is None for c in chunks[:-1])
    last = chunks[-1]
    assert last.finish_reason is FinishReason.EOS and last.finish_reason == "eos"
    assert last.usage is not None and last.usage.completion_tokens == 4
    assert [t.text for c in chunks for t in c.tokens] == ["the", " quick", " brown", " fox"]
    assert len({c.request_id for c in chunks}) == 1


def test_generate_text_joins_the_stream(client):
    result = client.generate_text("one two three", max_new_tokens=2)
    assert result.text == "one two"
    assert result.finish_reason is FinishReason.LENGTH
    assert result.usage is not None and result.usage.completion_tokens == 2
    assert result.chunks == 3
    assert result.to_dict()["finish_reason"] == "length"


def test_stop_sequences(client):
    assert client.generate_text("a b c d", stop=["c"]).text == "a b "
    result = client.generate_text("a b c d", stop=["c"], include_stop_sequence=True)
    assert result.text == "a b c"
    assert result.finish_reason is FinishReason.STOP_SEQUENCE


def test_chat_sends_the_conversation(client, fake):
    result = client.chat([Message("system", "be brief"), {"role": "user", "content": "hi there"}])
    assert result.text == "hi there"
    chat = fake.servicer.requests[-1].chat
    assert [(m.role, m.content) for m in chat.messages] == [("system", "be brief"), ("user", "hi there")]
    streamed = "".join(c.text for c in client.generate(messages=[("user", "as a stream")]))
    assert streamed == "as a stream"


def test_generate_from_token_ids(client, fake):
    assert client.generate_text(input_ids=[1, 2]).text == "t1 t2"
    assert list(fake.servicer.requests[-1].token_ids.ids) == [1, 2]


def test_every_parameter_reaches_the_server(client, fake):
    client.generate_text(
        "x",
        temperature=0.5,
        top_k=5,
        top_p=0.9,
        repetition_penalty=1.1,
        seed=7,
        max_new_tokens=9,
        min_new_tokens=1,
        stop=["zz"],
        include_stop_sequence=True,
        ignore_eos=True,
        time_limit_ms=500,
        token_ids=True,
        logprobs=True,
        top_logprobs=2,
        request_id="my-id",
    )
    r = fake.servicer.requests[-1]
    assert r.request_id == "my-id"
    assert r.sampling.temperature == pytest.approx(0.5) and r.sampling.top_k == 5
    assert r.sampling.top_p == pytest.approx(0.9) and r.sampling.repetition_penalty == pytest.approx(1.1)
    assert r.sampling.seed == 7
    s = r.stopping
    assert (s.max_new_tokens, s.min_new_tokens, list(s.stop_sequences)) == (9, 1, ["zz"])
    assert s.include_stop_sequence and s.ignore_eos and s.time_limit_ms == 500
    assert r.output.token_ids and r.output.logprobs and r.output.top_logprobs == 2


def test_unset_parameters_stay_unset(client, fake):
    client.generate_text("x")
    r = fake.servicer.requests[-1]
    for field in ("temperature", "top_k", "top_p", "repetition_penalty", "seed"):
        assert not r.sampling.HasField(field)
    assert not r.stopping.HasField("max_new_tokens")
    assert re.fullmatch(r"[0-9a-f]{32}", r.request_id)


def test_ignore_eos_generates_exactly_max_new_tokens(client):
    result = client.generate_text("a b", max_new_tokens=5, ignore_eos=True, token_ids=True)
    assert len(result.tokens) == 5 and result.text == "a ba ba"
    assert result.finish_reason is FinishReason.LENGTH


def test_tokenize(client):
    result = client.tokenize("hello big world", return_tokens=True, return_offsets=True)
    assert result.count == 3 and len(result.ids) == 3
    assert result.tokens == ("hello", " big", " world")
    assert [(o.start, o.end) for o in result.offsets] == [(0, 5), (5, 9), (9, 15)]
    chat = client.tokenize(messages=[("user", "hi")])
    assert chat.text == "<user>hi<assistant>"


def test_model_info(client):
    info = client.model_info()
    assert info.name == "echo-a" and info.max_new_tokens_limit == 100 and info.vocab_size == 1000
    assert info.bos_token_id is None and info.eos_token_ids == (0,)


def test_health(client, fake):
    assert client.health() is HealthStatus.SERVING
    assert client.health(SERVICE_NAME) == "SERVING"
    fake.set_serving(False)
    assert client.health(SERVICE_NAME) is HealthStatus.NOT_SERVING
    assert client.health("no.such.Service") is HealthStatus.SERVICE_UNKNOWN


# -- auth -----------------------------------------------------------------------------------


def test_token_is_sent_as_bearer_metadata(fake):
    fake.script.required_token = "s3cret"
    with tokenwire.Client(fake.address, token="s3cret") as c:
        assert c.generate_text("ok").text == "ok"
        assert c.model_info().name == "echo-a"
        assert c.health() is HealthStatus.SERVING
    assert fake.servicer.metadata[-1]["authorization"] == "Bearer s3cret"
    with tokenwire.Client(fake.address) as c:
        with pytest.raises(tokenwire.Unauthenticated):
            c.generate_text("no token")
        with pytest.raises(tokenwire.Unauthenticated):
            c.tokenize("no token")


# -- validation -----------------------------------------------------------------------------


def test_client_side_validation_uses_the_shared_messages(client, fake):
    with pytest.raises(tokenwire.InvalidArgument) as info:
        client.generate("x", temperature=-1.0, top_p=1.5, top_logprobs=21, stop=[""])
    fields = {v.field: v.description for v in info.value.field_violations}
    assert fields == {
        "sampling.temperature": Rule.TEMPERATURE.error(value=-1.0),
        "sampling.top_p": Rule.TOP_P.error(value=1.5),
        "output.top_logprobs": Rule.TOP_LOGPROBS.error(value=21, limit=20),
        "stopping.stop_sequences[0]": Rule.EMPTY_STOP.error(index=0),
    }
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.temperature: must be a finite number" in str(info.value)
    with pytest.raises(tokenwire.InvalidArgument) as info:
        client.generate("")
    assert [str(v) for v in info.value.field_violations] == ["prompt: " + Rule.EMPTY_TEXT.error()]
    with pytest.raises(tokenwire.InvalidArgument) as info:
        client.generate()
    assert info.value.field_violations[0].field == "input"
    with pytest.raises(tokenwire.InvalidArgument) as info:
        client.chat([("robot", "hi")])
    assert info.value.field_violations[0].description == Rule.UNKNOWN_ROLE.error(role=repr("robot"))
    with pytest.raises(tokenwire.InvalidArgument):
        client.chat([])
    with pytest.raises(tokenwire.InvalidArgument):
        client.tokenize()
    assert fake.servicer.generate_calls == 0  # nothing was sent


def test_server_side_violations_are_parsed_from_bad_request(client, fake):
    # The fake caps max_new_tokens at 100; the client does not know the cap.
    with pytest.raises(tokenwire.InvalidArgument) as info:
        client.generate_text("x", max_new_tokens=500, request_id="rid-1")
    (violation,) = info.value.field_violations
    assert violation.field == "stopping.max_new_tokens"
    assert violation.description == Rule.MAX_NEW_TOKENS_CAP.error(value=500, limit=100)
    assert info.value.request_id == "rid-1"
    assert fake.servicer.generate_calls == 1  # INVALID_ARGUMENT is not retried


def test_client_limits_check_before_sending(fake):
    limits = tokenwire.Limits(max_new_tokens_limit=10)
    with tokenwire.Client(fake.address, limits=limits) as c, pytest.raises(tokenwire.InvalidArgument) as info:
        c.generate("x", max_new_tokens=11)
    assert info.value.field_violations[0].description == Rule.MAX_NEW_TOKENS_CAP.error(value=11, limit=10)
    assert fake.servicer.generate_calls == 0


def test_misspelt_parameter_is_a_type_error(client):
    with pytest.raises(TypeError, match="temprature"):
        client.generate("x", temprature=1.0)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        client.generate("x", messages=[("user", "y")])


# -- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "cls"),
    [
        ("FAILED_PRECONDITION", tokenwire.FailedPrecondition),
        ("RESOURCE_EXHAUSTED", tokenwire.Overloaded),
        ("UNAVAILABLE", tokenwire.Unavailable),
        ("DEADLINE_EXCEEDED", tokenwire.DeadlineExceeded),
        ("CANCELLED", tokenwire.Cancelled),
        ("UNAUTHENTICATED", tokenwire.Unauthenticated),
        ("PERMISSION_DENIED", tokenwire.PermissionDenied),
        ("NOT_FOUND", tokenwire.NotFound),
        ("INTERNAL", tokenwire.Internal),
        ("UNIMPLEMENTED", tokenwire.Unimplemented),
        ("ABORTED", tokenwire.Aborted),
        ("UNKNOWN", tokenwire.Unknown),
    ],
)
def test_each_status_has_its_exception(fake, code, cls):
    with tokenwire.Client(fake.address, retry=tokenwire.NO_RETRY) as c:
        with pytest.raises(cls) as info:
            c.generate_text(f"error:{code} x", request_id="rid")
        assert isinstance(info.value, tokenwire.TokenwireError)
        assert info.value.code == getattr(grpc.StatusCode, code)
        assert info.value.details == f"scripted {code}"
        assert info.value.request_id == "rid"
        with pytest.raises(cls):
            c.tokenize(f"error:{code}")


def test_failed_precondition_for_chat_without_template(client, fake):
    fake.script.has_chat_template = False
    with pytest.raises(tokenwire.FailedPrecondition):
        client.chat([("user", "hi")])


def test_unreachable_server_is_unavailable_not_rpc_error():
    with tokenwire.Client("127.0.0.1:1", retry=tokenwire.NO_RETRY, timeout=5) as c:
        for call in (lambda: c.generate_text("x"), c.model_info, lambda: c.tokenize("x"), c.health):
            with pytest.raises(tokenwire.Unavailable):
                call()


def test_deadline_exceeded(client):
    started = time.monotonic()
    with pytest.raises(tokenwire.DeadlineExceeded):
        client.generate_text("slow:0.2 a b c d e", timeout=0.3)
    assert time.monotonic() - started < 2


# -- retries ---------------------------------------------------------------------------------


def test_refusals_before_the_first_chunk_are_retried(client, fake):
    fake.script.refuse_next = 2
    stream = client.generate("third time lucky")
    assert "".join(c.text for c in stream) == "third time lucky"
    assert stream.attempts == 3
    assert fake.servicer.refused == 2 and fake.servicer.generate_calls == 3
    # One request id across all attempts.
    assert len({r.request_id for r in fake.servicer.requests}) == 1


def test_unavailable_before_first_chunk_is_retried(client, fake):
    fake.script.refuse_next = 1
    fake.script.refuse_code = grpc.StatusCode.UNAVAILABLE
    assert client.generate_text("again").text == "again"
    assert fake.servicer.generate_calls == 2


def test_a_call_the_server_cancelled_before_the_first_chunk_is_retried(client, fake):
    """A replica that stops cancels the call it had not yet answered: a CANCELLED this side
    did not ask for is retried like UNAVAILABLE (the drain race of a stopping replica)."""
    fake.script.refuse_next = 1
    fake.script.refuse_code = grpc.StatusCode.CANCELLED
    assert client.generate_text("once more").text == "once more"
    assert fake.servicer.generate_calls == 2


def test_a_call_this_side_cancelled_before_the_first_chunk_is_not_retried(client, fake):
    stream = client.generate("slow:2.0 never arrives")
    canceller = threading.Timer(0.3, stream.cancel)  # while next() waits for the first chunk
    canceller.start()
    with pytest.raises(tokenwire.Cancelled):
        next(stream)
    canceller.join()
    assert fake.servicer.generate_calls == 1


def test_unary_calls_are_retried_too(fake):
    policy = RetryPolicy(max_attempts=3, initial_backoff=0.01)
    with tokenwire.Client(fake.address, retry=policy) as c:
        with pytest.raises(tokenwire.Unavailable):
            c.tokenize("error:UNAVAILABLE")
        assert fake.servicer.unary_calls == 3
        with pytest.raises(tokenwire.InvalidArgument):
            c.tokenize("error:INVALID_ARGUMENT")
        assert fake.servicer.unary_calls == 4


def test_attempts_are_bounded(fake):
    fake.script.refuse_always = True
    with tokenwire.Client(fake.address, retry=RetryPolicy(max_attempts=3, initial_backoff=0.01)) as c:
        with pytest.raises(tokenwire.Overloaded) as info:
            c.generate_text("never")
    assert fake.servicer.refused == 3
    assert info.value.retry_after == pytest.approx(0.01)


def test_server_pushback_delay_is_honoured(client, fake):
    fake.script.refuse_next = 1
    fake.script.retry_after_ms = 300
    started = time.monotonic()
    assert client.generate_text("patience").text == "patience"
    assert time.monotonic() - started >= 0.3


def test_pushback_trailer_is_read_when_there_is_no_retry_info(fake):
    fake.script.refuse_always = True
    fake.script.retry_after_ms = None
    fake.script.pushback_trailer_ms = 250
    with tokenwire.Client(fake.address, retry=tokenwire.NO_RETRY) as c, pytest.raises(tokenwire.Overloaded) as info:
        c.generate_text("x")
    assert info.value.retry_after == pytest.approx(0.25)


def test_retries_stop_at_the_deadline(client, fake):
    fake.script.refuse_always = True
    fake.script.retry_after_ms = 5000
    started = time.monotonic()
    with pytest.raises(tokenwire.Overloaded):
        client.generate_text("x", timeout=0.5)
    assert time.monotonic() - started < 3  # not the 5 s the server asked to wait (loose: a loaded CI host)
    assert fake.servicer.refused == 1


def test_a_started_stream_that_is_cut_resumes_where_it_was_cut(client, fake):
    """UNAVAILABLE after two chunks: the client resumes on the next call with the ids and
    index it received; the loop sees every chunk once, no exception, and no token ids it
    did not ask for."""
    stream = client.generate("fail-after:2 a b c d")
    chunks = list(stream)
    assert [c.text for c in chunks] == ["a", " b", " c", " d", ""]
    assert [c.index for c in chunks] == [0, 1, 2, 3, 4]
    assert all(c.tokens == () for c in chunks)
    assert chunks[-1].usage is not None and chunks[-1].usage.resumes == 1
    assert fake.servicer.generate_calls == 2
    first, resumed = fake.servicer.requests
    assert first.output.token_ids and not first.HasField("resume")  # asked for ids under the hood
    assert list(resumed.resume.generated_token_ids) == [0, 1] and resumed.resume.next_index == 2
    assert resumed.prompt == first.prompt and resumed.request_id == first.request_id


def test_a_cut_stream_keeps_the_token_ids_the_caller_asked_for(client, fake):
    chunks = list(client.generate("fail-after:1 a b c", token_ids=True))
    assert [t.id for c in chunks for t in c.tokens] == [0, 1, 2]


def test_without_resume_a_started_stream_is_never_replayed(client, fake):
    stream = client.generate("fail-after:2 a b c d", resume=False)
    received = []
    with pytest.raises(tokenwire.Unavailable):
        for chunk in stream:
            received.append(chunk.text)
    assert received == ["a", " b"]
    assert fake.servicer.generate_calls == 1
    assert not fake.servicer.requests[0].output.token_ids
    assert list(stream) == []  # finished for good


def test_non_retryable_errors_are_not_retried(client, fake):
    with pytest.raises(tokenwire.Internal):
        client.generate_text("error:INTERNAL x")
    assert fake.servicer.generate_calls == 1


# -- cancellation ----------------------------------------------------------------------------


SLOW = "slow:0.05 " + " ".join(f"w{i}" for i in range(60))


def test_break_cancels_the_rpc_on_the_server(client, fake):
    for chunk in client.generate(SLOW):
        assert chunk.text == "w0"
        break
    assert fake.servicer.wait_for(lambda s: s.cancelled == 1, timeout=3)
    assert fake.servicer.completed == 0


def test_exception_in_the_loop_cancels(client, fake):
    with pytest.raises(RuntimeError):
        for _ in client.generate(SLOW):
            raise RuntimeError("caller bails out")
    assert fake.servicer.wait_for(lambda s: s.cancelled == 1, timeout=3)


def test_with_block_and_garbage_collection_cancel(client, fake):
    with client.generate(SLOW) as stream:
        next(stream)
    assert fake.servicer.wait_for(lambda s: s.cancelled == 1, timeout=3)
    stream = client.generate(SLOW)
    next(stream)
    del stream
    gc.collect()
    assert fake.servicer.wait_for(lambda s: s.cancelled == 2, timeout=3)


def test_explicit_cancel(client, fake):
    stream = client.generate(SLOW)
    next(stream)
    stream.cancel()
    assert list(stream) == []
    assert fake.servicer.wait_for(lambda s: s.cancelled == 1, timeout=3)


def test_a_finished_stream_is_not_cancelled(client, fake):
    with client.generate("short one") as stream:
        assert [c.text for c in stream][-1] == ""
    assert fake.servicer.wait_for(lambda s: s.completed == 1, timeout=3)
    assert fake.servicer.cancelled == 0
