"""The engines in-process on the tiny model: batching keeps each request's own parameters,
cancellation leaves the batch within two steps, admission is bounded."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from tokenwire_server.domain import (
    EngineOverloaded,
    ErrorEvent,
    FinishEvent,
    FinishReason,
    GenerationRequest,
    SamplingOptions,
    TextEvent,
)
from tokenwire_server.engine import create_engine
from tokenwire_server.engine.base import EngineLimits
from tokenwire_server.model import load_model


@pytest.fixture(scope="module")
def loaded(tiny_model_dir: Path):
    return load_model(str(tiny_model_dir))


class Recorder:
    def __init__(self) -> None:
        self.events: list = []
        self.done = threading.Event()

    def __call__(self, event) -> None:
        self.events.append(event)
        if isinstance(event, FinishEvent | ErrorEvent):
            self.done.set()

    @property
    def text(self) -> str:
        return "".join(e.text for e in self.events if not isinstance(e, ErrorEvent))

    @property
    def last(self):
        return self.events[-1]

    @property
    def token_ids(self) -> list[int]:
        return [t.id for e in self.events if not isinstance(e, ErrorEvent) for t in e.tokens]


def ids(loaded, text: str) -> list[int]:
    return loaded.tokenizer(text)["input_ids"]


def request(loaded, rid: str, text: str, max_new: int = 16, **kwargs) -> GenerationRequest:
    sampling = kwargs.pop("sampling", SamplingOptions(temperature=0.0))
    return GenerationRequest(rid, ids(loaded, text), sampling, max_new, want_tokens=True, **kwargs)


def run_all(engine, requests, timeout=60.0):
    recorders = [Recorder() for _ in requests]
    for req, rec in zip(requests, recorders, strict=True):
        engine.submit(req, rec)
    for rec in recorders:
        assert rec.done.wait(timeout), "request did not finish"
    return recorders


@pytest.fixture(params=["batched", "simple"])
def engine(request, loaded):
    eng = create_engine(request.param, loaded, EngineLimits(8, 16, 8 * 1024), workers=4)
    eng.start()
    yield eng
    eng.close()


PROMPTS = ["The weather today", "Once upon a time", "In a galaxy far", "Numbers: 1, 2,"]


def test_batched_greedy_equals_alone(loaded):
    """Four different-length prompts decoded together give what each gives alone."""
    eng = create_engine("batched", loaded, EngineLimits(8, 16, 8 * 1024), workers=1)
    eng.start()
    try:
        alone = [run_all(eng, [request(loaded, f"a{i}", p, 24, ignore_eos=True)])[0].token_ids for i, p in enumerate(PROMPTS)]
        together = [r.token_ids for r in run_all(eng, [request(loaded, f"t{i}", p, 24, ignore_eos=True) for i, p in enumerate(PROMPTS)])]
        assert together == alone
        assert eng.steps > 0
    finally:
        eng.close()


def test_engines_agree(loaded):
    results = {}
    for name in ("batched", "simple"):
        eng = create_engine(name, loaded, EngineLimits(8, 16, 8 * 1024), workers=2)
        eng.start()
        try:
            seeded = SamplingOptions(temperature=0.8, top_k=40, top_p=0.9, seed=99)
            reqs = [request(loaded, "g", PROMPTS[0], 20, ignore_eos=True), request(loaded, "s", PROMPTS[1], 20, ignore_eos=True, sampling=seeded)]
            results[name] = [r.token_ids for r in run_all(eng, reqs)]
        finally:
            eng.close()
    assert results["batched"] == results["simple"]


def test_per_request_parameters_inside_one_batch(loaded):
    """Concurrent requests with different temperatures, seeds, stops and limits each get what they asked."""
    eng = create_engine("batched", loaded, EngineLimits(8, 16, 8 * 1024), workers=1)
    eng.start()
    try:
        seeded_a = SamplingOptions(temperature=1.0, seed=1)
        seeded_b = SamplingOptions(temperature=0.7, top_k=20, seed=2)
        alone_greedy = run_all(eng, [request(loaded, "g", PROMPTS[0], 30, ignore_eos=True)])[0]
        alone_a = run_all(eng, [request(loaded, "a", PROMPTS[1], 30, ignore_eos=True, sampling=seeded_a)])[0]
        alone_b = run_all(eng, [request(loaded, "b", PROMPTS[2], 30, ignore_eos=True, sampling=seeded_b)])[0]
        stop = alone_greedy.text[5:9]
        batch = run_all(
            eng,
            [
                request(loaded, "g", PROMPTS[0], 30, ignore_eos=True),
                request(loaded, "a", PROMPTS[1], 30, ignore_eos=True, sampling=seeded_a),
                request(loaded, "b", PROMPTS[2], 30, ignore_eos=True, sampling=seeded_b),
                request(loaded, "s", PROMPTS[0], 30, ignore_eos=True, stop_sequences=(stop,)),
                request(loaded, "short", PROMPTS[3], 3, ignore_eos=True),
            ],
        )
        g, a, b, s, short = batch
        assert g.token_ids == alone_greedy.token_ids
        assert a.token_ids == alone_a.token_ids
        assert b.token_ids == alone_b.token_ids
        assert a.token_ids != g.token_ids
        assert s.last.reason is FinishReason.STOP_SEQUENCE and s.text == alone_greedy.text[: alone_greedy.text.index(stop)]
        assert short.last.reason is FinishReason.LENGTH and short.last.usage.completion_tokens == 3
    finally:
        eng.close()


def test_cancel_inside_a_batch_stops_within_two_steps(loaded):
    eng = create_engine("batched", loaded, EngineLimits(8, 16, 8 * 1024), workers=1)
    eng.start()
    try:
        keep = Recorder()
        eng.submit(request(loaded, "keep", PROMPTS[0], 200, ignore_eos=True), keep)
        victim_tokens: list[int] = []
        seen_first = threading.Event()

        def victim(event):
            victim_tokens.extend(t.id for t in event.tokens)
            seen_first.set()

        handle = eng.submit(request(loaded, "victim", PROMPTS[1], 500, ignore_eos=True), victim)
        assert seen_first.wait(30)
        while len(victim_tokens) < 5:
            time.sleep(0.001)
        handle.cancel()
        at_cancel = len(victim_tokens)
        assert handle.done.wait(10)
        after = len(victim_tokens) - at_cancel
        assert after <= 2, f"{after} tokens after cancel"
        assert keep.done.wait(60)  # the batch goes on for the others
        assert keep.last.usage.completion_tokens == 200
        assert eng.stats().active == 0
    finally:
        eng.close()


def test_queue_bound_refuses_at_once(loaded):
    eng = create_engine("batched", loaded, EngineLimits(max_active=2, max_queue=1, kv_cache_tokens=8 * 1024), workers=1)
    eng.start()
    try:
        handles = [eng.submit(request(loaded, f"r{i}", PROMPTS[0], 400, ignore_eos=True), Recorder()) for i in range(3)]
        started = time.monotonic()
        with pytest.raises(EngineOverloaded) as info:
            eng.submit(request(loaded, "overflow", PROMPTS[0], 4), Recorder())
        assert time.monotonic() - started < 0.5
        assert info.value.retry_after_s > 0
        for handle in handles:
            handle.cancel()
        for handle in handles:
            assert handle.done.wait(10)
        rec = Recorder()
        eng.submit(request(loaded, "after", PROMPTS[0], 4), rec)
        assert rec.done.wait(30) and isinstance(rec.last, FinishEvent)
    finally:
        eng.close()


def test_kv_budget_makes_requests_wait_not_fail(loaded):
    prompt_len = len(ids(loaded, PROMPTS[0]))
    budget = prompt_len + 40  # room for one request at a time
    eng = create_engine("batched", loaded, EngineLimits(max_active=4, max_queue=4, kv_cache_tokens=budget), workers=1)
    eng.start()
    try:
        recs = run_all(eng, [request(loaded, f"r{i}", PROMPTS[0], 40, ignore_eos=True) for i in range(3)])
        assert all(isinstance(r.last, FinishEvent) for r in recs)
        # They ran one after another: each later one queued while the earlier decoded.
        assert recs[2].last.usage.queue_time_s > recs[0].last.usage.queue_time_s
    finally:
        eng.close()


def test_both_engines_stream_and_finish(engine, loaded):
    rec = run_all(engine, [request(loaded, "x", PROMPTS[1], 10, ignore_eos=True)])[0]
    assert isinstance(rec.last, FinishEvent) and rec.last.usage.completion_tokens == 10
    assert any(isinstance(e, TextEvent) for e in rec.events)
    assert rec.text == loaded.tokenizer.decode(rec.token_ids, skip_special_tokens=True)
