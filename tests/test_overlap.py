"""``--overlap``: the batched engine delivers step N's text while step N+1 runs (CUDA's
default). On this CPU the host computes each step itself, so nothing is hidden here; what
is checked is that the overlapped loop gives exactly the plain loop's streams: the same
events, tokens, log-probabilities and endings for every kind of request in one batch, a
stop sequence that ends a row already launched into the next step, cancellation, and
every block back in the pool afterwards. (Faults with overlap: production/test_faults.py,
the batched-overlap engine; constrained rows: test_structured.py.)"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_support import Recorder, run_all
from tokenwire_server import transfer
from tokenwire_server.domain import (
    ErrorEvent,
    ErrorKind,
    FinishEvent,
    FinishReason,
    GenerationRequest,
    RequestHandle,
    ResponseFormat,
    SamplingOptions,
)
from tokenwire_server.engine import create_engine
from tokenwire_server.engine.base import EngineLimits
from tokenwire_server.engine.generation import Generation
from tokenwire_server.engine.sampling import Sampler
from tokenwire_server.model import load_model
from torch.overrides import TorchFunctionMode

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def loaded(tiny_model_dir: Path) -> Any:
    return load_model(str(tiny_model_dir))


def engine(loaded: Any, overlap: str, **kwargs: Any) -> Any:
    limits = EngineLimits(max_active=8, max_queue=16, kv_cache_tokens=8 * 1024, max_prefill_tokens=12)
    eng = create_engine("batched", loaded, limits, workers=1, overlap=overlap, **kwargs)
    assert eng.overlap is (overlap == "on")
    return eng


def requests(loaded: Any, stop: str) -> list[GenerationRequest]:
    tok = loaded.tokenizer

    def req(rid: str, text: str, new: int, sampling: SamplingOptions, **more: Any) -> GenerationRequest:
        return GenerationRequest(rid, tok(text)["input_ids"], sampling, new, **more)

    greedy = SamplingOptions(temperature=0.0)
    return [
        req("greedy", "The weather today", 24, greedy, ignore_eos=True, want_tokens=True),
        req(
            "seeded",
            "Once upon a time",
            24,
            SamplingOptions(temperature=0.9, top_k=30, top_p=0.9, seed=7),
            ignore_eos=True,
        ),
        req(
            "penalty",
            "In a galaxy far",
            24,
            SamplingOptions(temperature=0.8, repetition_penalty=1.4, seed=3),
            ignore_eos=True,
            want_logprobs=True,
            top_logprobs=3,
        ),  # fmt: skip
        req("stop", "The weather today", 24, greedy, ignore_eos=True, stop_sequences=(stop,)),
        req("short", "Numbers: 1, 2,", 3, greedy, ignore_eos=True),
        req("eos", "Hello", 40, SamplingOptions(temperature=1.0, seed=11), min_new_tokens=2, want_tokens=True),
        req("long-prompt", "word " * 60, 8, greedy, ignore_eos=True),  # read in several chunks beside the others
    ]


def stop_after(loaded: Any, rec: Recorder, tokens: int) -> str:
    """Four characters of ``rec``'s text first found past its first ``tokens`` tokens' text, so
    a stop sequence made of them ends the stream while it decodes, not at its first token."""
    text = rec.text
    head = len(
        loaded.tokenizer.decode(rec.token_ids[:tokens], skip_special_tokens=True, clean_up_tokenization_spaces=False)
    )
    stop = next((text[i : i + 4] for i in range(head, len(text) - 3) if text.find(text[i : i + 4]) >= head), None)
    assert stop is not None, text
    return stop


def stream(rec: Recorder) -> list[tuple[Any, ...]]:
    """A stream as the caller sees it, less its timings."""
    out: list[tuple[Any, ...]] = []
    for event in rec.events:
        if isinstance(event, FinishEvent):
            out.append(
                (
                    "finish",
                    event.text,
                    event.tokens,
                    event.reason,
                    event.usage.completion_tokens,
                    event.usage.prompt_tokens,
                )
            )
        elif isinstance(event, ErrorEvent):
            out.append(("error", event.kind, event.message))
        else:
            out.append(("text", event.text, event.tokens))
    return out


def run(loaded: Any, overlap: str, reqs: list[GenerationRequest]) -> tuple[list[Recorder], Any]:
    eng = engine(loaded, overlap)
    eng.start()
    try:
        recorders = run_all(eng, reqs, timeout=120)
        # The streams can end before the loop has collected the step it launched last (a row a
        # stop sequence ended was launched into one more), which is counted once collected:
        # wait until nothing is in flight; close() then joins the loop, which finishes the
        # step it is collecting (and counts it) before it sees the stop.
        deadline = time.monotonic() + 30
        while eng._flight is not None and time.monotonic() < deadline:
            time.sleep(0.005)
        assert eng._flight is None, "the loop never collected its last step"
        return recorders, eng
    finally:
        eng.close()


def test_the_overlapped_loop_gives_the_plain_loops_streams_event_for_event(loaded: Any) -> None:
    alone = run(loaded, "off", requests(loaded, "x"))[0][0]
    stop = stop_after(loaded, alone, 3)  # a stop sequence the greedy row reaches mid-stream
    plain, plain_engine = run(loaded, "off", requests(loaded, stop))
    overlapped, overlap_engine = run(loaded, "on", requests(loaded, stop))
    for p, o in zip(plain, overlapped, strict=True):
        assert stream(o) == stream(p), o.request.request_id if o.request else ""
    ends = {rec.request.request_id: rec.last.reason for rec in overlapped if rec.request}
    assert ends["stop"] is FinishReason.STOP_SEQUENCE and ends["short"] is FinishReason.LENGTH
    assert overlapped[3].text == alone.text[: alone.text.index(stop)]
    assert any(event.tokens and event.tokens[0].top for event in overlapped[2].events)  # log-probabilities came
    # Every block back in the pool, and both loops ran the same decode steps but for the
    # stopped row's dropped one (it shares a step with the others, so no extra step).
    assert plain_engine.kv_tokens_reserved() == 0 and overlap_engine.kv_tokens_reserved() == 0
    assert overlap_engine.steps == plain_engine.steps


def test_a_row_that_a_stop_sequence_ends_has_its_next_pick_dropped(loaded: Any) -> None:
    """Alone, a row stopped by a stop sequence has already been launched into one more step:
    that step runs (one more than the plain loop), and its token goes nowhere."""
    tok = loaded.tokenizer
    base = GenerationRequest(
        "s",
        tok("The weather today")["input_ids"],
        SamplingOptions(temperature=0.0),
        24,
        ignore_eos=True,
        want_tokens=True,
    )
    stop = stop_after(loaded, run(loaded, "off", [base])[0][0], 3)
    stopped = GenerationRequest(
        "s", base.prompt_ids, base.sampling, 24, ignore_eos=True, stop_sequences=(stop,), want_tokens=True
    )
    (plain,), plain_engine = run(loaded, "off", [stopped])
    (overlapped,), overlap_engine = run(loaded, "on", [stopped])
    assert stream(overlapped) == stream(plain)
    assert overlapped.last.reason is FinishReason.STOP_SEQUENCE
    assert plain_engine.steps >= 2  # it stopped while decoding, not at its prompt's token
    assert overlap_engine.steps == plain_engine.steps + 1
    assert overlap_engine.kv_tokens_reserved() == 0


def test_a_cancelled_stream_leaves_and_the_others_go_on_with_their_own_tokens(loaded: Any) -> None:
    tok = loaded.tokenizer
    greedy = SamplingOptions(temperature=0.0)
    keep = GenerationRequest("keep", tok("Once upon a time")["input_ids"], greedy, 40, ignore_eos=True)
    reference = run(loaded, "on", [keep])[0][0]
    eng = engine(loaded, "on")
    eng.start()
    try:
        gone, kept = Recorder(), Recorder()
        kept.request = keep
        handle = eng.submit(
            GenerationRequest("gone", tok("In a galaxy far")["input_ids"], greedy, 2000, ignore_eos=True), gone
        )
        eng.submit(keep, kept)
        deadline = time.monotonic() + 30
        while len(gone.events) < 3 and time.monotonic() < deadline:
            time.sleep(0.005)
        handle.cancel()
        assert kept.done.wait(60)
        deadline = time.monotonic() + 10
        while eng.kv_tokens_reserved() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert eng.kv_tokens_reserved() == 0  # the cancelled row's blocks came back
    finally:
        eng.close()
    assert stream(kept) == stream(reference)
    assert not gone.done.is_set() and len(gone.events) < 2000  # it stopped, and nothing ended it as if it had finished


def test_auto_overlaps_on_cuda_only(loaded: Any) -> None:
    eng = create_engine("batched", loaded, EngineLimits(2, 4, 1024), workers=1, overlap="auto")
    assert eng.overlap is False  # this CPU computes its steps on the host: nothing to overlap with
    with pytest.raises(ValueError, match="unknown overlap"):
        create_engine("batched", loaded, EngineLimits(2, 4, 1024), workers=1, overlap="sometimes")


# -- what the host queues after the forward pass does not make it wait -------------------
#
# On CUDA a plain host -> device copy synchronises the stream: made after the forward pass
# is queued (the kept rows, the sampler's parameters), it would make the host wait for the
# whole pass, the wait --overlap hides. There is no CUDA here, so the step runs on ``meta``
# (no data: a launch that read a device value would fail there) taken for CUDA, and every
# host -> device transfer is recorded: blocking, or queued from pinned memory.


class Transfers(TorchFunctionMode):
    """Host -> device transfers made under it. A CPU build of torch cannot pin memory, so
    ``pin_memory`` stands in: it marks the tensor, and only a marked tensor copied with
    ``non_blocking=True`` counts as queued; anything else that crosses is blocking, the
    implicit copies included: a device tensor indexed with a host tensor or a list, or any
    op given a device tensor and a host tensor (one with dimensions: a 0-d host tensor is a
    number the host reads)."""

    INDEXING = (torch.Tensor.__getitem__, torch.Tensor.__setitem__, torch.Tensor.index_put_, torch.index_put)

    def __init__(self) -> None:
        super().__init__()
        self.blocking: list[str] = []
        self.queued = 0
        self.queued_by: list[str] = []  # where each queued copy was made (caller)
        self._pinned: set[int] = set()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if func is torch.Tensor.pin_memory:
            self._pinned.add(id(args[0]))
            return args[0]
        if func in (torch.tensor, torch.as_tensor) and on_device(kwargs.get("device")):
            self.blocking.append(f"torch.{name}(..., device={kwargs['device']})")
        elif func is torch.Tensor.to and args[0].device.type == "cpu":
            target = next((a for a in (*args[1:], kwargs.get("device")) if isinstance(a, (str, torch.device))), None)
            if on_device(target):
                self._cross(args[0], kwargs, f"Tensor.to({target}, non_blocking={kwargs.get('non_blocking', False)})")
        elif func is torch.Tensor.copy_ and on_device(args[0].device) and args[1].device.type == "cpu":
            self._cross(args[1], kwargs, "Tensor.copy_ from the host")
        else:
            operands = list(flatten((args, kwargs)))
            if any(isinstance(t, torch.Tensor) and on_device(t.device) for t in operands):
                if any(isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.dim() > 0 for t in operands):
                    self.blocking.append(f"{name} with a host tensor")
                elif func in self.INDEXING and any(isinstance(i, list) for i in flatten(args[1:2], lists=False)):
                    self.blocking.append(f"{name} with a list index")
        return func(*args, **kwargs)

    def _cross(self, tensor: torch.Tensor, kwargs: dict[str, Any], what: str) -> None:
        if kwargs.get("non_blocking") and id(tensor) in self._pinned:
            self.queued += 1
            self.queued_by.append(caller())
        else:
            self.blocking.append(what)


def caller() -> str:
    """``file:function`` of the product code that made a transfer (past transfer.py and torch)."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if "tokenwire_server" in path and not path.endswith("transfer.py"):
            return f"{Path(path).stem}:{frame.f_code.co_name}"
        frame = frame.f_back  # type: ignore[assignment]
    return "?"


