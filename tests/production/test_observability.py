"""Observability: the Prometheus endpoint (--metrics-port; -1 picks a free port) moves with
traffic — requests by method and code, TTFT / ITL / end-to-end histograms, generated and prompt
tokens, active streams, queue depth, batch size — and each finished call leaves one structured
JSON log line with its request id, status, tokens and timings."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from production_support import Samples, generation_stub, long_request, scrape, short_request, value, wait_until
from servers import ServerProcess
from tokenwire.v1 import generation_pb2 as pb

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def metered_server(tiny_model_dir: Path) -> Iterator[ServerProcess]:
    with ServerProcess(["--model", str(tiny_model_dir), "--metrics-port", "-1", "--max-active", "1"]) as server:
        assert server.metrics_port > 0
        yield server


def test_a_metric_read_as_zero_must_be_declared_with_those_labels() -> None:
    """The tests' ``value`` reads an unmoved counter as 0, never a missing or misspelt one."""
    exposition = (
        "# HELP tokenwire_requests_total Finished calls\n# TYPE tokenwire_requests_total counter\n"
        'tokenwire_requests_total{method="Generate",code="OK"} 3.0\n'
        "# HELP tokenwire_tenant_preemptions_total Preemptions\n# TYPE tokenwire_tenant_preemptions_total counter\n"
    )
    samples = Samples(exposition)
    assert value(samples, "tokenwire_requests_total", method="Generate", code="OK") == 3
    assert value(samples, "tokenwire_requests_total", method="Tokenize", code="OK") == 0  # not moved yet
    assert value(samples, "tokenwire_tenant_preemptions_total", tenant="a") == 0  # declared, no sample yet
    with pytest.raises(AssertionError, match="declares no metric"):
        value(samples, "tokenwire_request_total", method="Generate", code="OK")
    with pytest.raises(AssertionError, match="labelled"):
        value(samples, "tokenwire_requests_total", method="Generate", status="OK")


def test_metrics_move_with_traffic(metered_server: ServerProcess) -> None:
    stub = generation_stub(metered_server.target)
    before = scrape(metered_server)
    chunks = list(
        stub.Generate(
            pb.GenerateRequest(prompt="hello there", stopping=pb.StoppingCriteria(max_new_tokens=12, ignore_eos=True)),
            timeout=10,
        )
    )
    usage = chunks[-1].usage
    with pytest.raises(grpc.RpcError):
        list(stub.Generate(pb.GenerateRequest(), timeout=10))
    stub.Tokenize(pb.TokenizeRequest(text="hi"), timeout=10)
    after = scrape(metered_server)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("tokenwire_requests_total", method="Generate", code="OK") == 1
    assert delta("tokenwire_requests_total", method="Generate", code="INVALID_ARGUMENT") == 1
    assert delta("tokenwire_requests_total", method="Tokenize", code="OK") == 1
    assert delta("tokenwire_generated_tokens_total") == usage.completion_tokens == 12
    assert delta("tokenwire_prompt_tokens_total") == usage.prompt_tokens > 0
    assert delta("tokenwire_time_to_first_token_seconds_count") == 1
    assert delta("tokenwire_time_to_first_token_seconds_sum") > 0
    assert delta("tokenwire_inter_token_latency_seconds_count") == len(chunks) - 2  # gaps between text chunks
    assert delta("tokenwire_request_duration_seconds_count", method="Generate") == 2
    for gauge in ("tokenwire_active_streams", "tokenwire_queue_depth", "tokenwire_batch_size"):
        assert (gauge, ()) in after


