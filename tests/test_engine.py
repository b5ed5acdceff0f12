"""The engines in-process on the tiny model: batching keeps each request's own parameters,
the two engines agree, and the KV budget bounds admission. The batched engine's tests of
what its forward pass computes run on both ``--kernels compiled`` (skipped, with the
reason, where this machine cannot build them) and ``--kernels torch``. (Batched == alone
lives in test_engine_batching.py, cancel within two steps in production/test_engine_slots.py,
the full-server refusal in production/test_backpressure_deadlines.py.)"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from engine_support import Recorder, kernel_choices, run_all
from tokenwire_server.domain import (
    FinishEvent,
    FinishReason,
    GenerationRequest,
    NoObserver,
    SamplingOptions,
    TextEvent,
)
from tokenwire_server.engine import create_engine
from tokenwire_server.engine.base import EngineLimits
from tokenwire_server.model import load_model


@pytest.fixture(scope="module")
def loaded(tiny_model_dir: Path):
    return load_model(str(tiny_model_dir))


def ids(loaded, text: str) -> list[int]:
    return loaded.tokenizer(text)["input_ids"]


def request(loaded, rid: str, text: str, max_new: int = 16, **kwargs) -> GenerationRequest:
    sampling = kwargs.pop("sampling", SamplingOptions(temperature=0.0))
    return GenerationRequest(rid, ids(loaded, text), sampling, max_new, want_tokens=True, **kwargs)


@pytest.fixture(params=["batched", "simple"])
def engine(request, loaded):
    eng = create_engine(request.param, loaded, EngineLimits(8, 16, 8 * 1024), workers=4)
    eng.start()
    yield eng
    eng.close()


PROMPTS = ["The weather today", "Once upon a time", "In a galaxy far", "Numbers: 1, 2,"]


def batched_engine(loaded, kernels: str, limits: EngineLimits | None = None, workers: int = 1):
    eng = create_engine("batched", loaded, limits or EngineLimits(8, 16, 8 * 1024), workers=workers, kernels=kernels)
    assert eng.kernels == kernels  # the native pass took what was asked
    return eng


KERNELS = kernel_choices()


@pytest.mark.parametrize("kernels", KERNELS)
def test_engines_agree(loaded, kernels):
    results = {}
    for name in ("batched", "simple"):
        eng = (
            batched_engine(loaded, kernels, workers=2)
            if name == "batched"
            else create_engine(name, loaded, EngineLimits(8, 16, 8 * 1024), workers=2)
        )
        eng.start()
        try:
            seeded = SamplingOptions(temperature=0.8, top_k=40, top_p=0.9, seed=99)
            reqs = [
                request(loaded, "g", PROMPTS[0], 20, ignore_eos=True),
                request(loaded, "s", PROMPTS[1], 20, ignore_eos=True, sampling=seeded),
            ]
            results[name] = [r.token_ids for r in run_all(eng, reqs)]
        finally:
            eng.close()
    assert results["batched"] == results["simple"]


@pytest.mark.parametrize("kernels", KERNELS)
def test_per_request_parameters_inside_one_batch(loaded, kernels):
    """Concurrent requests with different temperatures, seeds, stops and limits each get what they asked."""
    eng = batched_engine(loaded, kernels)
    eng.start()
    try:
        seeded_a = SamplingOptions(temperature=1.0, seed=1)
        seeded_b = SamplingOptions(temperature=0.7, top_k=20, seed=2)
        alone_greedy = run_all(eng, [request(loaded, "g", PROMPTS[0], 30, ignore_eos=True)])[0]
        alone_a = run_all(eng, [request(loaded, "a", PROMPTS[1], 30, ignore_eos=True, sampling=seeded_a)])[0]
        alone_b = run_all(eng, [request(loaded, "b", PROMPTS[2], 30, ignore_eos=True, sampling=seeded_b)])[0]
        greedy_a, greedy_b = run_all(eng, [request(loaded, f"g{i}", PROMPTS[i], 30, ignore_eos=True) for i in (1, 2)])
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
        # each sampled request's own parameters took effect: its prompt greedy gives other tokens
        assert a.token_ids != greedy_a.token_ids and b.token_ids != greedy_b.token_ids
        assert (
            s.last.reason is FinishReason.STOP_SEQUENCE and s.text == alone_greedy.text[: alone_greedy.text.index(stop)]
        )
        assert short.last.reason is FinishReason.LENGTH and short.last.usage.completion_tokens == 3
    finally:
        eng.close()


def test_the_kv_budget_admits_a_second_request_only_when_the_first_leaves(loaded):
    """A budget that holds exactly one request's worst case: with three free slots, the
    second request still starts only after the first has finished (budget, not slots, and
    not mere arrival order: all three arrive together)."""
    prompt_len = len(ids(loaded, PROMPTS[0]))
    budget = prompt_len + 40  # one request's worst case: its prompt and its 40 new tokens
    eng = create_engine("batched", loaded, EngineLimits(max_active=4, max_queue=4, kv_cache_tokens=budget), workers=1)
    eng.start()
    try:
        recs = run_all(eng, [request(loaded, f"r{i}", PROMPTS[0], 40, ignore_eos=True) for i in range(3)])
        assert all(isinstance(r.last, FinishEvent) for r in recs)
        arrivals = [r.request.arrival for r in recs]
        usage = [r.last.usage for r in recs]
        started = sorted(a + u.queue_time_s for a, u in zip(arrivals, usage, strict=True))
        ended = sorted(a + u.total_time_s for a, u in zip(arrivals, usage, strict=True))
        # Each request is admitted only after the one before it has ended: never two at once.
        assert started[1] >= ended[0] and started[2] >= ended[1], (started, ended)
        assert eng.stats().kv_tokens_budget == budget
    finally:
        eng.close()


def test_two_requests_that_fit_the_budget_together_run_together(loaded):
    """The control for the test above: with room for both worst cases, both are admitted at once."""
    prompt_len = len(ids(loaded, PROMPTS[0]))
    eng = create_engine(
        "batched", loaded, EngineLimits(max_active=4, max_queue=4, kv_cache_tokens=2 * (prompt_len + 40)), workers=1
    )
    eng.start()
    try:
        recs = run_all(eng, [request(loaded, f"r{i}", PROMPTS[0], 40, ignore_eos=True) for i in range(2)])
        first_end = min(r.request.arrival + r.last.usage.total_time_s for r in recs)
        assert all(r.request.arrival + r.last.usage.queue_time_s < first_end for r in recs)
    finally:
        eng.close()


def test_both_engines_stream_and_finish(engine, loaded):
    rec = run_all(engine, [request(loaded, "x", PROMPTS[1], 10, ignore_eos=True)])[0]
    assert isinstance(rec.last, FinishEvent) and rec.last.usage.completion_tokens == 10
    assert any(isinstance(e, TextEvent) for e in rec.events)
    assert rec.text == loaded.tokenizer.decode(rec.token_ids, skip_special_tokens=True)


def test_start_estimate_is_a_lower_bound_from_known_lengths():
    from tokenwire_server.engine.estimate import StartEstimator, remaining_steps_lower_bound

    def req(max_new, *, ignore_eos=False, min_new=0, stops=()):
        return GenerationRequest(
            "r", [1, 2], SamplingOptions(), max_new, min_new_tokens=min_new, ignore_eos=ignore_eos, stop_sequences=stops
        )

    assert remaining_steps_lower_bound(req(100, ignore_eos=True), 30) == 70  # known exactly
    assert remaining_steps_lower_bound(req(100, ignore_eos=True, stops=("x",)), 30) == 1  # a stop may come
    assert remaining_steps_lower_bound(req(100, min_new=50), 30) == 20  # EOS blocked until 50
    assert remaining_steps_lower_bound(req(100), 30) == 1  # EOS may come next
    estimator = StartEstimator()
    assert estimator.earliest_first_token_s(10, [], 0, 1) is None  # nothing measured: never refuse
    for seconds in (0.02, 0.01, 0.03):
        estimator.decode_step(seconds)
    estimator.prefill(100, 0.5)  # 200 tokens/s
    long_running = [(req(1000, ignore_eos=True), 0)]
    # A free slot: only the prompt's prefill.
    assert estimator.earliest_first_token_s(20, [], 0, 1) == pytest.approx(0.1)
    # Behind a 1000-token stream on the only slot: 1000 of the fastest steps, then the prefill.
    assert estimator.earliest_first_token_s(20, long_running, 0, 1) == pytest.approx(1000 * 0.01 + 0.1)
    # With a second slot free it could start now.
    assert estimator.earliest_first_token_s(20, long_running, 0, 2) == pytest.approx(0.1)
    # A stream that may end at any step bounds nothing.
    assert estimator.earliest_first_token_s(20, [(req(1000), 0)], 0, 1) == pytest.approx(0.01 + 0.1)
    # Two queued ahead on one slot: the long stream, then a step for each of them.
    assert estimator.earliest_first_token_s(20, long_running, 2, 1) == pytest.approx(1002 * 0.01 + 0.1)


@pytest.mark.parametrize("want_tokens", [True, False])
def test_a_stream_that_asked_for_tokens_gets_each_one_when_it_is_made(loaded, want_tokens):
    """With tokens asked for, every token is its own event, even one whose text is not out
    yet (a special token, the possible start of a stop sequence): the stream's timing is the
    engine's. Without, an event carries text, so a token with none waits for the next."""
    import torch
    from tokenwire_server.domain import RequestHandle
    from tokenwire_server.engine.generation import Generation

    tok = loaded.tokenizer
    special = tok.convert_tokens_to_ids("<|im_end|>")
    words = ids(loaded, " red green blue")
    events: list[object] = []
    req = GenerationRequest(
        "t", ids(loaded, "Colours:"), SamplingOptions(temperature=0.0), 8, stop_sequences=(" green yellow",),
        ignore_eos=True, want_tokens=want_tokens,
    )  # fmt: skip
    seq = Generation(req, RequestHandle(), events.append, tok, (special,), torch.device("cpu"))
    # " red", then the special token (no text), then " green" (held: it may start the stop), " blue"
    for token in [words[0], special, *words[1:]]:
        assert not seq.add_token(token)
    seq.finish(FinishReason.LENGTH)
    texts = [e.text for e in events]
    assert "".join(texts) == " red green blue"
    if want_tokens:
        assert [len(e.tokens) for e in events[:-1]] == [1, 1, 1, 1]
        assert [t.id for e in events for t in e.tokens] == [words[0], special, *words[1:]]
        assert texts[1] == "" and texts[2] == ""  # the special token, then " green" held back
        assert isinstance(events[-1], FinishEvent)
    else:
        assert all(e.tokens == () for e in events)
        assert all(text for text in texts[:-1])  # no empty event before the last


