"""tokenwire.AsyncClient against the fake server (each test runs its own event loop)."""

from __future__ import annotations

import asyncio
import gc

import grpc
import pytest
import tokenwire
from fakes import SERVICE_NAME, FakeServer
from tokenwire import FinishReason, HealthStatus, RetryPolicy
from tokenwire.validation import Rule

pytestmark = pytest.mark.timeout(30)

FAST_RETRY = RetryPolicy(max_attempts=4, initial_backoff=0.01, max_backoff=0.05)
SLOW = "slow:0.05 " + " ".join(f"w{i}" for i in range(60))


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def client_for(fake: FakeServer, **kwargs) -> tokenwire.AsyncClient:
    kwargs.setdefault("retry", FAST_RETRY)
    kwargs.setdefault("timeout", 10)
    return tokenwire.AsyncClient(fake.address, **kwargs)


def test_generate_and_generate_text(fake):
    async def main():
        async with client_for(fake) as client:
            chunks = [c async for c in client.generate("hello async world", token_ids=True)]
            result = await client.generate_text("one two three", max_new_tokens=2)
            return chunks, result

    chunks, result = run(main())
    assert [c.text for c in chunks] == ["hello", " async", " world", ""]
    assert chunks[-1].finish_reason is FinishReason.EOS and chunks[-1].usage is not None
    assert [t.id for c in chunks for t in c.tokens] == [0, 1, 2]
    assert result.text == "one two" and result.finish_reason is FinishReason.LENGTH


def test_chat_tokenize_model_info_health(fake):
    async def main():
        async with client_for(fake) as client:
            await client.wait_ready(5)
            reply = await client.chat([("system", "s"), ("user", "hi async")])
            tokens = await client.tokenize("a b c", return_tokens=True)
            info = await client.model_info()
            health = await client.health(), await client.health(SERVICE_NAME), await client.health("nope")
            return reply, tokens, info, health

    reply, tokens, info, health = run(main())
    assert reply.text == "hi async"
    assert tokens.count == 3 and tokens.tokens == ("a", " b", " c")
    assert info.name == "echo-a"
    assert health == (HealthStatus.SERVING, HealthStatus.SERVING, HealthStatus.SERVICE_UNKNOWN)


def test_token_metadata(fake):
    fake.script.required_token = "tok"

    async def main():
        async with client_for(fake, token="tok") as good, client_for(fake) as bad:
            text = (await good.generate_text("ok")).text
            with pytest.raises(tokenwire.Unauthenticated):
                await bad.generate_text("x")
            with pytest.raises(tokenwire.Unauthenticated):
                await bad.model_info()
            return text

    assert run(main()) == "ok"


def test_validation_before_sending(fake):
    async def main():
        async with client_for(fake) as client:
            with pytest.raises(tokenwire.InvalidArgument) as info:
                client.generate("x", repetition_penalty=0.0)
            return info.value

    error = run(main())
    assert error.field_violations[0].field == "sampling.repetition_penalty"
    assert error.field_violations[0].description == Rule.REPETITION_PENALTY.error(value=0.0)
    assert fake.servicer.generate_calls == 0


def test_server_violations_and_errors(fake):
    async def main():
        async with client_for(fake, retry=tokenwire.NO_RETRY) as client:
            with pytest.raises(tokenwire.InvalidArgument) as bad:
                await client.generate_text("x", max_new_tokens=101)
            errors = {}
            for code in ("RESOURCE_EXHAUSTED", "UNAVAILABLE", "FAILED_PRECONDITION", "INTERNAL", "NOT_FOUND"):
                try:
                    await client.generate_text(f"error:{code} x")
                except tokenwire.TokenwireError as error:
                    errors[code] = type(error)
            with pytest.raises(tokenwire.Unavailable):
                await client.tokenize("error:UNAVAILABLE")
            return bad.value, errors

    bad, errors = run(main())
    assert bad.field_violations[0].description == Rule.MAX_NEW_TOKENS_CAP.error(value=101, limit=100)
    assert errors == {
        "RESOURCE_EXHAUSTED": tokenwire.Overloaded,
        "UNAVAILABLE": tokenwire.Unavailable,
        "FAILED_PRECONDITION": tokenwire.FailedPrecondition,
        "INTERNAL": tokenwire.Internal,
        "NOT_FOUND": tokenwire.NotFound,
    }


