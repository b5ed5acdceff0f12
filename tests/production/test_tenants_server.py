"""Tenants on a real server (tiny model, in this process, 127.0.0.1): the tenant comes from
the bearer token or the client certificate; a quota refuses one tenant with QuotaFailure
while another is served at the same moment; a priority above a tenant's cap is
INVALID_ARGUMENT; a HIGH call is admitted before every queued LOW one; per-tenant metrics.

Order, not stopwatches: the priority test has one slot, so the order in which the calls'
first chunks arrive is the order of admission."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2  # type: ignore[import-untyped]
from grpc_status import rpc_status
from production_support import Pki, Samples, generation_stub, long_request, sample, short_request, value, wait_until
from prometheus_client import generate_latest
from tokenwire.v1 import generation_pb2 as pb

pytestmark = pytest.mark.timeout(120)

TENANTS = """
[tenants.search]
weight = 3

[tenants.batch]
weight = 1
tokens_per_minute = 40
max_priority = "normal"

[tenants."tokenwire test client"]
weight = 1

[tenants.queued]
max_queued = 1
"""


@pytest.fixture
def tenant_files(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "tenants.toml").write_text(TENANTS)
    (tmp_path / "tokens").write_text("tok-search search\ntok-batch batch\ntok-plain\ntok-queued queued\n")
    return {"tenant_config": str(tmp_path / "tenants.toml"), "auth_token_file": str(tmp_path / "tokens")}


def scrape(server: Any) -> Samples:
    """Every sample of an in-process server's metrics registry, by name and sorted labels."""
    return Samples(generate_latest(server.server.metrics.registry).decode())


