"""The CPU step's thread layout (engine/threads.py): it takes the faster thread count by
measurement, probes again when the host changes, and never changes a row's numbers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tokenwire_server.engine import threads as layout_module
from tokenwire_server.engine.threads import ThreadLayout, choices_for, results_depend_on_threads


class Host:
    """A fake host: step seconds by thread count, changed by the test mid-run."""

    def __init__(self, seconds: dict[int, float]) -> None:
        self.seconds = seconds
        self.applied: list[int] = []

    def run(self, layout: ThreadLayout, steps: int, rows: int = 1) -> list[int]:
        used = []
        for _ in range(steps):
            threads = layout.pick(rows)
            layout.record(rows, threads, self.seconds[threads])
            used.append(threads)
        return used


def test_it_takes_the_faster_count_and_keeps_it():
    host = Host({2: 0.019, 1: 0.032})
    changes: list[tuple[int, int]] = []
    layout = ThreadLayout((2, 1), host.applied.append, on_change=lambda a, b, _: changes.append((a, b)))
    used = host.run(layout, 2000)
    assert layout.current == 2 and changes == []
    # It probed (1 thread ran a few steps) once, decisively (1.7x slower), and then settled: no
    # periodic probe on a quiet host (a probe's slow steps would set a stream's p99 gap).
    assert 0.032 / 0.019 >= layout_module.DECISIVE
    assert used.count(1) == 4 * layout.probes and layout.probes == 1
    assert 1 not in used[200:]


def test_a_close_probe_is_repeated_before_it_settles():
    """A probe whose steps ran less than DECISIVE x slower says little on a noisy host: it
    takes SETTLED_AFTER of them in a row."""
    host = Host({2: 0.019, 1: 0.022})  # 1 thread 1.16x slower: kept, not decisive
    layout = ThreadLayout((2, 1), host.applied.append)
    used = host.run(layout, 2000)
    assert 0.022 / 0.019 < layout_module.DECISIVE
    assert layout.current == 2 and layout.probes == layout_module.SETTLED_AFTER
    assert used.count(1) == 4 * layout.probes and 1 not in used[200:]


def test_a_neighbour_moves_it_to_fewer_threads_at_once_and_back_when_it_leaves():
    host = Host({2: 0.019, 1: 0.032})
    changes: list[tuple[int, int]] = []
    layout = ThreadLayout((2, 1), host.applied.append, on_change=lambda a, b, _: changes.append((a, b)))
    host.run(layout, 500)  # settled on 2, its waits long
    host.seconds = {2: 0.071, 1: 0.032}  # a busy neighbour: 2 threads stall at every barrier
    used = host.run(layout, 60)
    assert changes == [(2, 1)]
    # The slow-down called a probe at once (its wait had grown to hundreds of steps): a few slow
    # steps, then 1 thread, with probes of 2 (4 steps each) now and then.
    assert used.index(1) <= 4 and used[used.index(1) : used.index(1) + 12] == [1] * 12
    assert used.count(1) >= 48
    host.seconds = {2: 0.019, 1: 0.032}  # the neighbour left
    host.run(layout, 100)
    assert changes == [(2, 1), (1, 2)] and layout.current == 2


def test_a_neighbour_that_starts_while_the_server_waits_is_seen_at_the_next_steps():
    """The slow-down is measured against the best the current choice made at that row count, not
    against the steps just before: a neighbour that starts between two bursts, after other row
    counts ran meanwhile, still calls a probe within a few steps (bench-neighbour's sequence:
    quiet c=1, quiet c=16, then the neighbour, then c=1)."""
    host = Host({2: 0.019, 1: 0.032})
    changes: list[tuple[int, int]] = []
    layout = ThreadLayout((2, 1), host.applied.append, on_change=lambda a, b, _: changes.append((a, b)))
    host.run(layout, 300, rows=1)  # settled on 2
    host.seconds = {2: 0.030, 1: 0.040}
    host.run(layout, 300, rows=16)  # another row count, long enough for rows=1 samples to go stale
    host.seconds = {2: 0.071, 1: 0.032}  # the neighbour starts while nothing runs
    used = host.run(layout, 40, rows=1)
    assert changes == [(2, 1)] and used.index(1) <= 4


def test_a_stream_whose_context_grows_is_not_taken_for_a_neighbour():
    """A step's attention grows with its rows' contexts: one stream's steps end ~3x its first ones
    here. The mark is kept per band of attended columns, so the growth calls no probe (a probe
    runs the stream's slowest steps), while a neighbour that starts mid-stream still calls one
    within a few steps."""

    def pace(threads: int, columns: int, neighbour: bool = False) -> float:
        base = {2: 0.071, 1: 0.032} if neighbour else {2: 0.010, 1: 0.016}
        return base[threads] * (1 + columns / 1000)

    def stream(layout: ThreadLayout, first: int, last: int, neighbour_from: int | None = None) -> list[int]:
        used = []
        for columns in range(first, last):
            threads = layout.pick(1)
            neighbour = neighbour_from is not None and columns >= neighbour_from
            layout.record(1, threads, pace(threads, columns, neighbour), columns)
            used.append(threads)
        return used

    changes: list[tuple[int, int]] = []
    layout = ThreadLayout((2, 1), lambda n: None, on_change=lambda a, b, _: changes.append((a, b)))
    stream(layout, 40, 300)  # settled on 2, after one decisive probe (1 thread 1.6x slower)
    assert layout.probes == 1
    for _ in range(3):  # streams of 2,000 tokens: their last steps 3x their first
        used = stream(layout, 40, 2040)
        assert 1 not in used
    assert layout.probes == 1 and changes == []
    used = stream(layout, 40, 1040, neighbour_from=600)  # a neighbour starts at column 600
    assert changes == [(2, 1)] and 1 in used[560:566]
    # The same steps without their columns: the growth alone is taken for a neighbour.
    blind = ThreadLayout((2, 1), lambda n: None)
    for columns in range(40, 2040):
        threads = blind.pick(1)
        blind.record(1, threads, pace(threads, columns))
    assert blind.probes > 1


def test_a_lasting_slow_down_that_fewer_threads_do_not_cure_is_probed_once():
    """The host turns 1.35x slower for good, and 2 threads stay the faster choice. One probe says
    so; the stream's later bands of columns, whose marks were set before the slow-down, call no
    more (each probe is 4 of the stream's slowest steps)."""

    def pace(threads: int, columns: int, slow: bool) -> float:
        base = {2: 0.0135, 1: 0.022} if slow else {2: 0.010, 1: 0.016}
        return base[threads] * (1 + columns / 1000)

    layout = ThreadLayout((2, 1), lambda n: None)
    for slow in (False, False, True, True):  # two streams before the slow-down, two after
        before = layout.probes
        for columns in range(40, 2040):
            threads = layout.pick(1)
            layout.record(1, threads, pace(threads, columns, slow), columns)
        if slow:
            assert layout.probes - before <= 1, layout.probes - before
    assert layout.current == 2 and layout.switches == 0


def test_a_slow_spell_that_fewer_threads_could_not_beat_calls_no_probe():
    """A shared host slows every count alike now and then (runs of ~20 steps at ~1.7x, measured at
    c=1 with the count pinned). Past SLOWER, but under the pace 1 thread showed at the last probe
    (1.7x slower than 2 here): a probe could not win, and its steps would be the stream's
    slowest. A neighbour that stalls 2 threads past that pace still calls one at once."""
    host = Host({2: 0.019, 1: 0.032})
    layout = ThreadLayout((2, 1), host.applied.append)
    host.run(layout, 200)  # settled on 2 after one probe
    assert layout.probes == 1
    for _ in range(5):  # spells 1.6x slower on both counts, between quiet stretches
        host.seconds = {2: 0.030, 1: 0.050}
        assert 1 not in host.run(layout, 20)
        host.seconds = {2: 0.019, 1: 0.032}
        host.run(layout, 50)
    assert 0.030 / 0.019 > layout_module.SLOWER and layout.probes == 1
    host.seconds = {2: 0.071, 1: 0.032}  # the neighbour
    used = host.run(layout, 20)
    assert layout.probes == 2 and used.index(1) <= 4 and layout.current == 1


def test_steps_it_cannot_compare_do_not_move_it():
    """Prompt steps (rows None) are not measured, and a probe at other rows than the current
    choice's recent steps decides nothing."""
    host = Host({2: 0.030, 1: 0.010})
    layout = ThreadLayout((2, 1), host.applied.append)
    for _ in range(200):
        assert layout.pick(None) == 2
        layout.record(None, 2, 1.0)
    assert layout.current == 2 and layout.probes == 0
    rows = iter(range(1, 10_000))  # every step another row count: never comparable
    for _ in range(300):
        count = next(rows)
        threads = layout.pick(count)
        layout.record(count, threads, host.seconds[threads])
    assert layout.current == 2 and layout.switches == 0


def test_within_the_margin_it_stays():
    host = Host({2: 0.020, 1: 0.0195})  # 1 thread 2.5 % faster: under MARGIN
    layout = ThreadLayout((2, 1), host.applied.append)
    host.run(layout, 1000)
    assert layout.current == 2 and layout.switches == 0
    assert layout_module.MARGIN > 1.025


def test_a_pinned_count_is_applied_once_and_never_probed():
    host = Host({3: 0.05})
    layout = ThreadLayout((3,), host.applied.append)
    assert set(host.run(layout, 500)) == {3} and host.applied == [3] and layout.probes == 0


def test_the_choices():
    assert choices_for(0, 2, "cpu") == ((2, 1), "auto: 2 or 1, by measured step time")
    assert choices_for(3, 2, "cpu") == ((3,), "--torch-threads 3")
    assert choices_for(0, 1, "cpu")[0] == (1,)
    assert choices_for(0, 8, "cuda")[0] == (8,)
    with pytest.raises(ValueError, match="positive"):
        ThreadLayout((2, 0), lambda n: None)


def test_results_depend_on_threads_finds_a_layer_that_splits_its_sums():
    """The start-up check sees a GEMM whose bits change with the thread count (a fake one: a
    sum in another order at each count) and passes the real packed layers on this host."""

    class Splits:
        in_features = 64

        def __call__(self, x: torch.Tensor) -> torch.Tensor:
            halves = torch.get_num_threads()
            parts = x.double().chunk(halves, dim=1)
            total = parts[0].sum(1)
            for part in parts[1:]:
                total = total + part.sum(1)
            return (total.float() * 1.0000001).unsqueeze(1) if halves == 1 else total.float().unsqueeze(1)

    assert "gives other bits" in (results_depend_on_threads([Splits()], (2, 1)) or "")
    before = torch.get_num_threads()
    from tokenwire_server.engine.native import Linear

    layers = [Linear(torch.randn(96, 64) * 0.1, None, packed=True, batch_hint=16)]
    assert results_depend_on_threads(layers, (2, 1)) is None
    assert torch.get_num_threads() == before  # the check leaves the count as it found it


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_a_stream_whose_steps_change_thread_count_gives_the_same_tokens(tiny_model_dir, dtype):
    """The premise of the layout, on the engine: streams whose steps alternate 2 and 1 threads
    give the tokens they give pinned at 2 (greedy and seeded), and the engine took its threads
    from the layout. The engine's own start-up check (results_depend_on_threads) passed here, or
    it would have pinned the count."""
    from engine_support import kernel_unbuildable, run_all
    from tokenwire_server.domain import GenerationRequest, SamplingOptions
    from tokenwire_server.engine import create_engine
    from tokenwire_server.engine.base import EngineLimits
    from tokenwire_server.model import load_model

    if kernel_unbuildable():
        pytest.skip(f"the layout needs the compiled ops: {kernel_unbuildable()}")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    quantization = "int8" if dtype == "int8" else "none"  # int8 weights: the 8-bit panels where the CPU runs them
    loaded = load_model(
        str(tiny_model_dir), device="cpu", dtype="float32" if dtype == "int8" else dtype, quantization=quantization
    )
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [11, 12, 13, 14]]
    kinds = [SamplingOptions(temperature=0.0), SamplingOptions(temperature=0.9, top_p=0.9, seed=7)]

    def requests():
        return [
            GenerationRequest(f"r{i}{k}", p, kind, 24, ignore_eos=True, want_tokens=True)
            for i, p in enumerate(prompts)
            for k, kind in enumerate(kinds)
        ]

    used: list[int] = []

    class Alternating(ThreadLayout):
        def pick(self, rows):
            threads = 1 if len(used) % 2 else 2
            torch.set_num_threads(threads)
            used.append(threads)
            return threads

    results = {}
    try:
        for name, threads in (("pinned", 2), ("alternating", 0)):
            engine = create_engine("batched", loaded, EngineLimits(8, 8, 8 * 256), workers=1, threads=threads)
            if name == "alternating":
                assert engine.layout.choices == (2, 1), engine.layout.choices
                engine.layout = Alternating((2, 1), torch.set_num_threads)
            else:
                assert engine.layout.choices == (2,)
            engine.start()
            try:
                results[name] = [r.token_ids for r in run_all(engine, requests())]
            finally:
                engine.close()
    finally:
        torch.set_num_threads(before)
    assert used.count(1) > 10 and used.count(2) > 10
    assert results["alternating"] == results["pinned"]
    assert all(len(tokens) == 24 for tokens in results["pinned"])


def test_the_first_probe_ends_within_the_warm_ups_decode_steps():
    """The first probe starts and ends inside WARM_UP_DECODE_STEPS decode steps, so on a quiet host
    (a decisive probe) no later step runs on fewer threads."""
    host = Host({2: 0.019, 1: 0.032})
    layout = ThreadLayout((2, 1), host.applied.append)
    warm = host.run(layout, layout_module.WARM_UP_DECODE_STEPS)
    assert layout.probes == 1 and warm.count(1) == layout_module.PROBE_STEPS and warm[-1] == 1
    assert 1 not in host.run(layout, 1000)


def test_the_servers_warm_up_runs_the_first_probe(tiny_model_dir: Path) -> None:
    """The server's warm-up generation (server.warm_up) holds the layout's first probe: a first
    caller finds it over (the probe's steps on fewer threads were a fresh server's slowest)."""
    import asyncio

    from tokenwire_server.config import ServerConfig
    from tokenwire_server.engine import create_engine
    from tokenwire_server.engine.base import EngineLimits
    from tokenwire_server.engine.local import LocalBackend
    from tokenwire_server.model import load_model
    from tokenwire_server.server import warm_up

    before = torch.get_num_threads()
    torch.set_num_threads(2)  # a choice of 2 or 1 (the suite's workers may run on one each)
    try:
        loaded = load_model(str(tiny_model_dir), device="cpu", dtype="float32")
        engine = create_engine("batched", loaded, EngineLimits(4, 4, 4 * 2048), workers=1)
        limits = ServerConfig().request_limits(loaded.context_length, loaded.vocab_size)
        backend = LocalBackend(loaded, engine, limits)
        engine.start()
        try:
            layout = engine.layout  # type: ignore[attr-defined]
            assert layout.choices == (2, 1) and layout.probes == 0
            asyncio.run(warm_up(backend))
            assert layout.probes == 1 and layout._probing is None  # begun and decided
        finally:
            engine.close()
    finally:
        torch.set_num_threads(before)