def test_gauges_show_work_in_flight(metered_server: ServerProcess) -> None:
    stub = generation_stub(metered_server.target)
    busy = stub.Generate(long_request(), timeout=30)
    next(busy)
    queued = stub.Generate(short_request(), timeout=30)  # --max-active 1: this one waits
    try:
        assert wait_until(lambda: value(scrape(metered_server), "tokenwire_queue_depth") == 1, 5)
        now = scrape(metered_server)
        assert value(now, "tokenwire_active_streams") == 1
        assert value(now, "tokenwire_batch_size") == 1
    finally:
        busy.cancel()
    assert list(queued)[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED
    assert wait_until(lambda: value(scrape(metered_server), "tokenwire_active_streams") == 0, 5)


def test_one_structured_log_line_per_finished_request(metered_server: ServerProcess) -> None:
    stub = generation_stub(metered_server.target)
    request_id = f"obs-{time.monotonic_ns()}"
    list(stub.Generate(short_request(5, request_id=request_id), timeout=10))
    header_id = f"hdr-{time.monotonic_ns()}"
    with pytest.raises(grpc.RpcError):
        list(stub.Generate(pb.GenerateRequest(prompt=""), timeout=10, metadata=(("x-request-id", header_id),)))

    def lines(rid: str) -> list[dict]:
        return [r for r in metered_server.find("request finished") if r.get("request_id") == rid]

    assert wait_until(lambda: bool(lines(request_id)) and bool(lines(header_id)), 5)
    (ok,) = lines(request_id)
    assert ok["code"] == "OK" and ok["method"] == "Generate" and ok["level"] == "info"
    assert ok["completion_tokens"] >= 1 and ok["prompt_tokens"] >= 1
    assert ok["finish_reason"] in ("length", "eos", "stop_sequence")
    for timing in ("queue_ms", "ttft_ms", "total_ms"):
        assert ok[timing] >= 0
    assert ok["total_ms"] >= ok["ttft_ms"]
    (refused,) = lines(header_id)
    assert refused["code"] == "INVALID_ARGUMENT"
    # Every line the server wrote is one JSON object, but the configuration banner it
    # prints once before logging starts (checked to be that banner, and to be first).
    banner, *rest = metered_server.lines
    assert banner.startswith("tokenwire-server configuration: {")
    not_json = []
    for line in rest:
        try:
            record = json.loads(line)
        except ValueError:
            not_json.append(line)
            continue
        if not isinstance(record, dict) or not {"ts", "level", "logger", "msg"} <= record.keys():
            not_json.append(line)
    assert rest and not not_json, not_json[:5]


@pytest.mark.parametrize("setting", ["on", "off"])
def test_prefix_cache_reuse_shows_in_the_usage_and_the_metrics(tiny_model_dir: Path, setting: str) -> None:
    """The same 100-token prompt twice: with --prefix-cache on the second finds its first
    6 full blocks (96 tokens) cached, in ``Usage.cached_prompt_tokens`` and in
    ``tokenwire_prefix_cache_hit_tokens_total``; off, neither counts anything. Same tokens either way."""
    args = ["--model", str(tiny_model_dir), "--metrics-port", "-1", "--prefix-cache", setting]
    with ServerProcess(args) as server:
        stub = generation_stub(server.target)
        request = pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=[(7 * i) % 200 + 10 for i in range(100)]),
            stopping=pb.StoppingCriteria(max_new_tokens=6, ignore_eos=True),
            output=pb.OutputOptions(token_ids=True),
        )
        before = scrape(server)
        answers = [list(stub.Generate(request, timeout=30)) for _ in range(2)]
        after = scrape(server)
    usages = [chunks[-1].usage for chunks in answers]
    assert [u.prompt_tokens for u in usages] == [100, 100]
    want = [0, 96] if setting == "on" else [0, 0]
    assert [u.cached_prompt_tokens for u in usages] == want
    hits = value(after, "tokenwire_prefix_cache_hit_tokens_total") - value(
        before, "tokenwire_prefix_cache_hit_tokens_total"
    )
    assert hits == sum(want)
    ids = [[t.id for c in chunks for t in c.tokens] for chunks in answers]
    assert ids[0] == ids[1] and len(ids[0]) == 6