def flatten(value: Any, lists: bool = True) -> Iterator[Any]:
    """Every leaf of nested tuples, dicts (values) and (``lists``) lists."""
    if isinstance(value, tuple) or (lists and isinstance(value, list)):
        for item in value:
            yield from flatten(item, lists)
    elif isinstance(value, dict):
        for item in value.values():
            yield from flatten(item, lists)
    else:
        yield value


def test_the_recorder_sees_the_implicit_copies() -> None:
    """What the checks below rest on: each way a host value reaches the device is seen."""
    device = torch.empty(4, 8, device="meta")
    pinned = torch.tensor([0, 1]).pin_memory() if torch.cuda.is_available() else torch.tensor([0, 1])
    with Transfers() as transfers:
        device[torch.tensor([0, 1])]
        device[[0, 1]]
        device[torch.tensor([0, 1]), torch.tensor([2, 3])] = 1.0
        device.index_select(0, torch.tensor([1]))
        torch.tensor([1], device="meta")
        torch.tensor([1]).to("meta")
        device.copy_(torch.zeros(4, 8))
        device[0], device[1:3], device[torch.tensor(2)]  # a number and slices: nothing crosses
        device * torch.tensor(2.0)
        index = pinned.pin_memory().to("meta", non_blocking=True)
        device[index]
    assert transfers.blocking == [
        "__getitem__ with a host tensor",
        "__getitem__ with a list index",
        "__setitem__ with a host tensor",
        "index_select with a host tensor",
        "torch.tensor(..., device=meta)",
        "Tensor.to(meta, non_blocking=False)",
        "Tensor.copy_ from the host",
    ]
    assert transfers.queued == 1