def test_unreachable_and_deadline():
    async def main():
        async with tokenwire.AsyncClient("127.0.0.1:1", retry=tokenwire.NO_RETRY, timeout=5) as client:
            with pytest.raises(tokenwire.Unavailable):
                await client.generate_text("x")
            with pytest.raises(tokenwire.Unavailable):
                await client.health()
            with pytest.raises(tokenwire.Unavailable):
                await client.wait_ready(0.2)

    run(main())


def test_deadline_exceeded(fake):
    async def main():
        async with client_for(fake) as client:
            with pytest.raises(tokenwire.DeadlineExceeded):
                await client.generate_text("slow:0.2 a b c d", timeout=0.3)

    run(main())


def test_retry_before_first_chunk_but_no_replay_after(fake):
    fake.script.refuse_next = 2

    async def main():
        async with client_for(fake) as client:
            stream = client.generate("lucky")
            text = (await stream.text()).text
            attempts = stream.attempts
            got = []
            with pytest.raises(tokenwire.Unavailable):
                async for chunk in client.generate("fail-after:1 a b c", resume=False):
                    got.append(chunk.text)
            resumed = [chunk async for chunk in client.generate("fail-after:1 a b c")]
            return text, attempts, got, resumed

    text, attempts, got, resumed = run(main())
    assert text == "lucky" and attempts == 3
    assert got == ["a"]
    assert fake.servicer.refused == 2
    assert fake.servicer.generate_calls == 6  # 3 attempts + 1 stream not resumed + 1 stream resumed once
    assert [c.text for c in resumed] == ["a", " b", " c", ""] and [c.index for c in resumed] == [0, 1, 2, 3]
    assert resumed[-1].usage is not None and resumed[-1].usage.resumes == 1
    assert list(fake.servicer.requests[-1].resume.generated_token_ids) == [0]


def test_a_call_the_server_cancelled_before_the_first_chunk_is_retried(fake):
    """As in the sync client: CANCELLED that this side did not ask for is a dropped call."""
    fake.script.refuse_next = 1
    fake.script.refuse_code = grpc.StatusCode.CANCELLED

    async def main():
        async with client_for(fake) as client:
            stream = client.generate("again please")
            return (await stream.text()).text, stream.attempts

    assert run(main()) == ("again please", 2)


def test_bounded_attempts_and_retry_after(fake):
    fake.script.refuse_always = True
    fake.script.retry_after_ms = 20

    async def main():
        async with client_for(fake, retry=RetryPolicy(max_attempts=2)) as client:
            with pytest.raises(tokenwire.Overloaded) as info:
                await client.generate_text("x")
            return info.value

    error = run(main())
    assert error.retry_after == pytest.approx(0.02)
    assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert fake.servicer.refused == 2


def test_break_cancels_the_rpc(fake):
    async def main():
        async with client_for(fake) as client:
            async for _ in client.generate(SLOW):
                break
            gc.collect()
            return await asyncio.to_thread(fake.servicer.wait_for, lambda s: s.cancelled == 1, 3)

    assert run(main())


def test_async_with_and_aclose_cancel(fake):
    async def main():
        async with client_for(fake) as client:
            async with client.generate(SLOW) as stream:
                await stream.__anext__()
            first = await asyncio.to_thread(fake.servicer.wait_for, lambda s: s.cancelled == 1, 3)
            stream = client.generate(SLOW)
            await stream.__anext__()
            await stream.aclose()
            second = await asyncio.to_thread(fake.servicer.wait_for, lambda s: s.cancelled == 2, 3)
            return first, second

    assert run(main()) == (True, True)


def test_task_cancellation_cancels_the_rpc(fake):
    async def consume(client):
        async for _ in client.generate(SLOW):
            pass

    async def main():
        async with client_for(fake) as client:
            task = asyncio.create_task(consume(client))
            await asyncio.to_thread(fake.servicer.wait_for, lambda s: s.served == 1, 3)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return await asyncio.to_thread(fake.servicer.wait_for, lambda s: s.cancelled == 1, 3)

    assert run(main())
