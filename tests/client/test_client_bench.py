"""tokenwire.bench and ``tokenwire bench`` against the fake server."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest
from tokenwire.bench import DEFAULT_PROMPTS, ProgressBar, percentile, run_bench

pytestmark = pytest.mark.timeout(60)


def test_percentile():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile(list(range(101)), 99) == pytest.approx(99)


def test_run_bench_smoke(fake):
    seen = []
    report = run_bench(fake.address, 2, 2, 8, progress=lambda *a: seen.append(a))
    assert (report.requests, report.succeeded, report.failed) == (2, 2, 0)
    assert report.output_tokens == 16
    assert report.ttft_ms.count == 2 and report.e2e_ms.count == 2
    assert report.itl_ms.count == 14  # 7 gaps per 8-token stream, one token per chunk
    assert report.output_tokens_per_s > 0 and report.errors == {}
    assert report.ttft_ms.p50 is not None and report.ttft_ms.p50 <= report.e2e_ms.p99
    assert len(seen) == 2 and seen[-1][0] == 2
    requests = fake.servicer.requests
    assert all(r.stopping.ignore_eos and r.stopping.max_new_tokens == 8 and r.output.token_ids for r in requests)
    assert {r.chat.messages[0].content for r in requests} == set(DEFAULT_PROMPTS[:2])
    assert "output tokens/s" in report.format()
    assert json.loads(json.dumps(report.to_dict()))["ttft_ms"]["count"] == 2


def test_run_bench_counts_errors_by_code(fake):
    fake.script.refuse_always = True
    report = run_bench(fake.address, concurrency=2, requests=3, max_new_tokens=4)
    assert report.succeeded == 0 and report.errors == {"RESOURCE_EXHAUSTED": 3}


def test_run_bench_for_a_duration(fake):
    report = run_bench(fake.address, concurrency=2, max_new_tokens=4, duration=0.3, chat=False)
    assert report.requests >= 2 and report.failed == 0
    assert report.duration_s >= 0.3


def test_progress_bar_draws_on_a_terminal():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    out = Tty()
    bar = ProgressBar(out, width=10)
    bar(5, 10, 1.0, 100, 0)
    bar(10, 10, 2.0, 200, 1)
    bar.finish()
    assert "[#####-----] 5/10 req" in out.getvalue()
    assert "[##########] 10/10 req" in out.getvalue() and "1 err" in out.getvalue()
    quiet = io.StringIO()
    ProgressBar(quiet)(1, 2, 1.0, 1, 0)
    assert quiet.getvalue() == ""


def tokenwire_bench(cli_env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """`python -m tokenwire bench ARGS`, as a user runs it."""
    command = [sys.executable, "-m", "tokenwire", "bench", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=30, env=cli_env)


def test_bench_command(fake, cli_env):
    args = ["--target", fake.address, "--requests", "2", "--concurrency", "2", "--max-new-tokens", "4", "--json"]
    result = tokenwire_bench(cli_env, *args)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["requests"] == 2 and report["output_tokens"] == 8 and report["errors"] == {}
    text = tokenwire_bench(cli_env, "--target", fake.address, "-n", "2", "-c", "1", "--max-new-tokens", "4")
    assert text.returncode == 0 and "TTFT" in text.stdout and "inter-token" in text.stdout