def auth(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def finished(stream: Any) -> list[pb.TokenChunk]:
    chunks = list(stream)
    assert chunks[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED
    return chunks


def test_a_tenant_over_its_quota_gets_quota_failure_and_another_is_served(
    in_process_server: Any, tenant_files: dict[str, str]
) -> None:
    server = in_process_server(**tenant_files)
    stub = generation_stub(server.target)
    # batch's 40 tokens a minute: each call charges its prompt and its 8 new tokens
    refused = None
    for _ in range(10):
        try:
            finished(stub.Generate(short_request(8), metadata=auth("tok-batch"), timeout=30))
        except grpc.RpcError as error:
            refused = error
            break
    assert refused is not None, "batch was never refused"
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "tokens per minute" in refused.details()
    # at the same moment, search (no quota) and the default tenant are served
    finished(stub.Generate(short_request(8), metadata=auth("tok-search"), timeout=30))
    finished(stub.Generate(short_request(8), metadata=auth("tok-plain"), timeout=30))
    status = rpc_status.from_call(refused)
    assert status is not None
    quota, retry = error_details_pb2.QuotaFailure(), error_details_pb2.RetryInfo()
    kinds = {d.type_url.rsplit("/", 1)[-1] for d in status.details}
    assert kinds == {"google.rpc.QuotaFailure", "google.rpc.RetryInfo"}
    for detail in status.details:
        detail.Unpack(quota) or detail.Unpack(retry)
    assert [(v.subject, v.description.split(":")[0]) for v in quota.violations] == [
        ("tenant:batch", "tokens_per_minute")
    ]
    assert 0 < retry.retry_delay.ToMilliseconds() <= 60_000
    samples = scrape(server)
    assert sample(samples, "tokenwire_tenant_refusals_total", tenant="batch", limit="tokens_per_minute") == 1
    assert value(samples, "tokenwire_tenant_tokens_total", tenant="search", priority="normal", kind="completion") == 8
    assert value(samples, "tokenwire_tenant_tokens_total", tenant="batch", priority="normal", kind="completion") >= 8
    # the per-tenant gauges exist for the tenants that called, with every priority
    assert ("tokenwire_tenant_active_streams", (("priority", "high"), ("tenant", "search"))) in samples
    assert sample(samples, "tokenwire_tenant_queue_depth", tenant="batch", priority="low") == 0


def test_a_tenant_past_its_max_queued_is_refused_over_grpc_with_quota_failure_and_a_pushback(
    in_process_server: Any, tenant_files: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    """One slot, held; tenant ``queued`` may have one call waiting: its second is refused
    RESOURCE_EXHAUSTED with QuotaFailure (tenant:queued, max_queued), RetryInfo and the
    grpc-retry-pushback-ms trailer, and its "request finished" line names tenant and priority."""
    caplog.set_level(logging.INFO, logger="tokenwire.requests")
    server = in_process_server(max_active=1, max_queue=8, **tenant_files)
    stub = generation_stub(server.target)
    engine = server.backend.engine
    busy = stub.Generate(long_request(), metadata=auth("tok-search"))
    next(busy)
    waiting = stub.Generate(short_request(4, priority=pb.PRIORITY_LOW), metadata=auth("tok-queued"))
    assert wait_until(lambda: engine.queue.queued == 1, 10)
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.Generate(short_request(4, request_id="second"), metadata=auth("tok-queued"), timeout=30))
    refused = caught.value
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    status = rpc_status.from_call(refused)
    assert status is not None
    quota, retry = error_details_pb2.QuotaFailure(), error_details_pb2.RetryInfo()
    assert sorted(d.type_url.rsplit("/", 1)[-1] for d in status.details) == [
        "google.rpc.QuotaFailure", "google.rpc.RetryInfo"
    ]  # fmt: skip
    for detail in status.details:
        detail.Unpack(quota) or detail.Unpack(retry)
    assert [(v.subject, v.description.split(":")[0]) for v in quota.violations] == [("tenant:queued", "max_queued")]
    pushback = dict(refused.trailing_metadata())["grpc-retry-pushback-ms"]
    assert int(pushback) == retry.retry_delay.ToMilliseconds() > 0
    busy.cancel()
    assert finished(waiting)[-1].usage.completion_tokens == 4  # the one waiting is served
    assert sample(scrape(server), "tokenwire_tenant_refusals_total", tenant="queued", limit="max_queued") == 1
    lines = [r.__dict__ for r in caplog.records if r.getMessage() == "request finished"]
    (second,) = [line for line in lines if line["request_id"] == "second"]
    assert (second["code"], second["tenant"], second["priority"]) == ("RESOURCE_EXHAUSTED", "queued", "normal")
    assert any(line["tenant"] == "queued" and line["priority"] == "low" and line["code"] == "OK" for line in lines)


def test_a_priority_above_the_tenants_cap_or_unknown_is_invalid_argument(
    in_process_server: Any, tenant_files: dict[str, str]
) -> None:
    server = in_process_server(**tenant_files)
    stub = generation_stub(server.target)
    for priority, token, says in [
        (
            pb.PRIORITY_HIGH,
            "tok-batch",
            "PRIORITY_HIGH is above what tenant 'batch' may ask for (at most PRIORITY_UNSPECIFIED (normal))",
        ),
        (7, "tok-search", "is 7, not a Priority"),
    ]:
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.Generate(short_request(priority=priority), metadata=auth(token), timeout=30))
        error = caught.value
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        status = rpc_status.from_call(error)
        bad = error_details_pb2.BadRequest()
        assert status is not None and status.details[0].Unpack(bad)
        assert [v.field for v in bad.field_violations] == ["priority"]
        assert says in bad.field_violations[0].description
    # low, and high for a tenant allowed it, are served
    finished(stub.Generate(short_request(priority=pb.PRIORITY_LOW), metadata=auth("tok-batch"), timeout=30))
    finished(stub.Generate(short_request(priority=pb.PRIORITY_HIGH), metadata=auth("tok-search"), timeout=30))


def test_a_high_call_is_admitted_before_every_queued_low_one(
    in_process_server: Any, tenant_files: dict[str, str]
) -> None:
    server = in_process_server(max_active=1, max_queue=8, **tenant_files)
    stub = generation_stub(server.target)
    engine = server.backend.engine
    # Every step slowed to 5 ms or more, so the busy stream's 1,000 steps outlast the queueing
    # below however fast the pass is (the one-call layers once finished them first: a freed slot,
    # not a preempted one, then went to the next low call by fair share).
    runner = engine.runner
    for name in ("_native", "_transformers"):
        step = getattr(runner, name)

        def slowed(*args: Any, step: Any = step, **kwargs: Any) -> Any:
            time.sleep(0.005)
            return step(*args, **kwargs)

        setattr(runner, name, slowed)
    busy = stub.Generate(long_request(priority=pb.PRIORITY_LOW), metadata=auth("tok-search"), timeout=60)
    next(busy)  # the one slot is taken
    first_chunk: dict[str, float] = {}
    lock = threading.Lock()

    def run(name: str, token: str, priority: int) -> None:
        # no deadline: with one slot held by a long stream, deadline-aware admission would
        # refuse it (the test's own timeout bounds it)
        stream = stub.Generate(short_request(4, priority=priority), metadata=auth(token))
        for _ in stream:
            with lock:
                first_chunk.setdefault(name, time.monotonic())

    threads = []
    for i, token in enumerate(["tok-search", "tok-batch", "tok-plain", "tok-search"]):
        threads.append(threading.Thread(target=run, args=(f"low{i}", token, pb.PRIORITY_LOW)))
        threads[-1].start()
        assert wait_until(lambda n=i + 1: engine.queue.queued == n, 10)
    # The HIGH call takes the LOW stream's slot at once (preemption): nothing is cancelled.
    assert busy.is_active(), "the busy stream ended before the HIGH call: the test's premise is gone"
    threads.append(threading.Thread(target=run, args=("high", "tok-plain", pb.PRIORITY_HIGH)))
    threads[-1].start()
    for thread in threads:
        thread.join(60)
    busy.cancel()
    assert set(first_chunk) == {"high", "low0", "low1", "low2", "low3"}
    assert min(first_chunk, key=first_chunk.__getitem__) == "high"


def test_the_simple_engine_orders_admissions_the_same_way_and_never_preempts(
    in_process_server: Any, tenant_files: dict[str, str]
) -> None:
    """docs/operations.md: the simple engine orders admissions as the batched one does, but
    runs each call to its end: the HIGH call waits for the one worker, then goes before
    every LOW call queued ahead of it."""
    server = in_process_server(engine="simple", workers=1, max_queue=8, **tenant_files)
    stub = generation_stub(server.target)
    engine = server.backend.engine
    busy = stub.Generate(long_request(priority=pb.PRIORITY_LOW), metadata=auth("tok-search"))
    next(busy)  # the one worker is taken
    order: list[str] = []
    lock = threading.Lock()

    def run(name: str, token: str, priority: int) -> None:
        for _ in stub.Generate(short_request(4, priority=priority), metadata=auth(token)):
            with lock:
                if name not in order:
                    order.append(name)

    threads = []
    for i, (name, token, priority) in enumerate(
        [
            ("low0", "tok-search", pb.PRIORITY_LOW),
            ("low1", "tok-batch", pb.PRIORITY_LOW),
            ("high", "tok-plain", pb.PRIORITY_HIGH),
        ]  # fmt: skip
    ):
        threads.append(threading.Thread(target=run, args=(name, token, priority)))
        threads[-1].start()
        assert wait_until(lambda n=i + 1: engine.queue.queued == n, 10)
    for _ in range(20):  # the LOW stream keeps its worker: not preempted
        assert next(busy).text is not None
    assert order == [] and engine.queue.queued == 3
    busy.cancel()
    for thread in threads:
        thread.join(60)
    assert order[0] == "high" and sorted(order) == ["high", "low0", "low1"]
    assert value(scrape(server), "tokenwire_tenant_preemptions_total", tenant="search") == 0


def test_a_client_certificates_common_name_names_its_tenant(
    in_process_server: Any, pki: Pki, tenant_files: dict[str, str]
) -> None:
    server = in_process_server(
        tls_cert=str(pki.server_cert),
        tls_key=str(pki.server_key),
        tls_client_ca=str(pki.ca_cert),
        tenant_config=tenant_files["tenant_config"],
    )
    stub = generation_stub(server.target.replace("127.0.0.1", "localhost"), pki.channel_credentials(client=True))
    finished(stub.Generate(short_request(4), timeout=30))
    samples = scrape(server)
    assert (
        value(
            samples,
            "tokenwire_tenant_tokens_total",
            tenant="tokenwire test client",
            priority="normal",
            kind="completion",
        )
        == 4
    )


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_a_high_call_preempts_a_low_stream_which_resumes_with_the_same_tokens(
    in_process_server: Any, tenant_files: dict[str, str], overlap: str
) -> None:
    """One slot, held by a sampled LOW stream; a HIGH call takes the slot at once (no cancel),
    and the LOW stream, read again from its prompt and tokens, ends exactly as it would have.
    With ``--overlap on`` the LOW stream is preempted with its next step in flight: that pick
    is dropped, and the token is drawn again when it is read back. Its prompt and the tokens
    before the preemption fill several blocks: coming back, it starts on the blocks it
    published when set aside, generated tokens' included, and reads only its last partial one."""
    server = in_process_server(max_active=1, overlap=overlap, **tenant_files)
    pool = server.backend.engine.scheduler.pool
    leases: list[tuple[int, int]] = []  # (tokens to read, of them found in the prefix cache), per admission
    lease = pool.lease

    def recorded(budget: int, keys: Any, context_len: int) -> Any:
        taken = lease(budget, keys, context_len)
        if taken is not None:
            leases.append((context_len, taken.cached_tokens))
        return taken

    pool.lease = recorded
    stub = generation_stub(server.target)
    low = pb.GenerateRequest(
        prompt="hello there, " * 8,
        stopping=pb.StoppingCriteria(max_new_tokens=300, ignore_eos=True),
        sampling=pb.SamplingParams(temperature=0.9, seed=1234),
        output=pb.OutputOptions(token_ids=True),
        priority=pb.PRIORITY_LOW,
    )

    def ids(chunks: Any) -> list[int]:
        return [t.id for chunk in chunks for t in chunk.tokens]

    reference = ids(finished(stub.Generate(low, metadata=auth("tok-search"), timeout=60)))
    stream = stub.Generate(low, metadata=auth("tok-search"), timeout=60)
    got = [next(stream) for _ in range(40)]  # well under way: 40 tokens, past two more blocks
    del leases[:]
    high = stub.Generate(short_request(4, priority=pb.PRIORITY_HIGH), metadata=auth("tok-plain"), timeout=60)
    high_chunks = finished(high)  # served while the LOW stream still has most of its tokens to go
    got += list(stream)
    assert high_chunks[-1].usage.completion_tokens == 4
    assert got[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert ids(got) == reference
    assert value(scrape(server), "tokenwire_tenant_preemptions_total", tenant="search") == 1
    # After the 40 chunks: the HIGH call's admission, then the LOW stream's return.
    assert len(leases) == 2, leases
    context, cached = leases[1]
    assert context > 16 * 4 and (context - 2) // 16 * 16 <= cached < context, leases
