"""Scale-out against REAL servers: three replicas on 127.0.0.1, one Client over all of them.

Each replica is a ``tokenwire_server`` process on the tiny model with small limits
(``--max-active 2 --max-queue 0``), so "full" is easy to reach. What each replica
served is read from its own "request finished" log records, by request id. The tiny model
has an 8192-token context here, so a stream that must outlast the calls of a test can be
HOG tokens long: ~4,000x one of those calls' two tokens, whatever the machine's speed.
"""

from __future__ import annotations

import asyncio
import math
import signal
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import tokenwire
from servers import READINESS, ServerProcess, seconds_per_token
from tokenwire import FinishReason, HealthStatus, RetryPolicy

pytestmark = pytest.mark.timeout(120)

HOG = 8000
REPLICA_ARGS = ["--max-active", "2", "--max-queue", "0", "--retry-after-ms", "50", "--grace-period", "30",
                "--handoff-after-s", "0", "--max-new-tokens-limit", str(HOG),
                "--kv-cache-tokens", str(2 * 8192)]  # fmt: skip
SHORT = {"max_new_tokens": 2, "ignore_eos": True}
# The stream in flight when the victim is told to stop lasts about IN_FLIGHT_S on the victim's
# pace, measured under the workers' load just before (at least IN_FLIGHT_MIN tokens): long
# enough that the probes after the signal find it still running (200 tokens once ended first,
# and the probe met the server's final stop), short enough to end well within the 30 s grace.
IN_FLIGHT_S = 3.0
IN_FLIGHT_MIN = 200
# Retries enough to ride out refusals from full or draining replicas, each well under a second.
PATIENT = RetryPolicy(max_attempts=20, initial_backoff=0.02, max_backoff=0.2)


def ids(tag: str, n: int) -> list[str]:
    return [f"{tag}-{i}-{uuid.uuid4().hex[:6]}" for i in range(n)]


def codes(server: ServerProcess, request_ids: Iterable[str]) -> list[str]:
    wanted = set(request_ids)
    return [r["code"] for r in server.find("request finished") if r.get("request_id") in wanted]


