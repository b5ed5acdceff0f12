"""Several replicas: round_robin spreads calls, and a full replica's refusal is retried on another."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
import tokenwire
from tokenwire import RetryPolicy

pytestmark = pytest.mark.timeout(30)


def test_round_robin_over_a_list_of_addresses(fakes3):
    with tokenwire.Client([s.address for s in fakes3], timeout=10) as client:
        assert client.target.startswith("ipv4:127.0.0.1:")
        client.wait_ready(5)
        for i in range(30):
            assert client.generate_text(f"hello {i}").text == f"hello {i}"
    served = [s.servicer.served for s in fakes3]
    assert sum(served) == 30
    assert all(n >= 3 for n in served), served


def test_a_full_replica_is_retried_on_another(fakes3):
    full, *others = fakes3
    full.script.refuse_always = True
    full.script.retry_after_ms = 1
    retry = RetryPolicy(max_attempts=5, initial_backoff=0.005)
    with tokenwire.Client([s.address for s in fakes3], timeout=10, retry=retry) as client:
        client.wait_ready(5)
        for i in range(24):
            assert client.generate_text(f"job {i}").text == f"job {i}"
    assert full.servicer.served == 0
    assert full.servicer.refused >= 1
    assert sum(s.servicer.served for s in others) == 24
    assert all(s.servicer.served >= 1 for s in others)


def test_a_draining_replica_is_retried_on_another(fakes3):
    draining = fakes3[0]
    draining.script.refuse_always = True
    draining.script.refuse_code = grpc.StatusCode.UNAVAILABLE
    draining.script.retry_after_ms = None
    retry = RetryPolicy(max_attempts=5, initial_backoff=0.005)
    with tokenwire.Client([s.address for s in fakes3], timeout=10, retry=retry) as client:
        client.wait_ready(5)
        for i in range(12):
            client.generate_text(f"job {i}")
    assert draining.servicer.served == 0
    assert sum(s.servicer.served for s in fakes3[1:]) == 12


def test_a_stopped_replica_is_skipped(fakes3):
    with tokenwire.Client([s.address for s in fakes3], timeout=10) as client:
        client.wait_ready(5)
        fakes3[2].stop()
        for i in range(12):
            assert client.generate_text(f"still {i}").text == f"still {i}"
    assert fakes3[2].servicer.served == 0
    assert fakes3[0].servicer.served + fakes3[1].servicer.served == 12


def test_dns_target(fake):
    with tokenwire.Client(f"dns:///127.0.0.1:{fake.port}", timeout=10) as client:
        assert client.generate_text("via dns").text == "via dns"


def test_async_round_robin(fakes3):
    """Concurrent calls spread over the replicas. round_robin's channel is READY as soon as one
    replica is, so the calls wait until each replica has answered once (its connection is up);
    30 calls at once right after wait_ready could all find one replica connected."""

    async def main() -> list[int]:
        async with tokenwire.AsyncClient([s.address for s in fakes3], timeout=10) as client:
            await client.wait_ready(5)
            deadline = time.monotonic() + 10
            while not all(s.servicer.served for s in fakes3) and time.monotonic() < deadline:
                await client.generate_text("connect")
            before = [s.servicer.served for s in fakes3]
            await asyncio.gather(*(client.generate_text(f"n{i}") for i in range(30)))
            return before

    before = asyncio.run(main())
    served = [s.servicer.served - b for s, b in zip(fakes3, before, strict=True)]
    assert sum(served) == 30
    assert all(n >= 3 for n in served), served