def on_device(device: Any) -> bool:
    return device is not None and torch.device(device).type != "cpu"


@pytest.fixture
def meta_as_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transfer, "PINNED_DEVICE_TYPES", frozenset({"cuda", "meta"}))


def generation(prompt: list[int], sampling: SamplingOptions, generated: list[int], **more: Any) -> Generation:
    request = GenerationRequest("r", prompt, sampling, 8, **more)
    seq = Generation(request, RequestHandle(), lambda event: None, None, (2,), torch.device("cpu"))
    seq.generated = list(generated)
    return seq


def test_the_sampler_launch_queues_its_parameters_without_waiting(meta_as_cuda: None) -> None:
    """Greedy, seeded top-k/top-p, a repetition penalty, EOS blocked by min_new_tokens and
    log-probabilities, in one batch: their launch crosses to the device only by queued copies."""
    rows = [
        generation([5], SamplingOptions(temperature=0.0), [], ignore_eos=True),
        generation([5, 6], SamplingOptions(temperature=0.9, top_k=20, top_p=0.8, seed=11), [7], ignore_eos=True),
        generation(
            [7, 7, 9], SamplingOptions(temperature=1.2, repetition_penalty=1.3, seed=12), [9, 4], ignore_eos=True
        ),
        generation(
            [1], SamplingOptions(temperature=0.7, seed=13), [], min_new_tokens=4, want_logprobs=True, top_logprobs=3
        ),
    ]
    with Transfers() as transfers:
        drawn = Sampler([2]).launch(torch.empty(4, 500, device="meta"), rows)
    assert drawn.values.device.type == "meta" and drawn.values.shape == (4, 1 + 1 + 2 * 3)
    assert transfers.blocking == []
    # The penalty's rows, columns and factors (3), the EOS block's rows and ids (2), the rows
    # drawn, their temperatures, keys, top-k, top-p and top-p flags (6): each once, queued.
    assert transfers.queued == 11