def wait_logged(servers: list[ServerProcess], request_ids: list[str], timeout: float = 10.0) -> None:
    """Until every id has a final (non-refused) record on some replica: the log lines trail the replies."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = {
            r.get("request_id")
            for s in servers
            for r in s.find("request finished")
            if r.get("code") not in ("RESOURCE_EXHAUSTED", "UNAVAILABLE")
        }
        if done.issuperset(request_ids):
            return
        time.sleep(0.05)


@pytest.fixture(scope="module")
def replicas(tiny_long_model_dir: Path) -> Iterator[list[ServerProcess]]:
    """Three replicas, started in parallel (each loads the model in its own process)."""
    args = ["--model", str(tiny_long_model_dir), *REPLICA_ARGS]
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(ServerProcess, args) for _ in range(3)]
    started = [f.result() for f in futures if f.exception() is None]
    try:
        if len(started) < 3:
            raise next(f.exception() for f in futures if f.exception() is not None)  # type: ignore[misc]
        yield started
    finally:
        for server in started:
            server.__exit__(None, None, None)


def test_calls_spread_over_all_replicas(replicas):
    request_ids = ids("spread", 30)
    with tokenwire.Client([s.target for s in replicas], timeout=30, retry=PATIENT) as client:
        assert client.target.startswith("ipv4:127.0.0.1:")
        client.wait_ready(10)
        for request_id in request_ids:
            result = client.generate_text("hi", request_id=request_id, **SHORT)
            assert result.finish_reason is FinishReason.LENGTH
    wait_logged(replicas, request_ids)
    served = [codes(s, request_ids).count("OK") for s in replicas]
    assert sum(served) == 30
    assert min(served) >= 3, served  # round_robin: about 10 each

    # Concurrent calls from the asyncio client spread too (up to the total capacity of 6).
    async_ids = ids("aspread", 18)

    async def main():
        async with tokenwire.AsyncClient([s.target for s in replicas], timeout=30, retry=PATIENT) as aclient:
            await aclient.wait_ready(10)
            gate = asyncio.Semaphore(6)

            async def one(request_id: str) -> tokenwire.Completion:
                async with gate:
                    return await aclient.generate_text("hi", request_id=request_id, **SHORT)

            return await asyncio.gather(*(one(i) for i in async_ids))

    results = asyncio.run(asyncio.wait_for(main(), 60))
    assert [r.request_id for r in results] == async_ids
    wait_logged(replicas, async_ids)
    served = [codes(s, async_ids).count("OK") for s in replicas]
    assert sum(served) == 18 and min(served) >= 1, served


def test_a_full_replica_is_retried_on_another(replicas):
    full, *others = replicas
    hog_ids = ids("hog", 2)
    request_ids = ids("full", 12)
    with tokenwire.Client(full.target, timeout=60, retry=tokenwire.NO_RETRY) as direct:
        # Fill both slots of one replica, straight to it.
        hogs = [direct.generate("go", max_new_tokens=HOG, ignore_eos=True, request_id=i) for i in hog_ids]
        for hog in hogs:
            next(hog)
        with pytest.raises(tokenwire.Overloaded) as refused:
            direct.generate_text("one more", **SHORT)
        assert refused.value.retry_after == pytest.approx(0.05)

        started = time.monotonic()
        with tokenwire.Client([s.target for s in replicas], timeout=30, retry=PATIENT) as client:
            client.wait_ready(10)
            for request_id in request_ids:
                assert client.generate_text("hi", request_id=request_id, **SHORT).request_id == request_id
        elapsed = time.monotonic() - started
        # The hogs were running all along: they end only now, cancelled (their records say so below).
        assert full.proc.poll() is None
        for hog in hogs:
            hog.cancel()

    wait_logged(others, request_ids)
    on_full = codes(full, request_ids)
    assert on_full, "round_robin never picked the full replica"
    assert set(on_full) == {"RESOURCE_EXHAUSTED"}, on_full
    served = [codes(s, request_ids).count("OK") for s in others]
    assert sum(served) == 12 and min(served) >= 1, served
    deadline = time.monotonic() + 10
    while len(codes(full, hog_ids)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert codes(full, hog_ids) == ["CANCELLED", "CANCELLED"]
    assert elapsed < 20


def test_a_replica_stopped_mid_run_drains_and_callers_see_no_error(replicas):
    *survivors, victim = replicas
    errors: list[BaseException] = []
    served: list[str] = []
    stop = threading.Event()
    lock = threading.Lock()

    with (
        tokenwire.Client([s.target for s in replicas], timeout=30, retry=PATIENT) as client,
        tokenwire.Client(victim.target, timeout=30, retry=tokenwire.NO_RETRY) as direct,
        tokenwire.Client(victim.target, timeout=60, retry=PATIENT) as patient_direct,  # rides out a full victim
    ):
        client.wait_ready(10)

        def worker(n: int) -> None:
            i = 0
            while not stop.is_set() and i < 300:
                request_id = f"drain-{n}-{i}-{uuid.uuid4().hex[:6]}"
                i += 1
                try:
                    client.generate_text("hi", request_id=request_id, **SHORT)
                except BaseException as exc:  # noqa: BLE001 - any error reaching the caller fails the test
                    with lock:
                        errors.append(exc)
                    return
                with lock:
                    served.append(request_id)
                time.sleep(0.01)  # a steady stream, not a flood: 2 CPU cores run 3 replicas and this

        threads = [threading.Thread(target=worker, args=(n,), daemon=True) for n in range(3)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 30
        while len(served) < 15 and not errors and time.monotonic() < deadline:
            time.sleep(0.02)
        before = len(served)
        # A stream in flight on the victim when it is told to stop (its first chunk is in, and
        # about IN_FLIGHT_S of decode steps remain; the victim's log shows the order below): it must
        # run to its end within the 30 s grace period, on a loaded machine too.
        in_flight_tokens = max(IN_FLIGHT_MIN, min(HOG, math.ceil(IN_FLIGHT_S / seconds_per_token(patient_direct))))
        [in_flight_id] = ids("in-flight", 1)
        in_flight = patient_direct.generate(
            "go", max_new_tokens=in_flight_tokens, ignore_eos=True, request_id=in_flight_id
        )
        first = next(in_flight)
        victim.proc.send_signal(signal.SIGTERM)

        # Draining: readiness NOT_SERVING at once, a new call straight to it UNAVAILABLE.
        deadline = time.monotonic() + 5
        while direct.health(READINESS) is not HealthStatus.NOT_SERVING and time.monotonic() < deadline:
            time.sleep(0.02)
        assert direct.health(READINESS) is HealthStatus.NOT_SERVING
        assert direct.health() is HealthStatus.SERVING  # liveness: still alive while it drains
        with pytest.raises(tokenwire.Unavailable) as refused:
            direct.generate_text("late", **SHORT)
        assert "draining" in refused.value.details
        # The stream in flight finishes.
        rest = list(in_flight)
        assert rest[-1].finish_reason is FinishReason.LENGTH
        assert rest[-1].usage is not None and rest[-1].usage.completion_tokens == in_flight_tokens
        assert first.index == 0 and len(rest) >= 1

        assert victim.proc.wait(40) == 0
        exited_at = len(served)
        # Calls keep flowing on the survivors a moment longer.
        deadline = time.monotonic() + 10
        while len(served) < exited_at + 15 and not errors and time.monotonic() < deadline:
            time.sleep(0.02)
        stop.set()
        for thread in threads:
            thread.join(30)

    assert errors == [], errors[:3]
    assert before >= 15 and len(served) >= exited_at + 15
    assert victim.find("draining") and victim.find("stopped")
    # Order, from the victim's own log: the drain began while the stream was in flight. The
    # stream's call may first have found the victim full (both slots taken by the workers' calls)
    # and been retried: such an attempt ends at once, refused, before the stream starts.
    attempts = [r for r in victim.find("request finished") if r.get("request_id") == in_flight_id]
    assert [r["code"] for r in attempts] == ["RESOURCE_EXHAUSTED"] * (len(attempts) - 1) + ["OK"], attempts
    streamed = attempts[-1]
    order = [r.get("msg") for r in victim.records if r.get("msg") == "draining" or r is streamed]
    assert order == ["draining", "request finished"], order

    wait_logged(replicas, served)
    on_victim = codes(victim, served)
    on_survivors = [codes(s, served) for s in survivors]
    # Every call was answered exactly once. The victim served some before the signal and
    # refused with UNAVAILABLE while it drained; any replica may briefly refuse as full (a
    # slot is freed just after the answer's last chunk). Each refusal was retried elsewhere.
    ok = [r["request_id"] for s in replicas for r in s.find("request finished") if r["code"] == "OK"]
    assert sorted(i for i in ok if i in set(served)) == sorted(served)
    assert set(on_victim) <= {"OK", "UNAVAILABLE", "RESOURCE_EXHAUSTED"}, on_victim
    assert on_victim.count("OK") >= 1 and on_victim.count("UNAVAILABLE") >= 1, on_victim
    assert all(set(c) <= {"OK", "RESOURCE_EXHAUSTED"} for c in on_survivors), on_survivors


def test_unreachable_replicas_are_skipped(replicas):
    """A listed address where nothing listens (a replica gone for good) costs no errors."""
    live = [s for s in replicas if s.proc.poll() is None]
    assert live
    request_ids = ids("gone", 9)
    dead = "127.0.0.1:1"
    with tokenwire.Client([dead, *(s.target for s in live)], timeout=30, retry=PATIENT) as client:
        client.wait_ready(10)
        for request_id in request_ids:
            client.generate_text("hi", request_id=request_id, **SHORT)
    wait_logged(live, request_ids)
    assert sum(codes(s, request_ids).count("OK") for s in live) == 9