class StepTimes(NoObserver):
    """An engine observer that keeps each decode step's time and the host's own part of it."""

    def __init__(self) -> None:
        self.steps: list[float] = []
        self.host: list[float] = []

    def decode_step(self, seconds: float) -> None:
        self.steps.append(seconds)

    def step_host(self, seconds: float) -> None:
        self.host.append(seconds)


# What the slow part of a step takes, on the engine's clock: 1/32 s, exact in binary, so the
# engine's sums and differences of it are exact too.
SLOW = 2.0**-5


class EngineClock:
    """``time.perf_counter`` for the engine's modules: it moves only when the test says (by
    ``SLOW`` in the slowed forward pass or delivery), so what the engine counts as a step's
    host time is what it computes from the parts of the step, whatever the host's load."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class _ClockedTime:
    """The ``time`` module with ``perf_counter`` swapped for an ``EngineClock``."""

    def __init__(self, clock: EngineClock) -> None:
        self.perf_counter = clock

    def __getattr__(self, name: str) -> object:
        return getattr(time, name)


class SlowSink(Recorder):
    """Delivery that takes ``SLOW`` an event on the engine's clock: host work inside the step, after its forward
    pass."""

    def __init__(self, clock: EngineClock) -> None:
        super().__init__()
        self._clock = clock

    def __call__(self, event: object) -> None:
        self._clock.advance(SLOW)
        super().__call__(event)


@pytest.mark.parametrize("overlap", ["off", "on"])
@pytest.mark.parametrize("slow", ["forward", "delivery"])
def test_the_host_time_of_a_step_counts_delivery_and_not_the_forward_pass(loaded, slow, overlap, monkeypatch):
    """``tokenwire_decode_step_host_seconds``: a step's wall time less its compute (with
    ``--overlap``: the period from one step's picks to the next's, less the compute). On a
    clock that moves only inside the slowed part of the step: a forward pass made ``SLOW``
    slower leaves the host's part at exactly 0 (the forward pass is all compute); delivery
    made ``SLOW`` slower an event puts it at ``SLOW`` or more (delivery is all host)."""
    from tokenwire_server.engine import batched, sampling
    from tokenwire_server.engine import runner as runner_module

    clock = EngineClock()
    for module in (batched, runner_module, sampling):  # every perf_counter a step's times come from
        monkeypatch.setattr(module, "time", _ClockedTime(clock))
    times = StepTimes()
    eng = create_engine("batched", loaded, EngineLimits(8, 16, 8 * 1024), workers=1, observer=times, overlap=overlap)
    runner = eng.runner
    runner.graphs = None  # every step through the eager pass, the one made slow here
    forward = runner._native if runner.native is not None else runner._transformers

    def slow_forward(plan, scoring):
        clock.advance(SLOW)
        return forward(plan, scoring)

    if slow == "forward":
        if runner.native is not None:
            runner._native = slow_forward
        else:
            runner._transformers = slow_forward
    sink = Recorder() if slow == "forward" else SlowSink(clock)
    eng.start()
    try:
        # A first request pays the first-use costs; then measure.
        run_all(eng, [request(loaded, "warm", "Hello", max_new=3, ignore_eos=True)])
        times.steps.clear()
        times.host.clear()
        req = request(loaded, "h", "Once upon a time", max_new=6, ignore_eos=True)
        sink.request = req
        eng.submit(req, sink)
        assert sink.done.wait(60)
    finally:
        eng.close()
    assert isinstance(sink.last, FinishEvent) and len(sink.token_ids) == 6
    assert len(times.host) == 5  # one a decode step (the first token comes from the prompt's step)
    for host, step in zip(times.host, times.steps, strict=True):
        assert host >= 0.0
        if slow == "forward":
            assert step >= SLOW and host < SLOW
            assert host == 0.0 and step == SLOW  # nothing but the forward pass moved the clock
        else:
            assert host >= SLOW