def test_an_eager_native_step_queues_its_inputs_without_waiting(tiny_model_dir: Path, meta_as_cuda: None) -> None:
    """Decode rows beside a prompt chunk, only some positions' logits kept: the native pass's
    inputs, attention plans, KV write index and kept-rows index cross only by queued copies."""
    from engine_support import BLOCK, SLOTS, slot_segment
    from tokenwire_server.engine.kv import PagedCache
    from tokenwire_server.engine.native import NativeForward
    from tokenwire_server.model import attention_shape

    model = load_model(str(tiny_model_dir)).model.to("meta")  # its own copy: the module's model stays on the CPU
    _, kv_heads, head_dim = attention_shape(model.config)
    placements = [(torch.device("meta"), torch.float32)] * model.config.num_hidden_layers
    native = NativeForward(
        model,
        PagedCache(SLOTS * 256 // BLOCK, BLOCK, kv_heads, head_dim, placements),
        batch_hint=4,
        kernel_choice="torch",
    )
    ids, positions = torch.tensor([5, 5, *range(10, 25)]), torch.tensor([37, 37, *range(15)])
    with Transfers() as transfers:
        logits = native(
            ids, positions, [slot_segment(0, 37, 1), slot_segment(1, 37, 1), slot_segment(2, 0, 15)], [0, 1, 16]
        )
    assert logits.device.type == "meta" and logits.shape[0] == 3
    assert transfers.blocking == []
    assert transfers.queued == 9  # ids, positions, decode tables/lengths/mask, chunk table/mask, write index, kept rows


def test_transformers_forward_and_the_grammar_mask_queue_their_inputs_without_waiting(
    tiny_model_dir: Path, meta_as_cuda: None
) -> None:
    """CUDA's default forward (transformers' model over the block cache) and a constrained
    row's token mask, in two steps of a real engine on ``meta``: three prompts read whole
    (a JSON row, a penalised sampled row, a greedy row with EOS blocked), then their decode
    rows beside a chunk of a longer prompt that does not emit yet. Nothing crosses but by
    queued copies."""
    import collections
    import dataclasses

    loaded = load_model(str(tiny_model_dir))  # its own copy: the module's model stays on the CPU
    meta = dataclasses.replace(loaded, model=loaded.model.to("meta"), device=torch.device("meta"))
    (brace,) = loaded.tokenizer("{")["input_ids"]
    engine = create_engine(
        "batched", meta, EngineLimits(4, 8, 1024, max_prefill_tokens=16), workers=1, forward="transformers"
    )
    tok = loaded.tokenizer

    def submit(rid: str, text: str, sampling: SamplingOptions, **more: Any) -> None:
        engine.submit(GenerationRequest(rid, tok(text)["input_ids"], sampling, 8, **more), lambda event: None)

    submit("json", "Give JSON", SamplingOptions(temperature=0.7, seed=3), response_format=ResponseFormat("json_object"))
    submit("penalised", "The weather", SamplingOptions(temperature=1.0, repetition_penalty=1.3, seed=4))
    submit("greedy", "Hello there", SamplingOptions(temperature=0.0), min_new_tokens=3)
    scheduler = engine.scheduler
    scheduler.admit(wait=False)
    steps = []
    for _ in range(2):
        plan = scheduler.schedule()
        with Transfers() as transfers:
            launched = engine.runner.launch(plan)
        assert launched.drawn is not None and launched.drawn.values.device.type == "meta"
        steps.append((plan, transfers))
        # What collect would read back, made up (meta holds no values): each emitting row's
        # token, one its format allows for the JSON row.
        picks = [(brace if row.seq.request.request_id == "json" else 17, None, (), ()) for row in plan.emitters]
        scheduler.postprocess(plan, picks)
        submit("long", "once upon a time " * 8, SamplingOptions(temperature=0.0))
        scheduler.admit(wait=False)
    (first, one), (second, two) = steps
    assert [p.decodes for p in first.parts] == [False] * 3 and len(first.emitters) == 3
    assert [p.decodes for p in second.parts] == [True] * 3 + [False] and len(second.emitters) == 3
    assert one.blocking == [] and two.blocking == []
    # Each pass: ids and positions (2: the mask is made on the device from the positions, and
    # each row's last token is the pass's last position, ``logits_to_keep=1``), the cache's write
    # index, tables and lengths (3); the sampler: the penalty (3), the EOS block (2), the rows
    # drawn (1), two of _draw's parameters, the grammar's mask and rows (2).
    expected = {
        "runner:_pass": 2, "kv:on": 3, "sampling:launch": 6, "sampling:_draw": 2,
        "structured:apply_constraints": 2,
    }  # fmt: skip
    assert collections.Counter(one.queued_by) == expected
    # The second step: two passes (decode rows, then the chunk; its logits dropped, not picked
    # out, as it does not emit), so the pass's transfers twice.
    assert collections.Counter(two.queued_by) == {**expected, "runner:_pass": 4, "kv:on": 6}


def test_out_of_memory_where_a_step_is_collected_fails_only_the_newest_row(
    loaded: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One out-of-memory policy wherever the step runs out (``Engine._out_of_memory``): an error
    raised while the overlapped loop collects a step, outside the launch that retries, ends the
    newest row RESOURCE_EXHAUSTED, and the rows admitted before it finish with the tokens they
    have undisturbed (nothing of the step was taken, so they run it again)."""
    greedy = SamplingOptions(temperature=0.0)
    tok = loaded.tokenizer
    reqs = [
        GenerationRequest(f"r{i}", tok(text)["input_ids"], greedy, 16, ignore_eos=True, want_tokens=True)
        for i, text in enumerate(["The weather today", "Once upon a time", "In a galaxy far"])
    ]
    undisturbed = [rec.token_ids for rec in run(loaded, "on", reqs)[0]]
    eng = engine(loaded, "on")
    collect = eng.runner.collect
    calls = {"n": 0, "raised": 0}

    def collect_once_out_of_memory(launched: Any) -> Any:
        calls["n"] += 1
        # Once, a few steps in, while all three decode together.
        if not calls["raised"] and calls["n"] >= 4 and len(launched.plan.rows) == 3 and not launched.plan.prompt_tokens:
            calls["raised"] += 1
            raise torch.OutOfMemoryError("CUDA out of memory (simulated, in collect)")
        return collect(launched)

    monkeypatch.setattr(eng.runner, "collect", collect_once_out_of_memory)
    eng.start()
    try:
        recs = run_all(eng, reqs, timeout=120)
    finally:
        eng.close()
    assert calls["raised"] == 1
    *older, newest = recs
    assert isinstance(newest.last, ErrorEvent) and newest.last.kind is ErrorKind.OUT_OF_MEMORY, newest.last
    assert "the newest request gave way" in newest.last.message
    for rec, expected in zip(older, undisturbed, strict=False):
        assert isinstance(rec.last, FinishEvent), rec.last
        assert rec.token_ids == expected
